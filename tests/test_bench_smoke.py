"""Each benchmark runs end to end on a tiny configuration and writes its JSON keys (no timing assertions)."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import (
    kernels,
    lora,
    mixed_attention,
    options,
    overhead,
    overlap,
    overlap_api,
    profile,
    random_model,
    serving,
    spec,
    throughput,
)
from bench.common import w1, w2, w6
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.cpu.choice import CLASSES, FAMILIES


def positive_finite(value: object) -> bool:
    """A figure a benchmark measured: a number, above zero and finite (its size depends on the machine's load)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_workloads_draw_as_benchmarks_md_defines():
    random.seed(0)
    expected = []
    for _ in range(64):
        prompt = [random.randint(0, 10000) for _ in range(random.randint(32, 256))]
        expected.append((prompt, random.randint(32, 256)))
    workload = w1()
    assert list(zip(workload.prompts, workload.max_tokens, strict=True)) == expected
    assert len(w2()) == 256 and all(100 <= len(p) <= 1024 for p in w2().prompts)
    random.seed(0)
    blocks = [[random.randint(0, 10000) for _ in range(48)] for _ in range(32)]
    assert w6().prompts == [block * 4 for block in blocks] and w6().max_tokens == [128] * 32


def test_overhead_writes_its_keys(tmp_path):
    path = tmp_path / "w4.json"
    overhead.main(["--batch", "1", "4", "--context", "32", "--steps", "5", "--warmup", "2", "--repeats", "1",
                   "--json", str(path)])
    figures = json.loads(path.read_text())
    for batch in (1, 4):
        for key in ("us_per_step", "schedule_us", "rpc_us", "postprocess_us", "inprocess_us_per_step"):
            assert positive_finite(figures[f"{key}_b{batch}"]), key


def test_overhead_with_multi_step_plans(tmp_path):
    path = tmp_path / "w4.json"
    overhead.main(["--batch", "3", "--context", "32", "--steps", "8", "--warmup", "4", "--repeats", "1",
                   "--num-scheduler-steps", "4", "--peers", "grpc", "in-process", "floor", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["num_scheduler_steps"] == 4
    assert positive_finite(figures["us_per_step_b3"]) and positive_finite(figures["inprocess_us_per_step_b3"])
    # A multi-step plan of 3 sequences returns 3 x 4 tokens: the floor's reply is sized from it.
    assert figures["floor_result_bytes_b3"] >= 12


def test_overlap_writes_its_keys(tmp_path):
    """Efficiencies are ratios of timings, which a loaded machine moves past 1 (1.06 to 1.17 seen on the 2-core VM):
    only their being there and sane is checked."""
    path = tmp_path / "w5.json"
    overlap.main(["--batch", "1", "4", "--context", "32", "--steps", "60", "--warmup", "2", "--repeats", "1",
                  "--step-ms", "1", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["step_ms"] == 1
    for batch in (1, 4):
        for key in ("split_efficiency", "inprocess_efficiency", "inprocess_idle_us", "split_wait_us",
                    "api_efficiency", "api_vllm_efficiency", "api_http_efficiency", "floor_efficiency",
                    "api_client_cpu_us", "api_vllm_client_cpu_us", "api_http_client_cpu_us", "floor_client_cpu_us"):
            assert positive_finite(figures[f"{key}_b{batch}"]), key
        for peer in ("api", "api_vllm", "api_http", "floor"):
            for cpu in ("cpu_us", "own_cpu_us"):
                assert math.isfinite(figures[f"{peer}_{cpu}_b{batch}"]) and figures[f"{peer}_{cpu}_b{batch}"] >= 0
            # each message a reader took in the window carried at least a token, and came some time after the last
            assert figures[f"{peer}_tokens_per_message_b{batch}"] >= 1
            assert 0 < figures[f"{peer}_gap_p50_ms_b{batch}"] <= figures[f"{peer}_gap_p99_ms_b{batch}"]


def test_overlap_with_remote_clients_runs_them_in_the_idle_class_in_a_process_of_their_own(tmp_path, monkeypatch):
    """``api_remote``'s clients run in a spawned process in SCHED_IDLE; this thread keeps its class."""
    classes: list[int] = []
    time_decode = overlap_api.Clients.time_decode

    def recording(self, *args):
        classes.append(os.sched_getscheduler(0))
        return time_decode(self, *args)

    monkeypatch.setattr(overlap_api.Clients, "time_decode", recording)
    path = tmp_path / "w5.json"
    # Steps slow enough that clients in the idle class keep up beside the suite's other worker.
    overlap.main(["--batch", "4", "--context", "32", "--steps", "20", "--warmup", "2", "--repeats", "1",
                  "--step-ms", "10", "--peers", "api", "api_remote", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert positive_finite(figures["api_remote_efficiency_b4"]) and positive_finite(figures["api_efficiency_b4"])
    assert classes == [os.SCHED_OTHER], "the api peer's clients ran here, api_remote's elsewhere"
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "this thread runs the split and in-process peers"


def test_a_window_whose_clients_fell_behind_is_run_again_and_fails_only_when_every_run_did(monkeypatch, capsys):
    """A window the clients read only after the server had computed it times no decode pass: it is not a figure."""
    timed = overlap_api.ApiRun(wall_s=0.5, steps=40, scheduler_cpu_s=0.1, client_cpu_s=0.1)
    outcomes: list[overlap_api.ApiRun | None] = [None, timed]

    def run(self, *args):
        if (outcome := outcomes.pop(0)) is None:
            raise overlap_api.ClientsBehind("batch 4: the clients fell behind")
        return outcome

    monkeypatch.setattr(overlap_api.Clients, "time_decode", run)
    peer = overlap_api.ApiPeer(0, [SimpleNamespace(process=SimpleNamespace(pid=os.getpid()))])
    assert peer.time_decode(4, 32, 2, 40, 100) == timed
    assert "batch 4: the clients fell behind; running it again" in capsys.readouterr().err

    outcomes[:] = [None] * overlap_api.ATTEMPTS
    with pytest.raises(overlap_api.ClientsBehind):
        peer.time_decode(4, 32, 2, 40, 100)
    assert not outcomes, "every attempt ran"


def test_serving_on_a_shadow_stack_writes_its_keys(tmp_path):
    path = tmp_path / "w3.json"
    serving.main(["--launch", "shadow", "--num-prompts", "3", "--request-rate", "50", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["completed"] == 3 and figures["failed"] == 0
    assert figures["request_rate"] == 50
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        assert positive_finite(figures[key]), key


def test_serving_through_the_openai_api_writes_the_same_keys(tmp_path):
    path = tmp_path / "w3.json"
    serving.main(["--backend", "openai", "--launch", "shadow", "--workload", "w1", "--num-prompts", "3",
                  "--request-rate", "50", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["backend"] == "openai" and figures["completed"] == 3 and figures["failed"] == 0
    assert figures["output_tokens"] == sum(serving.WORKLOADS["w1"]().head(3).max_tokens)
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        assert positive_finite(figures[key]), key


def test_w2_runs_on_a_shrunken_random_qwen3(tmp_path):
    """The W2 path (random Qwen3 weights, temperature 0.6, its own max_model_len) end to end, on the CPU, with the
    in-process peer at the split's overlap and the mixed policy, and the transformers continuous-batching peer the GPU
    check runs."""
    folder = random_model.save_random(
        tmp_path / "qwen3", torch.float32, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
        vocab_size=10240,
    )
    path = tmp_path / "w2.json"
    throughput.main(["--workload", "w2", "--model", str(folder), "--num-requests", "1", "--peers", "inprocess",
                     "inprocess_overlap", "hf_cb", "--kv-cache-memory", str(64 << 20), "--repeats", "2",
                     "--scheduling-policy", "mixed", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["scheduling_policy"] == "mixed"
    peers = ("inprocess", "inprocess_overlap", "hf_cb")
    assert all(positive_finite(figures[f"{peer}_tok_s"]) for peer in peers) and figures["repeats"] == 2
    assert all(0.0 <= figures[f"{peer}_stolen_cpu_share"] <= 1.0 for peer in peers)  # a share of the CPU time
    assert positive_finite(figures["hf_cb_paired_over_inprocess"]) and "inprocess_paired_over_inprocess" not in figures
    assert all(positive_finite(figures[f"{peer}_over_inprocess"]) for peer in ("hf_cb", "inprocess_overlap"))


def test_throughput_rounds_alternate_in_reverse_and_pair_with_in_process(tmp_path, monkeypatch):
    """Every other round runs the peers in reverse, and ``paired`` ratios are taken round by round: here the split
    loses every round but the last, which the medians alone (11 s each) would hide."""
    calls: list[str] = []
    seconds = {"inprocess": iter([10.0, 12.0, 11.0]), "split": iter([11.0, 13.0, 10.0])}

    def peer(name: str):
        return lambda args, workload: calls.append(name) or next(seconds[name])

    for name in seconds:
        monkeypatch.setitem(throughput.PEERS, name, peer(name))
    path = tmp_path / "w1.json"
    throughput.main(["--num-requests", "1", "--peers", "inprocess", "split", "--repeats", "3", "--json", str(path)])
    assert calls == ["inprocess", "split", "split", "inprocess", "inprocess", "split"]
    figures = json.loads(path.read_text())
    assert figures["split_over_inprocess"] == pytest.approx(1.0)
    assert figures["split_paired_over_inprocess"] == pytest.approx(12 / 13)


def run_split_peers(tmp_path, peers: tuple[str, ...]) -> dict[str, float]:
    """W2 on a one-layer random Qwen3 through the split ``peers``; their JSON figures."""
    folder = random_model.save_random(
        tmp_path / "qwen3", torch.float32, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
        vocab_size=10240,
    )
    path = tmp_path / "w2-split.json"
    throughput.main(["--workload", "w2", "--model", str(folder), "--num-requests", "2", "--peers", *peers,
                     "--kv-cache-memory", str(64 << 20), "--json", str(path)])
    return json.loads(path.read_text())


def test_the_split_at_default_flags_runs_the_workload_to_its_last_token(tmp_path):
    """The split peer the figures table quotes: each request's token count is checked as it returns."""
    assert positive_finite(run_split_peers(tmp_path, ("split_overlap",))["split_overlap_tok_s"])


@pytest.mark.slow
def test_every_split_variant_runs_the_workload_to_its_last_token(tmp_path):
    """The other ways a client drives the split (one response per token, whole completions through
    GenerateOnce) and the split with ``--yield-cpu on``; each starts its own pair of services (about 10 s)."""
    peers = ("split_tokens", "split_whole", "split_yield")
    figures = run_split_peers(tmp_path, peers)
    assert all(positive_finite(figures[f"{peer}_tok_s"]) for peer in peers)


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels")
def test_mixed_attention_writes_its_keys(tmp_path):
    path = tmp_path / "mixed.json"
    mixed_attention.main(["--dtype", "bfloat16", "--decodes", "2", "--chunks", "8", "4:12", "--repeats", "1",
                          "--model", "--json", str(path)])
    figures = json.loads(path.read_text())
    for chunk, prefix in ((8, 0), (4, 12)):
        for way in ("whole", "split", "forward_whole", "forward_split"):
            assert positive_finite(figures.pop(f"bfloat16_2_{chunk}_{prefix}_{way}_ms"))
    assert figures == {}


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels")
def test_kernels_writes_its_keys(tmp_path):
    path = tmp_path / "kernels.json"
    kernels.main(["--dtype", "bfloat16", "--rows", "1", "3", "--repeats", "1", "--json", str(path)])
    figures = json.loads(path.read_text())
    for name in kernels.KERNELS:
        for rows in (1, 3):
            assert positive_finite(figures[f"{name}_{rows}_ms"]) and positive_finite(figures[f"{name}_{rows}_torch_ms"])
    assert set(figures["choice"]) == set(FAMILIES)
    assert all(set(row) == set(CLASSES) and set(row.values()) <= {"c", "torch"} for row in figures["choice"].values())


@pytest.mark.parametrize(("stack", "linear"), [("on", "c"), ("off", "c"), ("on", "torch")])
def test_profile_accounts_for_the_run(tmp_path, stack, linear):
    """Two W1 requests on the embedded model: the components add up to no more than the run; decode steps in the
    C decoder stack (its projections in torch where the kernel choice imposed says so), or (off) layer by layer."""
    path = tmp_path / "profile.json"
    profile.main(["--dtype", "bfloat16", "--num-requests", "2", "--cpu-decode-stack", stack,
                  "--cpu-kernels", f"c,linear={linear}", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["prefill_steps"] >= 1 and figures["decode_steps"] > 10
    assert figures["decode_linear_s"] > 0  # the LM head, outside the stack
    assert (figures["decode_stack_s"] > 0) == (stack == "on")
    assert (figures["decode_attention_s"] > 0) == (stack == "off")
    if stack == "on":  # the stack's parts: one C call a step, or torch projections with C between them
        assert (figures["stack_whole_c_s"] > 0) == (linear == "c")
        assert (figures["stack_projections_s"] > 0) == (figures["stack_attention_s"] > 0) == (linear == "torch")
        assert (linear == "c") or figures["stack_norms_silu_s"] > 0
        stack_parts = [figures[f"stack_{key}_s"] for key in (*profile.STACK_PARTS.values(), "python")]
        assert all(v >= 0 for v in stack_parts) and sum(stack_parts) == pytest.approx(figures["decode_stack_s"])
    else:
        assert not any(key.startswith("stack_") for key in figures)
    parts = [v for k, v in figures.items() if k.startswith(("prefill_", "decode_")) and k.endswith("_s")]
    assert all(v >= 0 for v in parts)
    assert sum(parts) <= figures["total_s"] * 1.01


def test_profile_and_kernels_take_a_random_weight_w1_model(tmp_path):
    """Where the embedded model's wheel is missing (the GPU machine's host CPU), a random-weight folder of its
    architecture stands in: the profile runs W1 on it and ``bench.kernels`` shows that executor's choice."""
    folder = random_model.save_random(tmp_path / "smollm2", torch.float32, arch="smollm2-135m", num_hidden_layers=1,
                                      vocab_size=10240)
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_key_value_heads"]) == ("llama", 576, 3)
    path = tmp_path / "profile.json"
    profile.main(["--model", str(folder), "--num-requests", "2", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["prefill_steps"] >= 1 and figures["decode_steps"] > 10 and positive_finite(figures["tok_s"])
    choice = kernels.executor_choice("float32", str(folder))
    assert set(choice.table) == set(FAMILIES)


@pytest.mark.skipif(cpu_kernels.kernel_library() is None, reason="no C compiler here to build the CPU kernels")
def test_kernels_cut_prefill_into_prompts_of_the_length_asked(tmp_path, monkeypatch):
    """``--prompt-tokens``: the prefill attention peers get prompts that long (one prompt of 300 tokens; cut to 100,
    three), as ``prefill_batch`` cuts them."""
    from executor_svc.cpu.probe import prefill_batch

    gen = torch.Generator().manual_seed(0)
    for prompt_tokens, cu in ((300, [0, 300]), (100, [0, 100, 200, 300])):
        _, _, _, meta = prefill_batch(300, 9, 3, 64, torch.float32, gen, prompt_tokens)
        assert meta.cu_seqlens_q.tolist() == meta.cu_seqlens_k.tolist() == cu
        assert meta.max_seqlen_k == prompt_tokens
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(kernels, "prefill_batch", lambda rows, *args: asked.append((rows, args[-1])) or prefill_batch(
        rows, *args))
    path = tmp_path / "kernels.json"
    kernels.main(["--dtype", "bfloat16", "--kernels", "prefill_attention", "--rows", "300", "--prompt-tokens", "300",
                  "--repeats", "1", "--json", str(path)])
    assert asked == [(300, 300)]
    figures = json.loads(path.read_text())
    assert positive_finite(figures["prefill_attention_300_ms"])
    assert positive_finite(figures["prefill_attention_300_torch_ms"])


def test_profile_runs_w2s_requests(tmp_path):
    """``--workload w2``: W2's first request (a prompt of 964 tokens, one prefill step) on a one-layer model of the
    embedded one's architecture, its prefill attention timed."""
    folder = random_model.save_random(tmp_path / "smollm2", torch.float32, arch="smollm2-135m", num_hidden_layers=1,
                                      vocab_size=10240)
    path = tmp_path / "profile.json"
    profile.main(["--model", str(folder), "--workload", "w2", "--num-requests", "1", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["prefill_steps"] == 1 and figures["decode_steps"] > 0
    assert figures["prefill_attention_s"] > 0 and positive_finite(figures["tok_s"])


def test_a_child_that_dies_shows_the_end_of_its_log(tmp_path):
    from bench.common import Child

    child = Child("executor", [sys.executable, "-c", "import sys; print('no KV block fits'); sys.exit(3)"],
                  tmp_path / "executor.log")
    try:
        with pytest.raises(RuntimeError, match=r"exited with code 3; its log ends:\nno KV block fits"):
            child.wait_serving("127.0.0.1:1", timeout_s=30)
    finally:
        child.stop()


def test_options_writes_its_keys(tmp_path):
    path = tmp_path / "options.json"
    options.main(["--batch", "2", "--context", "8", "--steps", "3", "--repeats", "1", "--json", str(path)])
    figures = json.loads(path.read_text())
    for peer in options.PEERS:
        assert positive_finite(figures[f"{peer}_step_ms"])
    assert figures["plain_over_plain"] == 1.0 and positive_finite(figures["json_schema_over_plain"])


def test_lora_writes_its_keys(tmp_path):
    path = tmp_path / "lora.json"
    lora.main(["--num-requests", "4", "--max-tokens", "3", "--rank", "4", "--threads", "1", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert positive_finite(figures["ratio"]) and positive_finite(figures["cpu_ratio"])
    assert [len(figures["seconds"][peer]) for peer in lora.PEERS] == [1, 1]


def test_spec_writes_its_keys(tmp_path):
    path = tmp_path / "spec.json"
    spec.main(["--batch", "1", "2", "--max-tokens", "32", "--draft-layers", "2", "--json", str(path)])
    figures = json.loads(path.read_text())
    for peer in spec.PEERS:
        assert positive_finite(figures[f"{peer}_tok_s_b1"]) and positive_finite(figures[f"{peer}_tok_s_b2"])
    assert figures["ngram_accept_len"] > 2  # W6 repeats its block: the model copies it and proposals are accepted
