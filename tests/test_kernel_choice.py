"""The CPU kernel choice: measured once per machine, cached, forced by a flag, and obeyed call by call."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import random_model
from executor_svc.__main__ import build_parser
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu import probe as kernel_probe
from executor_svc.cpu.choice import CLASSES, FAMILIES, KernelChoice, load_cached, parse_override, save, shape_class
from executor_svc.cpu.probe import choice_cache, widest_norm
from executor_svc.layers import linear
from executor_svc.layers.linear import cpu_linear_layers
from executor_svc.layers.norm import RMSNorm
from executor_svc.models.llama import LlamaMLP
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.model_runner import ModelRunner
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine
from tests.model_fixtures import smollm2_folder, teacher_forced_logits, tiny_model_folders  # noqa: F401

needs_kernels = pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler to build the kernels")
KV_BYTES = 4 << 20
KERNEL_SETS = ("c", "torch", "auto")
# SmolLM2's teacher-forced bfloat16 logits (tests/model_fixtures.py) part by rounding alone: on the EPYC (AVX-512
# BF16) by up to 1.7 between the C and torch kernel sets over 227 positions, as far as either is from float32's
# (1.6), whose kernel sets agree to the bit. 3 leaves about twice that. The gap between a position's top two moved
# by 0.4 at most: where it is wider than 3, the greedy token is no near-tie and is the same.
BFLOAT16_TOLERANCE = 3.0
PROMPTS = [
    [1, 504, 3458, 282, 4370, 314],
    [1, 2683, 1115, 33, 42],
    [1, 504, 3575, 282, 4649, 314],  # The capital of France is
    [1, 6403, 1980, 253, 655, 28, 281, 253, 1666, 1869, 2025, 28, 665, 4161, 253],  # Once upon a time, ... lived a
]


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh NANOSERVE_CACHE, so this test measures instead of reading this machine's table."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def c_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights packed for the C linear kernel even where only its portable loops are built (no AVX-512): slower
    than torch there, but the same layout and numerics, so which kernel runs is tested on every machine."""
    monkeypatch.setattr(linear, "packing_helps", lambda: True)


def tiny_runner(folder: Path, cpu_kernels_flag: str, dtype: str = "float32") -> ModelRunner:
    options = ExecutorOptions(model=str(folder), dtype=dtype, block_size=8, kv_cache_memory=KV_BYTES, threads=1,
                              cpu_kernels=cpu_kernels_flag)
    return ModelRunner(folder, options)


def test_rows_fall_into_the_documented_classes() -> None:
    expected = {1: "1", 2: "2-8", 8: "2-8", 9: "9-32", 32: "9-32", 33: "33+", 256: "33+", 257: "prefill",
                8192: "prefill"}
    assert {rows: shape_class(rows) for rows in expected} == expected
    choice = KernelChoice.uniform("c").with_ways({("linear", "9-32"): "torch", ("rotary", "prefill"): "torch"})
    assert [choice.use_c("linear", r) for r in (8, 9, 32, 33)] == [True, False, False, True]
    assert [choice.use_c("rotary", r) for r in (256, 257, 100_000)] == [True, False, False]


def test_the_flag_forces_all_or_some_entries_and_names_a_bad_item() -> None:
    assert parse_override("auto") == {}
    assert set(parse_override("torch").values()) == {"torch"} and len(parse_override("c")) == 30
    ways = parse_override("linear:prefill=torch, rotary=c")
    assert ways == {("linear", "prefill"): "torch", **{("rotary", c): "c" for c in CLASSES}}
    for bad in ("linear=gpu", "attention=c", "linear:64=c", ","):
        with pytest.raises(ValueError, match="--cpu-kernels"):
            parse_override(bad)
    assert build_parser({}).parse_args([]).cpu_kernels == "auto"
    with pytest.raises(SystemExit):
        build_parser({"NANOSERVE_CPU_KERNELS": "linear=fast"}).parse_args([])


def test_a_slow_spell_in_most_rounds_of_one_kernel_does_not_flip_the_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """C takes 46 ms a call and torch 52, but the machine is busy during three of C's five turns (80 ms): the race
    still finds C the faster, as the spell's medians would not."""
    turns = {"c": iter([80.0, 46.0, 80.0, 80.0, 47.0]), "torch": iter([52.0, 53.0, 52.0, 54.0, 52.0])}
    order: list[str] = []
    monkeypatch.setattr(kernel_probe, "_ms_per_call", lambda call: next(turns[order.append(call()) or order[-1]]))
    c_ms, torch_ms = kernel_probe.race(lambda: "c", lambda: "torch")
    assert (c_ms, torch_ms) == (46.0, 52.0)
    assert order == ["c", "torch"] * 5, "five rounds, in turns"


@needs_kernels
def test_an_executor_measures_once_logs_once_then_reads_its_cache(
    tiny_model_folders: dict[str, Path], own_cache: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    caplog.set_level(logging.INFO, logger="nanoserve.executor")
    first = tiny_runner(tiny_model_folders["llama"], "auto").kernels
    assert first.source.startswith("measured in")
    measured = set(first.timings) | {f for f in FAMILIES if f not in first.timings}
    assert measured == set(FAMILIES)
    for family, row in first.timings.items():
        assert set(row) == set(CLASSES) - ({"prefill"} if family == "decode_attention" else set())
        assert all(c_ms > 0 and torch_ms > 0 for c_ms, torch_ms in row.values())
    [cached_file] = (own_cache / "kernels").glob("kernel-choice-*.json")
    second = tiny_runner(tiny_model_folders["llama"], "auto").kernels
    assert second.source == f"cached in {cached_file}" and second.table == first.table
    logged = [r for r in caplog.records if r.getMessage().startswith("CPU kernels for rows 1/2-8/9-32/33+/prefill")]
    assert len(logged) == 2 and all(family in logged[0].getMessage() for family in FAMILIES)
    cached_file.write_text("{not json")
    assert tiny_runner(tiny_model_folders["llama"], "auto").kernels.source.startswith("measured in")


@needs_kernels
@pytest.mark.parametrize("share", [0.4, 1.0])
def test_a_race_kept_off_the_cpu_is_logged_with_the_file_to_delete(
    tiny_model_folders: dict[str, Path], own_cache: Path, caplog: pytest.LogCaptureFixture,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch, share: float,
) -> None:
    """The race's threads' CPU time over its wall time (``BUSY_SHARE``) tells a measurement other processes crowded
    out: logged, naming the cached table, and still used and cached (the next start reads it)."""
    clock = kernel_probe.time.perf_counter
    monkeypatch.setattr(kernel_probe.time, "process_time", lambda: clock() * torch.get_num_threads() * share)
    caplog.set_level(logging.WARNING, logger="nanoserve.executor")
    choice = tiny_runner(tiny_model_folders["llama"], "auto").kernels
    [cached_file] = (own_cache / "kernels").glob("kernel-choice-*.json")
    warnings = [r.getMessage() for r in caplog.records if "other processes held the CPU" in r.getMessage()]
    if share < kernel_probe.BUSY_SHARE:
        assert len(warnings) == 1 and "ran 40% of the time" in warnings[0] and str(cached_file) in warnings[0]
    else:
        assert warnings == []
    assert load_cached(cached_file).table == choice.table


@pytest.mark.skipif(not (cpu_kernels.kernel_library() and cpu_kernels.kernel_library().prefill_attention_supported(64)),
                    reason="no C prefill attention kernel here")
def test_prefill_attention_is_raced_on_one_prompt_of_each_class(
    tmp_path: Path, own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its classes are of a step's longest context: each is raced on one prompt of its probe length, ``prefill``
    (past 256 tokens) on one of 1,024, where a long prompt's race is decided."""
    seen: list[tuple[int, int]] = []
    batch = kernel_probe.prefill_batch

    def spy(rows: int, *args: object, prompt_tokens: int) -> object:
        seen.append((rows, prompt_tokens))
        return batch(rows, *args, prompt_tokens=prompt_tokens)

    monkeypatch.setattr(kernel_probe, "prefill_batch", spy)
    folder = random_model.save_random(tmp_path / "smollm2", torch.float32, arch="smollm2-135m", num_hidden_layers=1,
                                      vocab_size=10240)
    choice = tiny_runner(folder, "auto").kernels
    assert seen == [(n, n) for n in (1, 4, 16, 64, 1024)]
    assert set(choice.timings["prefill_attention"]) == set(CLASSES)


@needs_kernels
def test_a_forced_table_keeps_only_the_weight_copies_it_reads(
    tiny_model_folders: dict[str, Path], own_cache: Path, c_linear: None  # noqa: F811
) -> None:
    folder = tiny_model_folders["qwen2"]  # untied LM head: no layer shares its weight
    c_only = cpu_linear_layers(tiny_runner(folder, "c").model)
    assert all(m.packed_weight is not None and m.weight.numel() == 0 and m.onednn_weight is None for m in c_only)
    torch_only = cpu_linear_layers(tiny_runner(folder, "torch").model)
    assert all(m.packed_weight is None and m.onednn_weight is not None for m in torch_only)
    both = cpu_linear_layers(tiny_runner(folder, "c,linear:prefill=torch").model)
    assert all(m.packed_weight is not None and m.onednn_weight is not None for m in both)
    assert not list((own_cache / "kernels").glob("kernel-choice-*.json")), "a forced table measured nothing"


@needs_kernels
@pytest.mark.parametrize("forced", ["linear=c", "linear=torch"])
def test_a_first_start_holds_both_weight_copies_only_for_the_layers_it_races(
    tiny_model_folders: dict[str, Path], own_cache: Path, c_linear: None, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    forced: str,
) -> None:
    held = {}

    def spy(model: torch.nn.Module, *args: object) -> KernelChoice:
        held.update({name: (m.packed_weight is not None, m.onednn_weight is not None or m.weight.numel() > 0)
                     for name, m in model.named_modules() if isinstance(m, linear.LinearBase)})
        return measure(model, *args)

    measure = kernel_probe.measure
    monkeypatch.setattr(kernel_probe, "measure", spy)
    monkeypatch.setattr(kernel_probe, "PROBE_WEIGHT_BYTES", 1)  # races the first layer alone
    layers = cpu_linear_layers(tiny_runner(tiny_model_folders["qwen2"], forced).model)  # the flag leaves 20 to measure
    first = "model.layers.0.self_attn.qkv_proj"
    assert held.pop(first) == (True, True) and set(held.values()) == {(False, True)}, "copies held while measuring"
    if forced == "linear=c":
        assert all(m.packed_weight is not None and m.weight.numel() == 0 and m.onednn_weight is None for m in layers)
    else:
        assert all(m.packed_weight is None and m.onednn_weight is not None for m in layers)


@needs_kernels
def test_each_call_runs_the_kernel_its_rows_choose(
    tiny_model_folders: dict[str, Path], own_cache: Path, c_linear: None  # noqa: F811
) -> None:
    runner = tiny_runner(tiny_model_folders["qwen2"], "c,linear:9-32=torch")
    layer = runner.model.model.layers[0].mlp.down_proj
    dense = layer.onednn_weight.to_dense()
    with torch.inference_mode():
        layer.packed_weight.data.zero_()  # the C path now answers zeros: which path ran shows in the output
    for rows, expect_c in ((1, True), (8, True), (9, False), (32, False), (33, True), (300, True)):
        x = torch.randn(rows, dense.shape[1])
        with torch.inference_mode():
            out = layer.matmul(x, None)
        if expect_c:
            assert torch.count_nonzero(out) == 0, rows
        else:
            torch.testing.assert_close(out, F.linear(x, dense), rtol=1e-4, atol=1e-4)


@needs_kernels
def test_the_chunks_of_a_long_prefill_run_the_kernels_the_whole_prefill_chooses(
    tiny_model_folders: dict[str, Path], own_cache: Path, c_linear: None, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    mlp = tiny_runner(tiny_model_folders["qwen2"], "c,linear:prefill=torch").model.model.layers[0].mlp
    monkeypatch.setattr(LlamaMLP, "CPU_CHUNK_BYTES", 100 * sum(mlp.gate_up_proj.shard_sizes) * 4)  # 100-row chunks
    gate_up, down = mlp.gate_up_proj.onednn_weight.to_dense(), mlp.down_proj.onednn_weight.to_dense()
    x = torch.randn(300, gate_up.shape[1])
    with torch.inference_mode():
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            layer.packed_weight.data.zero_()  # the C path now answers zeros
        out = mlp(x)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(out, F.linear(F.silu(gate) * up, down), rtol=1e-4, atol=1e-4)


def smollm2_executor(folder: Path, dtype: str, cpu_kernels_flag: str) -> ModelExecutor:
    return ModelExecutor(ExecutorOptions(model=str(folder), dtype=dtype, kv_cache_memory=64 << 20, threads=2,
                                         cpu_kernels=cpu_kernels_flag))


def greedy(executor: ModelExecutor, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [c.token_ids for c in Engine(executor).generate(prompts, params)]


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@needs_kernels
def test_float32_greedy_tokens_are_the_same_whichever_kernels_run(smollm2_folder: Path) -> None:  # noqa: F811
    tokens = {flag: greedy(smollm2_executor(smollm2_folder, "float32", flag), PROMPTS[:2], 12) for flag in KERNEL_SETS}
    assert tokens["c"] == tokens["torch"] == tokens["auto"]


@needs_kernels
def test_bfloat16_logits_part_only_by_rounding_whichever_kernels_run(smollm2_folder: Path) -> None:  # noqa: F811
    """Not the same tokens: bfloat16 keeps 8 significant bits, kernels that add in another order round a value a
    step apart now and then, and a near-tie flips (476 or 282 at the first prompt's 7th token, on the EPYC as on an
    AMX Xeon). So every kernel set, and float32, is fed float32's greedy tokens and their logits compared position
    by position (``BFLOAT16_TOLERANCE``)."""
    reference = smollm2_executor(smollm2_folder, "float32", "torch")
    sequences = [p + t for p, t in zip(PROMPTS, greedy(reference, PROMPTS, 16), strict=True)]
    lengths = [len(p) for p in PROMPTS]
    logits = {"float32": torch.cat(teacher_forced_logits(reference.runner, sequences, lengths))}
    for flag in KERNEL_SETS:
        runner = smollm2_executor(smollm2_folder, "bfloat16", flag).runner
        logits[flag] = torch.cat(teacher_forced_logits(runner, sequences, lengths))
    for a, b in itertools.combinations(logits, 2):
        apart = float((logits[a] - logits[b]).abs().max())
        assert apart <= BFLOAT16_TOLERANCE, f"{a} and {b}: logits {apart:.2f} apart"
        clear = torch.maximum(top2_margin(logits[a]), top2_margin(logits[b])) > BFLOAT16_TOLERANCE
        assert int(clear.sum()) >= len(clear) // 10, "too few positions without a near-tie to compare tokens at"
        assert torch.equal(logits[a][clear].argmax(-1), logits[b][clear].argmax(-1)), f"{a} and {b}: greedy tokens"


@needs_kernels
def test_an_unwritable_cache_costs_the_cache_not_the_start(
    tiny_model_folders: dict[str, Path], own_cache: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    (own_cache / "kernels").write_text("a file where the folder should be")
    caplog.set_level(logging.WARNING, logger="nanoserve.executor")
    assert tiny_runner(tiny_model_folders["llama"], "auto").kernels.source.startswith("measured in")
    assert any("could not cache the CPU kernel choice" in r.getMessage() for r in caplog.records)


def test_a_model_without_cpu_linear_layers_builds_no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "packing_helps", lambda: pytest.fail("asked for the CPU kernels"))
    linear.prepack_for_cpu(torch.nn.Sequential(torch.nn.ReLU()))


@pytest.mark.parametrize("text", ['{"table": {}}', '{"table": [], "timings": {}}', '[1, 2]',
                                  '{"table": TABLE, "timings": []}', '{"table": TABLE, "timings": {"linear": [1]}}'])
def test_a_cached_file_that_is_not_a_table_is_measured_again(tmp_path: Path, text: str) -> None:
    path = tmp_path / "kernel-choice.json"
    good = KernelChoice.uniform("torch", source="test")
    path.write_text(text.replace("TABLE", json.dumps(good.table)))
    assert load_cached(path) is None
    save(path, good)
    assert load_cached(path).table == good.table
    assert path.stat().st_mode & 0o044 == 0o044, "another user sharing the cache cannot read the table"


def test_a_table_that_cannot_be_written_leaves_no_file_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A full cache disk: every start measures again, and must not leave another temporary file each time.
    good = KernelChoice.uniform("torch", source="test")

    def disk_full(self: KernelChoice) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(KernelChoice, "to_json", disk_full)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path / "kernels" / "kernel-choice.json", good)
    assert list((tmp_path / "kernels").iterdir()) == []


def test_the_cache_key_names_the_onednn_isa_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    free = choice_cache(["float32", 2])
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # AMX off
    assert choice_cache(["float32", 2]) != free
    assert choice_cache(["float32", 2]) != choice_cache(["bfloat16", 2])


def test_the_norm_probed_is_the_hidden_size_one_the_table_steers(
    tiny_model_folders: dict[str, Path], own_cache: Path  # noqa: F811
) -> None:
    model = tiny_runner(tiny_model_folders["qwen3"], "c").model
    first = next(m for m in model.modules() if isinstance(m, RMSNorm))
    hidden = model.model.norm.weight.shape[0]
    assert first.weight.shape[0] < hidden, "Qwen3's first norm is its head-wide q_norm"
    assert widest_norm(model).weight.shape[0] == hidden
