"""At temperature 1, unseeded rows verifying proposals emit tokens from the target's distribution: a chi-square test
over many draws of a tiny model's two-proposal verification, which an acceptance rule that always accepts fails."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import torch

from common.step import SamplingSettings
from executor_svc.core.request_table import RequestState, ScheduledChunk
from executor_svc.runtime.model_input import prepare_input
from executor_svc.runtime.model_runner import ModelRunner
from executor_svc.sample.constraints import GrammarConstraints
from executor_svc.sample.sampler import Sampler, filtered_probs
from executor_svc.spec.verify import verify
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.test_spec_model import executor_for

DRAWS = 6000
SETTINGS = SamplingSettings(temperature=1.0, top_k=6)


def next_token_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The float32 logits after each prefix of ``tokens`` (row i: after tokens[: i + 1])."""
    state = RequestState(0, tokens, list(range(-(-len(tokens) // runner.block_size))), 0, SETTINGS, len(tokens))
    chunk = ScheduledChunk(state, 0, len(tokens))
    return runner.execute(prepare_input([chunk], runner.block_size, list(range(len(tokens)))))[1:].float()


def critical_value(df: int, z: float = 3.09) -> float:
    """The chi-square statistic exceeded with probability about 0.001 (Wilson-Hilferty; z is that normal quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Counter, expected: dict[tuple[int, ...], float], draws: int) -> tuple[float, int]:
    """The statistic and its degrees of freedom, outcomes expected fewer than 5 times pooled into one bin."""
    small = [o for o, p in expected.items() if p * draws < 5]
    bins = [([o], p) for o, p in expected.items() if p * draws >= 5]
    bins.append((small + [o for o in counts if o not in expected], sum(expected[o] for o in small)))
    stat = 0.0
    for outcomes, p in bins:
        seen = sum(counts[o] for o in outcomes)
        if p > 0:
            stat += (seen - p * draws) ** 2 / (p * draws)
        elif seen:
            return math.inf, len(bins) - 1
    return stat, len(bins) - 1


def test_sampled_verification_keeps_the_target_distribution(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    runner = executor_for(tiny_model_folders["qwen3"]).runner
    prompt = [5, 77, 300, 41, 9]
    # The target's filtered distributions after the prompt and its last token, then after each proposal.
    d1 = int(next_token_logits(runner, prompt + [0])[-1].argmax())  # likely: both its branches are drawn often
    d2 = int(next_token_logits(runner, prompt + [0, d1])[-1].topk(2).indices[1])
    logits = next_token_logits(runner, prompt + [0, d1, d2])[-3:]
    p0, p1, p2 = filtered_probs(logits, [SETTINGS] * 3).tolist()
    expected = {(t,): p for t, p in enumerate(p0) if p > 0 and t != d1}
    expected |= {(d1, t): p0[d1] * p for t, p in enumerate(p1) if p > 0 and t != d2}
    expected |= {(d1, d2, t): p0[d1] * p1[d2] * p for t, p in enumerate(p2) if p > 0}

    start = len(prompt)  # the row's last token (0) is at this position; d1 and d2 follow
    chunks = [ScheduledChunk(RequestState(i, prompt + [0], [], start, SETTINGS, len(prompt)), start, 3, 1, 2, [d1, d2])
              for i in range(DRAWS)]
    constraints = GrammarConstraints(Path("no-tokenizer.json"), logits.shape[1], ())
    verified = verify(logits.repeat(DRAWS, 1), chunks, Sampler(seed=0), constraints)
    counts = Counter(tuple(tokens) for tokens in verified.token_ids)
    stat, df = chi_square(counts, expected, DRAWS)
    assert stat < critical_value(df), f"chi-square {stat:.1f} with {df} degrees of freedom"
    assert all(chunk.state.token_ids == prompt + [0] for chunk in chunks), "the requests' tokens were left changed"

    # Always accepting would emit d1, d2 and a token after them every time: the same test must reject that.
    generator = torch.Generator().manual_seed(1)
    thirds = torch.multinomial(torch.tensor(p2), DRAWS, replacement=True, generator=generator).tolist()
    always = Counter((d1, d2, t) for t in thirds)
    assert chi_square(always, expected, DRAWS)[0] > critical_value(df)
