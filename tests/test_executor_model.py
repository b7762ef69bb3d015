"""The ModelExecutor's handshake and step contract on real (tiny and embedded) models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.step import CachedRequests, NewRequest, SamplingSettings, StepPlan, StepResult
from executor_svc.attention import available_backends
from executor_svc.core.request_table import PlanError
from executor_svc.runtime.config import ExecutorOptions, UnsupportedModel
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine
from tests.model_fixtures import smollm2_folder, teacher_forced_logits, tiny_model_folders  # noqa: F401
from tests.test_model_parity import random_prompts

CPU = torch.device("cpu")

GREEDY = SamplingSettings(temperature=0.0)
KV_BYTES = 4 << 20


@pytest.fixture(scope="module")
def tiny_executor(tiny_model_folders: dict[str, Path]) -> ModelExecutor:  # noqa: F811
    return ModelExecutor(
        ExecutorOptions(dtype="float32", model=str(tiny_model_folders["llama"]), block_size=8, kv_cache_memory=KV_BYTES,
                        threads=1)
    )


def new_request(request_id: int, tokens: list[int], scheduled: int, sampling: SamplingSettings = GREEDY):
    blocks = list(range(request_id * 4, request_id * 4 + 4))
    return NewRequest(
        request_id=request_id, token_ids=tokens, sampling=sampling, block_table=blocks, num_scheduled_tokens=scheduled
    )


def test_tiny_handshake(tiny_executor: ModelExecutor) -> None:
    info = tiny_executor.get_info()
    # 2 layers x 2 KV heads x 16 dims x (K and V) x 4 bytes x 8 tokens = 4 KiB per block.
    assert info.num_blocks == KV_BYTES // 4096
    assert (info.architecture, info.vocab_size, info.max_model_len) == ("LlamaForCausalLM", 512, 512)
    assert (list(info.eos_token_ids), info.bos_token_id, info.block_size) == ([2], 1, 8)
    assert (info.device, info.dtype, info.attention_backend) == ("cpu", "float32", available_backends(CPU)[0])
    assert info.tensor_parallel_size == 1
    assert len(info.instance_id) == 32 and info.tokenizer_json == ""


def test_max_model_len_override_and_limit(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    folder = str(tiny_model_folders["llama"])
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=folder, max_model_len=100, kv_cache_memory=1 << 20))
    assert executor.get_info().max_model_len == 100
    with pytest.raises(UnsupportedModel, match="max_position_embeddings 512"):
        ModelExecutor(ExecutorOptions(dtype="float32", model=folder, max_model_len=1000, kv_cache_memory=1 << 20))


def test_chunked_prefill_samples_only_at_the_end(tiny_executor: ModelExecutor) -> None:
    tokens = [5, 9, 77, 300, 41, 8, 19, 23, 100, 7]
    whole = tiny_executor.step(StepPlan(step_id=1, is_prefill=True, new_requests=[new_request(1, tokens, 10)]))
    first = tiny_executor.step(StepPlan(step_id=2, is_prefill=True, new_requests=[new_request(2, tokens, 4)]))
    assert list(first.token_ids) == [0]
    rest = CachedRequests(request_ids=[2], num_computed_tokens=[4], num_scheduled_tokens=[6], num_new_blocks=[0])
    second = tiny_executor.step(StepPlan(step_id=3, is_prefill=True, cached_requests=rest))
    assert list(second.token_ids) == list(whole.token_ids)
    assert second.instance_id == tiny_executor.get_info().instance_id and second.forward_ms > 0
    tiny_executor.step(StepPlan(step_id=4, finished_request_ids=[1, 2]))
    assert len(tiny_executor.table) == 0


def test_logprobs_only_for_rows_that_ask(tiny_executor: ModelExecutor) -> None:
    asks = SamplingSettings(temperature=0.0, num_logprobs=3)
    plan = StepPlan(
        step_id=5, is_prefill=True, new_requests=[new_request(3, [4, 5, 6], 3, asks), new_request(4, [4, 5, 6], 3)]
    )
    result = tiny_executor.step(plan)
    asked, plain = result.logprobs
    assert list(asked.top_token_ids)[0] == result.token_ids[0] == result.token_ids[1]
    assert len(asked.top_token_ids) == 3 and asked.logprob <= 0
    assert plain is None, "request 2 asked for no logprobs"
    tiny_executor.step(StepPlan(step_id=6, finished_request_ids=[3, 4]))


def test_rejected_plan_changes_nothing(tiny_executor: ModelExecutor) -> None:
    tiny_executor.step(StepPlan(step_id=7, is_prefill=True, new_requests=[new_request(5, [1, 2, 3], 3)]))
    bad = CachedRequests(request_ids=[99], num_computed_tokens=[3], num_scheduled_tokens=[1], num_new_blocks=[0])
    with pytest.raises(PlanError):
        tiny_executor.step(StepPlan(step_id=8, cached_requests=bad))
    assert tiny_executor.table.requests[5].token_ids[:3] == [1, 2, 3] and len(tiny_executor.table) == 1
    assert tiny_executor.reset() == 1


def test_embedded_model_handshake(smollm2_folder: Path) -> None:  # noqa: F811
    executor = ModelExecutor(ExecutorOptions(dtype="float32", kv_cache_memory=16 << 20, threads=1))
    info = executor.get_info()
    assert (info.model_id, info.architecture, info.vocab_size) == ("smollm2-135m-instruct", "LlamaForCausalLM", 49152)
    assert (list(info.eos_token_ids), info.bos_token_id, info.max_model_len) == ([2], 1, 8192)
    assert "<|im_start|>" in info.chat_template
    assert json.loads(info.tokenizer_json)["model"]["vocab"]["<|im_end|>"] == 2


# How far half precision's rounding may move the tiny model's first-token logits from float32's (measured on x86:
# bfloat16 0.21, float16 0.02, over 24 prompts); a broken half-precision path moves logits spread over +-6 far more.
HALF_TOLERANCE = {"bfloat16": 0.5, "float16": 0.1}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_agrees_with_float32_on_the_first_token_but_at_near_ties(
    tiny_model_folders: dict[str, Path], dtype: str  # noqa: F811
) -> None:
    """Rounding may flip a near-tie of the random model: fed the same prompts and first tokens, half precision's logits
    stay within ``HALF_TOLERANCE`` of float32's, and its greedy first token is float32's wherever float32's two most
    likely are further apart than that rounding can close."""
    folder = str(tiny_model_folders["qwen3"])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [prompt for seed in (1, 2, 3) for prompt in random_prompts(seed)]
    lengths = [len(prompt) for prompt in prompts]
    first, logits = {}, {}
    for name in ("float32", dtype):
        executor = ModelExecutor(ExecutorOptions(model=folder, dtype=name, block_size=8, kv_cache_memory=KV_BYTES))
        assert executor.get_info().dtype == name
        first[name] = [c.token_ids[0] for c in Engine(executor).generate(prompts, params)]
        sequences = [prompt + [token] for prompt, token in zip(prompts, first["float32"], strict=True)]
        logits[name] = torch.stack([rows[-1] for rows in teacher_forced_logits(executor.runner, sequences, lengths)])
    apart = float((logits[dtype] - logits["float32"]).abs().max())
    assert apart <= HALF_TOLERANCE[dtype], f"{dtype}'s first-token logits are {apart:.3f} from float32's"
    top = logits["float32"].topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1] > 2 * HALF_TOLERANCE[dtype]).tolist()
    assert sum(clear) >= 3, "too few prompts without a near-tie to compare first tokens at"
    assert [t for t, c in zip(first[dtype], clear, strict=True) if c] == \
        [t for t, c in zip(first["float32"], clear, strict=True) if c]


def test_multi_step_decode_equals_single_steps_with_logprobs(tiny_executor: ModelExecutor) -> None:
    asks = SamplingSettings(temperature=0.0, num_logprobs=2)
    prompt = [7, 8, 9, 10, 11]
    first = tiny_executor.step(StepPlan(step_id=20, is_prefill=True,
                                           new_requests=[new_request(6, prompt, 5, asks), new_request(7, prompt, 5)]))
    assert first.token_ids[0] == first.token_ids[1]

    def decode(request_ids: list[int], computed: int, steps: list[int] | None = None) -> StepResult:
        n = len(request_ids)
        cached = CachedRequests(request_ids=request_ids, num_computed_tokens=[computed] * n,
                                   num_scheduled_tokens=[1] * n, num_new_blocks=[0] * n,
                                   num_decode_steps=steps or [])
        return tiny_executor.step(StepPlan(cached_requests=cached))

    single = [decode([6], 5 + k) for k in range(3)]
    multi = decode([7], 5, [3])
    assert list(multi.token_ids) == [r.token_ids[0] for r in single]
    assert not multi.logprobs, "request 7 asked for no logprobs"
    both = decode([6, 7], 8, [2, 1])
    assert len(both.token_ids) == 3 and len(both.logprobs) == 3
    assert list(both.logprobs[0].top_token_ids)[0] == both.token_ids[0] and both.logprobs[2] is None
    assert both.token_ids[2] == both.token_ids[0], "the same history gives the same token, whatever the steps"
    assert tiny_executor.table.requests[6].num_computed_tokens == 10
    tiny_executor.step(StepPlan(finished_request_ids=[6, 7]))


def test_a_long_cpu_prefill_runs_the_mlp_in_chunks_with_the_same_tokens(
    tiny_model_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from executor_svc.models.llama import LlamaMLP

    folder = str(tiny_model_folders["qwen3"])
    prompts = random_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=folder, block_size=8, kv_cache_memory=KV_BYTES,
                                             threads=1))
    whole = [c.token_ids for c in Engine(executor).generate(prompts, params)]
    calls = []
    mlp = LlamaMLP._mlp
    monkeypatch.setattr(LlamaMLP, "_mlp", lambda self, x, rows=None: calls.append(x.shape[0]) or mlp(self, x, rows))
    # The tiny models' gate_up is 256 wide: 1 KiB a row in float32, so 7 rows per chunk.
    monkeypatch.setattr(LlamaMLP, "CPU_CHUNK_BYTES", 7 * 1024)
    chunked = [c.token_ids for c in Engine(executor).generate(prompts, params)]
    assert chunked == whole
    assert max(calls) == 7 and len(calls) > len(prompts) * 8, "the prefill ran in chunks of 7 rows"


FAULTS_ON_REUSE = """
import ctypes, resource, sys
from executor_svc.cpu.malloc import keep_heap_memory
if sys.argv[1] == "keep":
    assert keep_heap_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 24 << 20
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_keep_heap_memory_reuses_a_freed_24_mib_block_without_page_faults() -> None:
    import subprocess
    import sys

    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", FAULTS_ON_REUSE, mode], capture_output=True, text=True, check=True)
        return int(run.stdout)

    pages = (24 << 20) >> 12
    assert faults("default") > pages // 2, "glibc's defaults hand the second block fresh pages"
    assert faults("keep") < pages // 20, "kept on the heap, the freed block's pages are reused"
