"""Repetition/presence/frequency penalties, logit bias and min_tokens match Hugging Face transformers.

Greedy, float32, token for token, every request with its own settings in one continuous batch: through the
scheduler ``Engine`` in-process and through the public gRPC API. The references are transformers' own processors
(``repetition_penalty``, ``min_new_tokens``, ``sequence_bias``) and, for presence/frequency penalties, which
transformers lacks, a plain logits processor with OpenAI's formula.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import executor_pb2 as pb
from nanoserve.v1 import generation_pb2 as gen_pb
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.model_fixtures import TINY_VOCAB, in_spinning_process, smollm2_folder, tiny_model_folders  # noqa: F401
from tests.service_fixtures import assert_idle_async, in_process_scheduler

EOS = 2  # SmolLM2's <|im_end|>
PERIOD = 30  # SmolLM2's "."


class OpenAIPenalties(LogitsProcessor):
    """presence/frequency penalties over the completion: logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_length :], minlength=scores.shape[1]).float()
        return scores - (self.frequency * counts + self.presence * (counts > 0))


@dataclass
class Case:
    """One request: its prompt, executor-side sampling fields and the matching ``generate`` arguments."""

    prompt: list[int]
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    hf: dict = field(default_factory=dict)
    max_tokens: int = 24
    stop_token_ids: frozenset[int] = frozenset()


def hf_generate(model: AutoModelForCausalLM, case: Case, eos_token_ids: list[int] | None) -> list[int]:
    """transformers' greedy completion of ``case``; a presence/frequency case runs OpenAIPenalties."""
    kwargs = dict(case.hf)
    s = case.sampling
    if s.presence_penalty or s.frequency_penalty:
        penalties = OpenAIPenalties(len(case.prompt), s.presence_penalty, s.frequency_penalty)
        kwargs["logits_processor"] = LogitsProcessorList([penalties])
    # Set on the model's own config: generate fills a None it is given from there (so an EOS would stay).
    config = model.generation_config
    config.eos_token_id = None if eos_token_ids is None else [*eos_token_ids, *case.stop_token_ids]
    config.pad_token_id = 0
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([case.prompt]), max_new_tokens=case.max_tokens, do_sample=False, generation_config=config,
            **kwargs,
        )
    return out[0, len(case.prompt) :].tolist()


def hf_generate_all(folder: Path, cases: list[Case], eos_token_ids: list[int] | None) -> list[list[int]]:
    """``hf_generate`` of every case on the model in ``folder``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_generate(model, case, eos_token_ids) for case in cases]


def sampling_params(case: Case, ignore_eos: bool) -> SamplingParams:
    s = case.sampling
    return SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=ignore_eos,
                          stop_token_ids=case.stop_token_ids, repetition_penalty=s.repetition_penalty or 1.0,
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens)


def engine_generate(folder: Path, cases: list[Case], ignore_eos: bool, **options) -> tuple[list[list[int]], int]:
    """Every case in one Engine run: the tokens of each, and how many preemptions there were."""
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), threads=2, **options))
    engine = Engine(executor, SchedulerConfig())
    completions = engine.generate([c.prompt for c in cases], [sampling_params(c, ignore_eos) for c in cases])
    return [c.token_ids for c in completions], engine.scheduler.num_preemptions


def grpc_generate(folder: Path, cases: list[Case], **options) -> list[list[int]]:
    """Every case at once through the public API, as GenerateRequests with the same options."""
    requests = []
    for case in cases:
        s = case.sampling
        stopping = gen_pb.StoppingOptions(max_tokens=case.max_tokens, min_tokens=s.min_tokens,
                                          stop_token_ids=sorted(case.stop_token_ids))
        request = gen_pb.GenerateRequest(tokens=gen_pb.TokenPrompt(token_ids=case.prompt), stopping=stopping)
        request.sampling.temperature = 0.0
        if s.HasField("repetition_penalty"):
            request.sampling.repetition_penalty = s.repetition_penalty
        request.sampling.logit_bias.update(s.logit_bias)
        requests.append(request)

    async def run() -> list[list[int]]:
        executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), threads=2, **options))
        async with in_process_scheduler(executor) as server:
            responses = await asyncio.gather(*(server.stub.GenerateOnce(r) for r in requests))
            await assert_idle_async(server.stub)
        return [list(r.token_ids) for r in responses]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def smollm2_cases(smollm2_folder: Path) -> tuple[list[Case], list[list[int]]]:  # noqa: F811
    """Requests with every option, and transformers' completions of them."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    capital = tokenizer("The capital of France is")["input_ids"]
    fruits = tokenizer("List of fruits: apple, banana, apple, banana, apple,")["input_ids"]
    # Greedy, these end early: "The sky is indeed a brilliant blue." (8 tokens and EOS) and "The answer to this
    # classic math problem is 4." (11 and EOS).
    sky, sum_ = chat("Answer with one word: is the sky blue?"), chat("What is 2+2?")
    paris = 7042
    cases = [
        Case(capital),
        Case(fruits, pb.SamplingParams(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
        Case(capital, pb.SamplingParams(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
        Case(sky, pb.SamplingParams(min_tokens=16), dict(min_new_tokens=16)),
        # The stop id "." is masked too, until the completion holds 11 tokens; then it ends the request.
        Case(sum_, pb.SamplingParams(min_tokens=11, stop_token_ids=[PERIOD]), dict(min_new_tokens=11),
             max_tokens=48, stop_token_ids=frozenset({PERIOD})),
        Case(capital, pb.SamplingParams(logit_bias={paris: -100.0, 28: 5.0}),
             dict(sequence_bias=[[[paris], -100.0], [[28], 5.0]])),
        Case(sky, pb.SamplingParams(repetition_penalty=1.3, min_tokens=12, logit_bias={504: -100.0, 6376: 5.0}),
             dict(repetition_penalty=1.3, min_new_tokens=12, sequence_bias=[[[504], -100.0], [[6376], 5.0]])),
    ]
    for case in cases:
        case.sampling.temperature = 0.0
    reference = in_spinning_process(hf_generate_all, smollm2_folder, cases, [EOS])
    assert reference[0][0] == paris and reference[5][0] != paris
    assert EOS not in reference[3][:16] and reference[3][-1] == EOS
    assert reference[4][-1] == PERIOD and PERIOD not in reference[4][:11]
    return cases, reference


def test_repetition_penalty_min_tokens_and_logit_bias_match_hf_on_smollm2(
    smollm2_folder: Path, smollm2_cases: tuple[list[Case], list[list[int]]]  # noqa: F811
) -> None:
    cases, reference = smollm2_cases
    tokens, _ = engine_generate(smollm2_folder, cases, ignore_eos=False, block_size=16, kv_cache_memory=256 << 20)
    assert tokens == reference


def test_the_same_options_over_grpc_match_hf_on_smollm2(
    smollm2_folder: Path, smollm2_cases: tuple[list[Case], list[list[int]]]  # noqa: F811
) -> None:
    cases, reference = smollm2_cases
    assert grpc_generate(smollm2_folder, cases, block_size=16, kv_cache_memory=256 << 20) == reference


def test_penalties_match_the_references_across_preemption(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    """A cache too small for the batch preempts requests; each comes back as a NewRequest holding its
    completion after num_prompt_tokens, and must count it as before."""
    folder = tiny_model_folders["llama"]
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=generator).tolist() for n in (5, 17, 9, 12, 7)]
    settings = [
        pb.SamplingParams(frequency_penalty=0.5),
        pb.SamplingParams(presence_penalty=1.5),
        pb.SamplingParams(),
        pb.SamplingParams(frequency_penalty=-0.25, presence_penalty=2.0),
        pb.SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=1.3),
    ]
    cases = [Case(p, s, max_tokens=40) for p, s in zip(prompts, settings, strict=True)]
    cases[4].hf = dict(repetition_penalty=1.3)
    for case in cases:
        case.sampling.temperature = 0.0
    reference = hf_generate_all(folder, cases, None)

    block_bytes = 2 * 2 * 2 * 16 * 4 * 8  # K and V, 2 layers, 2 KV heads of 16, float32, 8 tokens a block
    tokens, num_preemptions = engine_generate(
        folder, cases, ignore_eos=True, block_size=8, kv_cache_memory=16 * block_bytes
    )
    assert num_preemptions > 0, "nothing was preempted"
    assert tokens == reference
