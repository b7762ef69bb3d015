"""``python -m executor_svc`` serves a model over gRPC; flags and NANOSERVE_* variables configure it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.security import TLSConfig, channel_credentials
from executor_svc.__main__ import build_parser, options_from_args
from executor_svc.service import CallingThread
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor
from tests.model_fixtures import hf_greedy, tiny_model_folders  # noqa: F401
from tests.service_fixtures import HOST, executor_argv, free_port, spawn, wait_serving
from tests.test_model_parity import random_prompts
from tests.test_security import Certs, certs  # noqa: F401


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_BLOCK_SIZE", "32")
    monkeypatch.setenv("NANOSERVE_KV_CACHE_MEMORY", "512M")
    monkeypatch.setenv("NANOSERVE_ENFORCE_EAGER", "true")
    options = options_from_args(build_parser().parse_args(["--kv-cache-memory", "2GiB", "--threads", "3"]))
    assert (options.block_size, options.kv_cache_memory, options.threads) == (32, 2 << 30, 3)
    assert options.enforce_eager is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-memory", "lots"])


@pytest.mark.parametrize(("value", "expected"), [("on", True), ("yes", True), ("1", True), ("off", False),
                                               ("false", False)])
def test_enforce_eager_reads_every_boolean_word_the_scheduler_accepts(value: str, expected: bool) -> None:
    """NANOSERVE_ENFORCE_EAGER=on was ignored: the executor knew only 1/true/yes."""
    options = options_from_args(build_parser({"NANOSERVE_ENFORCE_EAGER": value}).parse_args([]))
    assert options.enforce_eager is expected


def test_a_bad_environment_value_names_its_variable(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser({"NANOSERVE_ENFORCE_EAGER": "sometimes"})
    assert "NANOSERVE_ENFORCE_EAGER='sometimes'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser({"NANOSERVE_DTYPE": "int3"})
    assert "choose from float32" in capsys.readouterr().err


def test_served_executor_matches_hugging_face(tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    port = free_port()
    folder = str(tiny_model_folders["qwen3"])
    env = {**os.environ, "NANOSERVE_BLOCK_SIZE": "8", "NANOSERVE_MODEL": folder, "NANOSERVE_DTYPE": "float32"}
    argv = [sys.executable, "-m", "executor_svc", "--port", str(port), "--kv-cache-memory", "4M"]
    server = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        remote = RemoteExecutor(f"127.0.0.1:{port}")
        info = remote.get_info(timeout_s=120, wait_for_ready=True)
        assert (info.architecture, info.block_size, info.model_id) == ("Qwen3ForCausalLM", 8, folder)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = random_prompts(3)[:4]
        served = [c.token_ids for c in Engine(remote).generate(prompts, params)]
        assert served == hf_greedy(Path(folder), prompts, max_new_tokens=12, stop_at_eos=False)
    finally:
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output
    assert "KV blocks of 8 tokens" in output


def test_executor_serves_mutual_tls(tiny_model_folders: dict[str, Path], certs: Certs) -> None:  # noqa: F811
    port = free_port()
    argv = [sys.executable, "-m", "executor_svc", "--port", str(port), "--kv-cache-memory", "4M",
            "--model", str(tiny_model_folders["llama"]), "--tls-cert", certs.server_cert,
            "--tls-key", certs.server_key, "--tls-ca", certs.ca]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client_tls = TLSConfig(certs.client_cert, certs.client_key, certs.ca)
        remote = RemoteExecutor(f"localhost:{port}", credentials=channel_credentials(client_tls))
        remote.get_info(timeout_s=120, wait_for_ready=True)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert all(len(c.token_ids) == 4 for c in Engine(remote).generate(random_prompts(5)[:2], params))
        with pytest.raises(grpc.RpcError) as refused:
            RemoteExecutor(f"127.0.0.1:{port}").get_info(timeout_s=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output
    assert "mTLS" in output


def test_calls_from_grpc_threads_run_on_the_serving_thread() -> None:
    """torch work stays on one thread (one OpenMP team); errors reach the caller; stop ends the loop."""
    calling = CallingThread()
    runner = threading.Thread(target=calling.run)
    runner.start()
    with ThreadPoolExecutor(4) as pool:
        idents = set(pool.map(lambda _: calling.call(threading.get_ident), range(16)))
        failed = pool.submit(calling.call, int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            failed.result()
    assert idents == {runner.ident}
    calling.stop()
    runner.join(timeout=5)
    assert not runner.is_alive()


def unblocked_helper_thread(pid: int) -> int:
    """A thread of process ``pid`` other than its main one that does not block SIGTERM."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        if int(task.name) != pid and not int(status["SigBlk"], 16) & (1 << (signal.SIGTERM - 1)):
            return int(task.name)
    raise AssertionError(f"every thread of {pid} but the main one blocks SIGTERM")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_sigterm_delivered_to_a_grpc_thread_stops_an_idle_executor(tmp_path: Path) -> None:
    """The kernel may hand a process's SIGTERM to any thread that does not block it; an executor no scheduler
    sends steps to kept serving until killed when it landed on a gRPC thread (its main thread waited for a call)."""
    port = free_port()
    log = tmp_path / "executor.log"
    server = spawn(executor_argv("shadow", port, {}), log)
    try:
        wait_serving(f"{HOST}:{port}", server)
        assert ctypes.CDLL(None, use_errno=True).tgkill(server.pid, unblocked_helper_thread(server.pid),
                                                        signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
        assert server.wait(timeout=15) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert "executor stopping on signal 15" in log.read_text()



# /proc/cpuinfo's flags and what the executor chooses on such a CPU: its dtype and its OpenMP threads' spin.
CPUS = [
    ("fpu sse avx2 avx512f avx512_bf16", "bfloat16", "10000"),
    ("fpu sse avx2 amx_tile amx_bf16", "bfloat16", "200000"),
    ("fpu sse avx2 avx512f", "float32", "10000"),
    ("fpu sse avx2 fma", "float32", "10000"),
]


def pretend_cpu_flags(monkeypatch: pytest.MonkeyPatch, flags: str) -> None:
    from executor_svc.cpu import cpuinfo

    monkeypatch.setattr(cpuinfo, "cpuinfo", lambda *keys: f"flags\t\t: {flags}" if "flags" in keys else "")


@pytest.mark.parametrize(("flags", "expected", "_spin"), CPUS)
def test_the_cpu_dtype_is_bfloat16_only_where_the_cpu_multiplies_it(
        flags: str, expected: str, _spin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_cpu_flags(monkeypatch, flags)
    assert options_from_args(build_parser({}).parse_args(["--device", "cpu"])).resolved_dtype() == expected
    assert options_from_args(build_parser({}).parse_args(["--device", "cuda"])).resolved_dtype() == "bfloat16"
    forced = build_parser({"NANOSERVE_DTYPE": "float32"}).parse_args(["--device", "cpu"])
    assert options_from_args(forced).resolved_dtype() == "float32", "a dtype asked for is kept"


@pytest.mark.parametrize(("flags", "_dtype", "expected"), CPUS)
def test_openmp_threads_spin_longer_on_cpus_with_amx_unless_the_environment_says(
        flags: str, _dtype: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from executor_svc.cpu import openmp

    pretend_cpu_flags(monkeypatch, flags)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    openmp.set_wait_policy()
    assert os.environ["GOMP_SPINCOUNT"] == expected
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    openmp.set_wait_policy()
    assert os.environ["GOMP_SPINCOUNT"] == "123", "a spin the environment sets is kept"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    openmp.set_wait_policy()
    assert "GOMP_SPINCOUNT" not in os.environ, "a wait policy the environment sets is kept"
