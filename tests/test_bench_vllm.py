"""The vLLM peers of W1 and W3 and what W3 reports: skipped with one line where vLLM is absent (CI has none), the
other peers untouched; the arguments; the saturation point and ITL on synthetic data. The tests that run vLLM itself
need NANOSERVE_VLLM_PYTHON (the recipe is in docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench import serving, serving_peers, throughput, vllm_setup
from bench.common import Workload, w3
from bench.serving_load import (
    RequestResult,
    arrivals,
    in_flight_growth,
    kept_up,
    piled_up,
    run_load,
    saturation_point,
    summarise,
)

VLLM_PYTHON = os.environ.get(vllm_setup.ENV_VAR)
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason=f"{vllm_setup.ENV_VAR} is unset: no vLLM environment")


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_setup.ENV_VAR, raising=False)


def test_w1_without_a_vllm_python_skips_the_peer_in_one_line_and_runs_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_vllm: None):
    monkeypatch.setitem(throughput.PEERS, "inprocess", lambda args, workload: 2.0)
    path = tmp_path / "w1.json"
    throughput.main(["--num-requests", "2", "--peers", "inprocess", "vllm", "--json", str(path)])
    skips = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vllm peer skipped: ")]
    assert len(skips) == 1 and vllm_setup.ENV_VAR in skips[0]
    figures = json.loads(path.read_text())
    assert figures["inprocess_tok_s"] > 0 and "vllm_tok_s" not in figures


def test_a_python_without_vllm_is_named_in_the_skip_line(capsys: pytest.CaptureFixture[str]):
    args = throughput.parse_args(["--vllm-python", sys.executable])
    assert vllm_setup.admit(args, ["inprocess", "vllm"]) == ["inprocess"]
    assert "cannot import vllm" in capsys.readouterr().err
    missing = throughput.parse_args(["--vllm-python", "/nonexistent/bin/python"])
    assert "does not exist" in vllm_setup.unavailable(missing)


def test_vllm_runs_bound_to_the_allowed_cores_with_none_reserved_and_intel_openmp(tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch):
    assert vllm_setup.cpu_list([0, 1]) == "0-1" and vllm_setup.cpu_list([5, 0, 1, 2]) == "0-2,5"
    (tmp_path / "lib" / "python3.11").mkdir(parents=True)
    (tmp_path / "lib" / "libiomp5.so").touch()
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    env = vllm_setup.VllmEnv("python", "0.0", tmp_path, cli=True).env(threads=1)
    first = min(os.sched_getaffinity(0))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(first) and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"].split()[0] == str(tmp_path / "lib" / "libiomp5.so")
    assert env["HF_HUB_OFFLINE"] == "1" and "GOMP_SPINCOUNT" not in env


def test_serving_arguments():
    args = serving.parse_args([])
    assert (args.peers, args.client, args.workload, args.rounds, args.single) == (
        list(serving_peers.DEFAULT_PEERS), "builtin", "w3", 1, False)
    args = serving.parse_args(["--peers", "vllm", "nanoserve", "--request-rate", "2", "4", "--rounds", "3"])
    assert args.peers == ["vllm", "nanoserve"] and args.request_rate == [2.0, 4.0] and args.rounds == 3
    assert serving.parse_args(["--launch", "shadow", "--request-rate", "5"]).single
    for bad in (["--launch", "shadow", "--peers", "vllm"], ["--launch", "real", "--request-rate", "1", "2"],
                ["--client", "vllm-bench", "--workload", "w1"], ["--rounds", "0"], ["--request-rate", "0"]):
        with pytest.raises(SystemExit):
            serving.parse_args(bad)


def test_w3_draws_vllm_randoms_shape_and_every_peer_gets_the_same_arrivals():
    workload = w3()
    assert len(workload) == 64 and {len(p) for p in workload.prompts} == {256} and set(workload.max_tokens) == {128}
    assert arrivals(5, 2.0, seed=0) == arrivals(5, 2.0, seed=0) != arrivals(5, 2.0, seed=1)
    assert [2 * t for t in arrivals(5, 4.0, seed=0)] == pytest.approx(arrivals(5, 2.0, seed=0))
    assert arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    times = arrivals(64, 4.0, seed=0)  # this draw's own rate is 0.86 of 4: the sends come at 4 req/s all the same
    assert times[0] == 0.0 and times[-1] == pytest.approx(63 / 4.0) and times == sorted(times)


def test_a_server_that_piles_requests_up_did_not_keep_up_though_it_finishes_them_together():
    """At 1 req/s over 32 s: a server with a steady 3 s per request holds ~3 in flight; one that falls behind and
    then finishes everything in one batch completes as fast as requests came, but its requests pile up."""
    steady = [RequestResult(output_tokens=8, ttft_s=0.1, latency_s=3.0, sent_s=i) for i in range(32)]
    behind = [RequestResult(output_tokens=8, ttft_s=0.1, latency_s=40.0 - i / 2, sent_s=i) for i in range(32)]
    calm, piled = in_flight_growth(steady), in_flight_growth(behind)
    assert calm[0] == calm[1] == 3 and not piled_up(calm, 32) and piled_up(piled, 32)
    assert summarise(steady, 35.0, 1.0)["kept_up"]
    figures = summarise(behind, 56.0, 1.0)
    assert figures["achieved_req_s"] >= figures["offered_req_s"] and not figures["kept_up"]
    assert in_flight_growth(steady[:7]) is None and kept_up(1.0, 1.0, 0, None)


def test_a_server_piled_up_by_the_third_quarter_did_not_keep_up_though_its_count_grew_by_a_smaller_factor():
    """A Xeon round of 64 requests (e03f2f9): at 4 req/s vLLM held 39.4 then 47.2 requests in flight, less than a
    quarter more, but 7.8 more of the quarter's 16 arrivals, and took 13.8 s a request against 8.2 s at 2 req/s;
    at 2 req/s nanoserve held 8.6 then 10.1."""
    assert not kept_up(3.43, 3.45, 0, (39.375, 47.1875), 64)
    assert kept_up(1.71, 1.78, 0, (8.5625, 10.0625), 64)
    # Completions at three quarters of the arrivals' pace or faster pass, with two requests for noise: 16 arrivals
    # between the quarters allow 4 + 2 more in flight.
    assert not piled_up((30.0, 36.0), 64) and piled_up((30.0, 36.5), 64)


def test_saturation_point_is_the_highest_rate_kept_up_with_below_the_first_miss():
    assert kept_up(2.0, 1.9, failed=0) and not kept_up(2.0, 1.89, failed=0) and not kept_up(2.0, 2.0, failed=1)
    assert kept_up(None, 5.0, failed=0) is None  # all at once: no offered rate
    assert saturation_point({1.0: True, 2.0: True, 4.0: False, math.inf: None}) == 2.0
    assert saturation_point({1.0: True, 2.0: False, 4.0: True}) == 1.0
    assert saturation_point({2.0: False}) is None


def test_summarise_pools_the_itl_of_every_request_and_measures_both_rates():
    results = [
        RequestResult(output_tokens=4, ttft_s=0.1, latency_s=0.4, sent_s=0.0, itl_s=[0.1, 0.1, 0.1]),
        RequestResult(output_tokens=3, ttft_s=0.2, latency_s=0.6, sent_s=1.0, itl_s=[0.2, 0.2]),
        RequestResult(output_tokens=2, ttft_s=0.1, latency_s=1.4, sent_s=2.0, itl_s=[1.3]),
        RequestResult(sent_s=3.0, error="refused"),
    ]
    figures = summarise(results, duration_s=4.0, request_rate=1.0)
    # ITL gaps in ms, pooled: 100, 100, 100, 200, 200, 1300 (linear interpolation between order statistics)
    assert figures["itl_p50_ms"] == pytest.approx(150.0) and figures["itl_p90_ms"] == pytest.approx(750.0)
    assert figures["itl_p99_ms"] == pytest.approx(1245.0) and figures["itl_mean_ms"] == pytest.approx(1e3 * 2 / 6)
    assert figures["tpot_p50_ms"] == pytest.approx(200.0)  # (0.3 / 3, 0.4 / 2, 1.3 / 1)
    # 4 sends over 3 s; 3 completions (at 0.4, 1.6, 3.4 s) over 3 s; a failure: not kept up
    assert figures["offered_req_s"] == pytest.approx(1.0) and figures["achieved_req_s"] == pytest.approx(2 / 3)
    assert (figures["completed"], figures["failed"], figures["kept_up"]) == (3, 1, False)


def test_a_stream_that_ends_short_of_its_tokens_counts_as_failed():
    # EOS is ignored: a stream that ends early (an ABORT, a lost usage chunk) is no success to either peer.
    workload = Workload("w3", [[1, 2], [0, 2], [3, 4]], [4, 4, 4], 0.0, 64)

    async def send(prompt: list[int], max_tokens: int, temperature: float) -> RequestResult:
        return RequestResult(output_tokens=max_tokens if prompt[0] else 1, ttft_s=0.01, latency_s=0.02)

    @contextlib.asynccontextmanager
    async def backend():
        yield send

    results, _ = asyncio.run(run_load(backend(), workload, math.inf, seed=0))
    assert [r.error for r in results] == [None, "the stream ended after 1 of 4 tokens", None]


def test_vllm_bench_results_read_back_as_the_same_per_request_results():
    data = {"duration": 3.0, "start_times": [10.0, 10.5], "output_lens": [3, 0], "ttfts": [0.2, 0.0],
            "latencies": [0.6, 0.0], "itls": [[0.2, 0.2], []], "errors": ["", "Connection refused"]}
    results, duration = serving_peers.results_from_vllm_bench(data)
    assert duration == 3.0
    assert (results[0].sent_s, results[0].itl_s, results[0].error, results[0].tpot_s) == (0.0, [0.2, 0.2], None,
                                                                                          pytest.approx(0.2))
    assert (results[1].sent_s, results[1].error) == (0.5, "Connection refused")


def shadow_nanoserve(stack: ExitStack, dtype: str, log: Path, timeout_s: float, policy: str | None = None,
                     model: str | None = None) -> serving_peers.Server:
    """The model-free shadow stack standing in for ``make run``'s, so that W3's peer loop runs in seconds."""
    target, base_url = serving_peers.launch("shadow", w3(), stack, 256, 2, dtype, timeout_s)
    return serving_peers.Server(target, base_url)


def test_w3_without_a_vllm_python_skips_the_peer_and_writes_the_others_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_vllm: None):
    monkeypatch.setattr(serving, "start_nanoserve", shadow_nanoserve)
    path = tmp_path / "w3.json"
    serving.main(["--num-prompts", "3", "--request-rate", "20", "inf", "--json", str(path)])
    out, err = capsys.readouterr()
    assert err.count("vllm peer skipped: ") == 1 and "round 1 nanoserve_openai @ inf" in err
    # Three requests are too few to judge a pile-up: no in-flight figures, and two more of them allowed.
    assert "| in flight |" in out and "kept up allows +2.1875" in out
    figures = json.loads(path.read_text())
    assert figures["peers"] == ["nanoserve", "nanoserve_openai"] and "vllm" in figures["skipped"]
    for peer in ("nanoserve", "nanoserve_openai"):
        for rate in ("20", "inf"):
            for key in ("req_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                        "itl_p50_ms", "itl_p90_ms", "itl_p99_ms"):
                assert figures[f"{peer}_r{rate}_{key}"] > 0, (peer, rate, key)
        assert figures[f"{peer}_rinf_kept_up"] is None and f"{peer}_saturation_req_s" in figures
    assert not any(key.startswith("vllm_") for key in figures)


def test_the_mixed_peer_is_the_same_stack_at_the_mixed_policy_over_grpc(
        monkeypatch: pytest.MonkeyPatch, no_vllm: None):
    policies: list[str | None] = []

    def recording(stack: ExitStack, dtype: str, log: Path, timeout_s: float, policy: str | None = None,
                  model: str | None = None):
        policies.append(policy)
        return shadow_nanoserve(stack, dtype, log, timeout_s)

    monkeypatch.setattr(serving, "start_nanoserve", recording)
    figures = serving.main(["--peers", "nanoserve", "nanoserve_mixed", "--num-prompts", "3", "--request-rate", "20"])
    assert policies == [None, "mixed"]
    assert figures["nanoserve_mixed_r20_output_tok_s"] > 0 and figures["peers"] == ["nanoserve", "nanoserve_mixed"]


def test_on_cuda_the_peers_are_the_gpu_pair_of_the_named_model_in_bfloat16_without_vllm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_vllm: None):
    started: list[tuple[str, str | None, str | None]] = []

    def recording(stack: ExitStack, dtype: str, log: Path, timeout_s: float, policy: str | None = None,
                  model: str | None = None):
        started.append((dtype, policy, model))
        return shadow_nanoserve(stack, dtype, log, timeout_s)

    monkeypatch.setattr(serving, "start_nanoserve_pair", recording)
    monkeypatch.setattr(serving, "start_nanoserve", None)
    path = tmp_path / "w3.json"
    serving.main(["--device", "cuda", "--model", "/models/qwen3", "--peers", "nanoserve", "nanoserve_mixed", "vllm",
                  "--num-prompts", "3", "--request-rate", "20", "--json", str(path)])
    assert started == [("bfloat16", None, "/models/qwen3"), ("bfloat16", "mixed", "/models/qwen3")]
    assert "vllm peer skipped: vLLM's CPU build serves on the CPU" in capsys.readouterr().err
    figures = json.loads(path.read_text())
    assert (figures["device"], figures["model"], figures["peers"]) == ("cuda", "/models/qwen3",
                                                                       ["nanoserve", "nanoserve_mixed"])
    assert figures["nanoserve_mixed_r20_output_tok_s"] > 0
    with pytest.raises(SystemExit):
        serving.parse_args(["--device", "cuda", "--launch", "real"])


def test_the_gpu_pair_serves_from_this_checkout_with_the_policy_and_model_it_is_given(tmp_path: Path):
    """The pair ``--device cuda`` starts, with its executor on the CPU: the commands and environment it gives each
    service start them, and the scheduler runs the policy named."""
    from client.api import Client
    from client.stack import DEFAULT_MODEL

    with ExitStack() as stack:
        server = serving_peers.start_nanoserve_pair(stack, "float32", tmp_path / "pair.log", 300.0, "mixed",
                                                    DEFAULT_MODEL, device="cpu")
        assert server.served_model() == DEFAULT_MODEL
        with urllib.request.urlopen(f"{server.base_url.removesuffix('/v1')}/server_info", timeout=10) as response:
            info = json.load(response)
        assert (info["scheduling_policy"], info["device"], info["dtype"]) == ("mixed", "cpu", "float32")
        with Client(server.grpc_target) as client:
            tokens = client.generate(token_ids=[100, 101, 102, 103], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(tokens.token_ids) == 4
    assert "executor ready" in (tmp_path / "pair-scheduler.log").read_text()


def test_rounds_alternate_and_each_figure_is_the_median_of_its_rounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_vllm: None):
    calls: list[str] = []
    tok_s = {"nanoserve": iter([100.0, 130.0, 90.0]), "nanoserve_openai": iter([95.0, 80.0, 120.0])}

    def fake_peer(args, peer, venv, workload, logs):
        calls.append(peer)
        results = [RequestResult(output_tokens=2, ttft_s=0.1, latency_s=0.2, sent_s=i, itl_s=[0.1]) for i in range(3)]
        figures = summarise(results, duration_s=3.0, request_rate=1.0)
        return {1.0: {**figures, "output_tok_s": next(tok_s[peer])}}

    monkeypatch.setattr(serving, "run_peer", fake_peer)
    figures = serving.main(["--peers", "nanoserve", "nanoserve_openai", "--request-rate", "1", "--rounds", "3"])
    assert calls == ["nanoserve", "nanoserve_openai", "nanoserve_openai", "nanoserve", "nanoserve",
                     "nanoserve_openai"]
    assert (figures["nanoserve_r1_output_tok_s"], figures["nanoserve_openai_r1_output_tok_s"]) == (100.0, 95.0)
    assert figures["nanoserve_r1_kept_up"] and figures["nanoserve_saturation_req_s"] == 1.0


def test_vllm_bench_without_vllm_stops_with_the_reason(no_vllm: None):
    with pytest.raises(SystemExit, match="--client vllm-bench cannot run: no vLLM python given"):
        serving.main(["--client", "vllm-bench", "--peers", "nanoserve_openai"])


@needs_vllm
def test_the_w1_peer_writes_its_key(tmp_path: Path):
    path = tmp_path / "w1.json"
    throughput.main(["--num-requests", "2", "--peers", "vllm", "--json", str(path)])
    assert json.loads(path.read_text())["vllm_tok_s"] > 0


@needs_vllm
def test_the_w3_peer_writes_its_keys(tmp_path: Path):
    found = vllm_setup.find(None)
    if isinstance(found, str) or not found.cli:
        pytest.skip(found if isinstance(found, str) else vllm_setup.CLI_FIX)
    path = tmp_path / "w3.json"
    serving.main(["--peers", "vllm", "--num-prompts", "2", "--request-rate", "4", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["vllm_r4_completed"] == 2 and figures["vllm_r4_output_tok_s"] > 0


def test_each_rate_and_the_warm_up_get_prompts_no_other_run_shares(monkeypatch: pytest.MonkeyPatch, no_vllm: None):
    """A rate after another must not find its prompts in the prefix cache (nor the warm-up's): each draws its own,
    of W3's shape, the same for every peer."""
    sent: dict[str, list[tuple[int, ...]]] = {}

    async def recording_load(backend, workload, rate, seed, label=""):
        sent.setdefault(f"{label}@{rate:g}", []).extend(tuple(p) for p in workload.prompts)
        results = [RequestResult(output_tokens=2, ttft_s=0.1, latency_s=0.2, sent_s=i, itl_s=[0.1])
                   for i in range(len(workload))]
        return results, 1.0

    monkeypatch.setattr(serving, "start_nanoserve", shadow_nanoserve)
    monkeypatch.setattr(serving, "run_load", recording_load)
    serving.main(["--peers", "nanoserve", "nanoserve_openai", "--num-prompts", "4", "--request-rate", "2", "4"])
    warm, first, second = (set(sent[f"nanoserve{name}"]) for name in (" warm-up@4", "@2", "@4"))
    assert len(first) == len(second) == 4 and not (warm & first) and not (first & second) and not (warm & second)
    assert all(len(p) == 256 for p in first | second)
    assert sent["nanoserve@4"] == sent["nanoserve_openai@4"], "every peer gets the same prompts"
