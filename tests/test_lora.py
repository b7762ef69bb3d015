"""LoRA adapters through the scheduler's engine and the model executor: greedy float32 tokens equal transformers +
peft on the same random-weight adapters, with the base model and two adapters in one batch; adapters never share
prefix-cache blocks; a step holds at most ``max_loras`` adapters; preemption keeps a request's adapter; an adapter
that does not fit is refused and the executor keeps serving; adapters load and unload at run time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.executor import LoraRefused
from common.step import StepPlan, StepResult
from executor_svc.cpu.decode_stack import CpuDecodeStack
from executor_svc.lora.layers import LoraStep
from executor_svc.models.llama import LlamaMLP
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from tests.conftest import assert_all_blocks_free
from tests.lora_fixtures import ALL_PROJECTIONS, peft_greedy, save_random_adapter
from tests.model_fixtures import TINY_VOCAB, tiny_model_folders  # noqa: F401

MAX_NEW_TOKENS = 12
ADAPTERS = {"a1": (ALL_PROJECTIONS, 8), "a2": (["q_proj", "v_proj", "down_proj"], 4)}


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (5, 19, 40)]


class Family:
    """A tiny model, two adapters of it and every reference output."""

    def __init__(self, base: Path, root: Path) -> None:
        self.base = base
        self.adapters = {name: save_random_adapter(base, root / name, targets, rank, seed=i + 1, scale=3.0)
                         for i, (name, (targets, rank)) in enumerate(ADAPTERS.items())}
        self.prompts = prompts(3)
        self.reference = {name: peft_greedy(base, self.adapters.get(name), self.prompts, MAX_NEW_TOKENS)
                          for name in (None, *ADAPTERS)}

    def executor(self, **options: object) -> ModelExecutor:
        given = dict(dtype="float32", model=str(self.base), block_size=8, kv_cache_memory=4 << 20, threads=2,
                     lora_modules={name: str(path) for name, path in self.adapters.items()})
        return ModelExecutor(ExecutorOptions(**(given | options)))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_model_folders: dict[str, Path]) -> Family:  # noqa: F811
    return Family(tiny_model_folders[request.param], tmp_path_factory.mktemp(f"lora-{request.param}"))


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def mixed_batch(family: Family, engine: Engine) -> tuple[list[list[int]], list[list[int]]]:
    """Every prompt through the base model and each adapter, all in one run, adapters round robin (so that a decode
    step's rows interleave adapters, and a prefill's chunks are runs of one): (outputs, references)."""
    names = [None, *ADAPTERS]
    loras = [name for _ in family.prompts for name in names]
    prompts = [prompt for prompt in family.prompts for _ in names]
    outputs = engine.generate(prompts, PARAMS, loras)
    assert_all_blocks_free(engine.block_manager)
    return [c.token_ids for c in outputs], [family.reference[name][i] for i in range(len(family.prompts))
                                            for name in names]


@pytest.mark.parametrize("config", [
    SchedulerConfig(),
    SchedulerConfig(max_num_batched_tokens=24, policy="mixed"),
    SchedulerConfig(max_num_batched_tokens=24, num_scheduler_steps=4),
], ids=["batched", "mixed-chunked", "multi-step"])
@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_base_and_two_adapters_in_one_batch_match_peft(family: Family, config: SchedulerConfig,
                                                        kernels: str) -> None:
    outputs, reference = mixed_batch(family, Engine(family.executor(cpu_kernels=kernels), config))
    assert outputs == reference
    # The adapters change the tokens: a forward that skipped them could not pass.
    assert len({tuple(map(tuple, family.reference[name])) for name in (None, *ADAPTERS)}) == 3


def test_adapters_never_share_prefix_cache_blocks(family: Family) -> None:
    """The same long prompt through the base model, then each adapter, then an adapter again: only the repeat hits
    the cache. Were an adapter's block hashes the base model's, its prompt would hit the base model's blocks, whose
    KV the adapter did not compute, and its tokens would be the base model's."""
    engine = Engine(family.executor())
    prompt = family.prompts[2]  # 40 tokens: four full blocks of 8 to share
    hits = []
    for name in (None, "a1", "a2", "a1"):
        [out] = engine.generate([prompt], PARAMS, [name])
        assert out.token_ids == family.reference[name][2]
        hits.append(out.num_cached_prompt_tokens)
    assert hits == [0, 0, 0, 32]
    assert_all_blocks_free(engine.block_manager)


def test_at_most_max_loras_adapters_per_step_and_none_starves(family: Family) -> None:
    executor = family.executor()
    seen: list[set[int]] = []
    lora_of: dict[int, int] = {}
    step = executor.step

    def recorded(plan: StepPlan) -> StepResult:
        lora_of.update((new.request_id, new.lora_id) for new in plan.new_requests)
        ids = [new.request_id for new in plan.new_requests] + plan.cached_requests.request_ids
        seen.append({lora_of[i] for i in ids} - {0})
        return step(plan)

    executor.step = recorded
    outputs, reference = mixed_batch(family, Engine(executor, SchedulerConfig(max_loras=1)))
    assert outputs == reference  # every request ran, through its own adapter
    assert max(map(len, seen)) == 1
    assert set().union(*seen) == {1, 2}


def test_a_preempted_request_keeps_its_adapter(family: Family) -> None:
    # 12 blocks of 8 tokens: nine sequences of up to 52 tokens cannot all stay.
    executor = family.executor(kv_cache_memory=12 * family_block_bytes(family))
    engine = Engine(executor)
    outputs, reference = mixed_batch(family, engine)
    assert engine.scheduler.num_preemptions > 0
    assert outputs == reference


def family_block_bytes(family: Family) -> int:
    probe = family.executor()
    return probe.runner._block_bytes()


def test_a_misfit_adapter_is_refused_and_serving_goes_on(family: Family, tmp_path: Path,
                                                         tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    engine = Engine(family.executor(runtime_lora=True, max_lora_rank=8))
    misfits = {
        "rank": (save_random_adapter(family.base, tmp_path / "rank", ["q_proj"], 16, seed=5), "above --max-lora-rank"),
        "embed": (save_random_adapter(family.base, tmp_path / "embed", ["embed_tokens"], 4, seed=6),
                  "only ones this executor adapts"),
        # Qwen3's heads are 32 wide, the tiny Llama's 16: q_proj's B does not fit the other.
        "other-model": (save_random_adapter(tiny_model_folders["llama" if family.base.name == "qwen3" else "qwen3"],
                                            tmp_path / "other", ["q_proj"], 4, seed=7), "on this model needs"),
    }
    # Malformed folders, refused as misfits (they raised past the refusal: HTTP 500, a traceback at start).
    good = family.adapters["a2"]
    for name, config, weights in (("list", "[]", None), ("alpha", '{"r": 4, "lora_alpha": "16"}', None),
                                  ("torn", None, b"not safetensors")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(config or (good / "adapter_config.json").read_text())
        (folder / "adapter_model.safetensors").write_bytes(weights or (good / "adapter_model.safetensors").read_bytes())
        misfits[name] = (folder, {"list": "not a JSON object", "alpha": "number lora_alpha",
                                  "torn": "not a readable safetensors file"}[name])
    for name, (path, reason) in misfits.items():
        with pytest.raises(LoraRefused, match=reason) as refused:
            engine.load_lora(name, str(path))
        assert refused.value.code == "INVALID_ARGUMENT"
        assert name not in engine.adapters
    outputs, reference = mixed_batch(family, engine)
    assert outputs == reference


@pytest.mark.parametrize("overlap", [False, True])
def test_runtime_load_and_unload(family: Family, overlap: bool) -> None:
    """vLLM's unload: the name is refused to new requests at once, the request through it runs to its end, and the
    executor drops the weights once it has dropped that request, also while other requests keep a step in flight."""
    engine = Engine(family.executor(lora_modules={}, runtime_lora=True), overlap=overlap)
    with pytest.raises(Exception, match="no LoRA adapter named 'a1'"):
        engine.add_request(family.prompts[0], PARAMS, "a1")
    for name, path in family.adapters.items():
        engine.load_lora(name, str(path))
    assert [a.name for a in engine.executor.get_info().lora_adapters] == ["a1", "a2"]
    seq = engine.add_request(family.prompts[1], PARAMS, "a1")
    base = engine.add_request(family.prompts[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    engine.step()
    engine.unload_lora("a1")
    with pytest.raises(Exception, match="no LoRA adapter named 'a1'"):
        engine.add_request(family.prompts[0], PARAMS, "a1")
    with pytest.raises(LoraRefused) as missing:
        engine.unload_lora("a1")
    assert missing.value.code == "NOT_FOUND"
    while not seq.is_finished:
        engine.step()
    assert seq.completion_token_ids == family.reference["a1"][1]
    for _ in range(3):  # the executor drops a1's request with the next plan, and a1 with it
        engine.step()
    assert not base.is_finished
    assert [a.name for a in engine.executor.get_info().lora_adapters] == ["a2"] and not engine.adapters.retiring
    # a1 gone, a2 still serves, and a1 loads again under a new id (its old blocks can never be hit)
    while engine.has_unfinished():
        engine.step()
    [out] = engine.generate([family.prompts[2]], PARAMS, ["a2"])
    assert out.token_ids == family.reference["a2"][2]
    again = engine.load_lora("a1", str(family.adapters["a1"]))
    assert again.lora_id == 3
    [out] = engine.generate([family.prompts[1]], PARAMS, ["a1"])
    assert out.token_ids == family.reference["a1"][1]
    assert out.num_cached_prompt_tokens == 0
    # load_inplace: a2's name now serves a1's weights
    engine.load_lora("a2", str(family.adapters["a1"]), inplace=True)
    [out] = engine.generate([family.prompts[1]], PARAMS, ["a2"])
    assert out.token_ids == family.reference["a1"][1]
    assert_all_blocks_free(engine.block_manager)


def test_runtime_loading_is_refused_unless_enabled(family: Family) -> None:
    executor = family.executor()
    with pytest.raises(LoraRefused, match="--runtime-lora") as refused:
        executor.load_lora("a3", str(family.adapters["a1"]))
    assert refused.value.code == "FAILED_PRECONDITION"


def test_two_tensor_parallel_ranks_serve_adapters(family: Family) -> None:
    """Each rank holds its shard of every adapter: B's rows beside a column-parallel projection's, A's columns beside
    a row-parallel one's (summed by its all-reduce). Run-time loading stays on one rank, refused clearly here."""
    executor = family.executor(tensor_parallel_size=2, threads=1, runtime_lora=True)
    try:
        outputs, reference = mixed_batch(family, Engine(executor, SchedulerConfig(max_num_batched_tokens=24)))
        assert outputs == reference
        with pytest.raises(LoraRefused, match="under tensor parallelism") as refused:
            executor.load_lora("a3", str(family.adapters["a1"]))
        assert refused.value.code == "FAILED_PRECONDITION"
    finally:
        executor.close()


def test_decode_steps_with_adapters_keep_the_c_decode_stack(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C stack fits (Llama, not Qwen3's q/k norms), a decode step with adapter rows runs it, each
    projection through its module and its adapters' update, with the reference tokens."""
    adapted = []
    run = CpuDecodeStack._run_torch_linears

    def recorded(self: CpuDecodeStack, hidden: torch.Tensor, residual: torch.Tensor, layers: list | None = None):
        adapted.append(layers is self.adapted_layers)
        return run(self, hidden, residual, layers)

    monkeypatch.setattr(CpuDecodeStack, "_run_torch_linears", recorded)
    outputs, reference = mixed_batch(family, Engine(family.executor(cpu_kernels="c")))
    assert outputs == reference
    assert any(adapted) == (family.base.name == "llama")


def test_a_prefill_in_row_chunks_gives_each_row_its_adapter(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prefill's MLP runs in row chunks on the CPU (``LlamaMLP.CPU_CHUNK_BYTES``); chunks of 7 rows here cut
    the prompts' runs of one adapter apart, and each chunk's update must take its own rows' adapters."""
    executor = family.executor()
    mlp = executor.runner.model.model.layers[0].mlp
    monkeypatch.setattr(LlamaMLP, "CPU_CHUNK_BYTES", 7 * sum(mlp.gate_up_proj.shard_sizes) * 4)
    windows = []
    rows = LoraStep.rows

    def recorded(self: LoraStep, start: int, end: int):
        windows.append((start, end))
        return rows(self, start, end)

    monkeypatch.setattr(LoraStep, "rows", recorded)
    outputs, reference = mixed_batch(family, Engine(executor))
    assert outputs == reference
    assert (7, 14) in windows
