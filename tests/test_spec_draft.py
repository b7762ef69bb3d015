"""The executor's draft model: its proposals, through the step pipeline, give the tokens of plain decoding; a draft
that is the served model itself is always right (so its mirrored KV cache is); mismatches are refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.step import SamplingSettings
from executor_svc.runtime.config import UnsupportedModel
from executor_svc.runtime.model_executor import ModelExecutor
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401
from tests.spec_helpers import SpecDriver
from tests.test_spec_model import executor_for, plain, prompts


def drafted(executor: ModelExecutor, requests: dict[int, list[int]], max_tokens: int, k: int,
            sampling: SamplingSettings | None = None) -> tuple[dict[int, list[int]], list[int]]:
    driver = SpecDriver(executor)
    kwargs = {} if sampling is None else {"sampling": sampling}
    out = driver.generate(requests, max_tokens, lambda rid, tokens: k, **kwargs)
    counts = [n for result in driver.results for n in result.num_sampled_tokens]
    driver.finish()
    return out, counts


def test_a_draft_that_is_the_served_model_is_always_accepted(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    folder = tiny_model_folders["qwen3"]
    executor = executor_for(folder, speculative_model=str(folder))
    assert executor.get_info().draft_model_id == str(folder)
    # Its KV cache is the target's size again: half the blocks in the same budget.
    assert executor.get_info().num_blocks == executor_for(folder).get_info().num_blocks // 2
    requests = prompts(executor.get_info().vocab_size, 3, seed=11)
    reference = plain(executor, requests, 15)
    out, counts = drafted(executor, requests, 15, 3)
    assert out == reference
    assert counts and set(counts) == {4}, "an exact draft's every proposal is the target's token"
    seeded = SamplingSettings(temperature=1.0, seed=99)
    out, counts = drafted(executor, requests, 15, 3, seeded)
    assert out == plain(executor, requests, 15, seeded)
    assert set(counts) == {4}, "seeded draws of an exact draft share the target's noise"


def test_an_early_exit_draft_gives_the_tokens_of_plain_decoding(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    executor = executor_for(tiny_model_folders["qwen3"], speculative_draft_layers=1)
    assert executor.get_info().draft_model_id.endswith(":first-1-layers")
    requests = prompts(executor.get_info().vocab_size, 3, seed=12)
    reference = plain(executor, requests, 12)
    assert drafted(executor, requests, 12, 2)[0] == reference


def test_smollm2_early_exit_draft_gives_the_tokens_of_plain_decoding(smollm2_folder: Path) -> None:  # noqa: F811
    executor = executor_for(smollm2_folder, speculative_draft_layers=12)
    requests = {1: [1, 504, 3458, 282, 253, 1694, 30], 2: [1, 28, 29, 30, 28, 29, 30, 28, 29]}
    reference = plain(executor, requests, 12)
    out, counts = drafted(executor, requests, 12, 3)
    assert out == reference
    assert max(counts) > 1, "the early exit should be right some times"


@pytest.mark.parametrize(("options", "message"), [
    ({"speculative_draft_layers": 2}, r"must be in \[1, 1\]"),
    ({"speculative_draft_layers": 1, "speculative_model": "x"}, "not both"),
    ({"speculative_draft_layers": 1, "tensor_parallel_size": 2}, "tensor-parallel size 1 only"),
])
def test_a_draft_the_executor_cannot_run_is_refused(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                    options: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        executor_for(tiny_model_folders["qwen3"], **options)


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_folders: dict[str, Path],  # noqa: F811
                                                    smollm2_folder: Path) -> None:  # noqa: F811
    with pytest.raises(UnsupportedModel, match="same tokenizer"):
        executor_for(tiny_model_folders["qwen3"], speculative_model=str(smollm2_folder))
