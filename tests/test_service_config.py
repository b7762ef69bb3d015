"""``nanoserve-scheduler`` flags, their NANOSERVE_* environment variables, and what it tunes for its executor."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from common.flags import env_name
from common.step import ExecutorInfo
from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.api.grpc_service import ACCELERATOR_GIL_SWITCH_INTERVAL_S, connect_engine, set_gil_switch_interval
from scheduler_svc.config import ServiceConfig, parse_config
from scheduler_svc.core.sampling import SamplingParams
from tests.conftest import assert_all_blocks_free


def test_defaults():
    assert parse_config([], env={}) == ServiceConfig()
    assert ServiceConfig().executor == "127.0.0.1:50052" and ServiceConfig().port == 50051


def test_every_flag_can_come_from_the_environment():
    env = {
        "NANOSERVE_EXECUTOR": "exec:1", "NANOSERVE_HOST": "0.0.0.0", "NANOSERVE_PORT": "6000",
        "NANOSERVE_MAX_NUM_SEQS": "8", "NANOSERVE_MAX_NUM_BATCHED_TOKENS": "512",
        "NANOSERVE_MAX_QUEUED_REQUESTS": "3", "NANOSERVE_LOG_LEVEL": "debug",
    }
    assert parse_config([], env=env) == ServiceConfig("exec:1", "0.0.0.0", 6000, 8, 512, 3, "DEBUG")


def test_the_flag_wins_over_the_environment():
    config = parse_config(["--port", "7000", "--executor", "a:1"], env={"NANOSERVE_PORT": "6000",
                                                                        "NANOSERVE_EXECUTOR": "b:2"})
    assert (config.port, config.executor) == (7000, "a:1")


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--max-num-seqs", "0"], {}),
        (["--port", "70000"], {}),
        ([], {"NANOSERVE_MAX_QUEUED_REQUESTS": "many"}),
        ([], {"NANOSERVE_LOG_LEVEL": "chatty"}),
        (["--max-num-batched-tokens", "64"], {}),
        ([], {"NANOSERVE_API_KEY": ""}),
        (["--api-key", " "], {}),
    ],
)
def test_bad_values_are_refused(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as e:
        parse_config(argv, env=env)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err
    if "--max-num-batched-tokens" in argv:
        assert "max-num-batched-tokens (64) must be at least max-num-seqs (256)" in err


def test_env_names():
    assert env_name("--max-num-batched-tokens") == "NANOSERVE_MAX_NUM_BATCHED_TOKENS"


def test_reliability_and_security_flags_come_from_the_environment_too():
    env = {"NANOSERVE_MAX_QUEUED_TOKENS": "4096", "NANOSERVE_STEP_TIMEOUT": "2.5", "NANOSERVE_SHUTDOWN_GRACE": "0",
           "NANOSERVE_MAX_MESSAGE_BYTES": "1024", "NANOSERVE_API_KEY": "k", "NANOSERVE_TLS_CERT": "c.pem",
           "NANOSERVE_EXECUTOR_TLS_CA": "ca.pem"}
    config = parse_config([], env=env)
    assert (config.max_queued_tokens, config.step_timeout, config.shutdown_grace, config.max_message_bytes) == (
        4096, 2.5, 0.0, 1024)
    assert (config.api_key, config.tls_cert, config.executor_tls_ca) == ("k", "c.pem", "ca.pem")


def test_the_api_key_never_shows_in_help(capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        parse_config(["--help"], env={"NANOSERVE_API_KEY": "s3cret"})
    out = capsys.readouterr().out
    assert "s3cret" not in out and "NANOSERVE_API_KEY" in out


@pytest.mark.parametrize("argv", [["--step-timeout", "0"], ["--step-timeout", "nan"], ["--shutdown-grace", "-1"],
                                  ["--shutdown-grace", "inf"], ["--max-queued-tokens", "0"],
                                  ["--api-process-cpu-share", "0"], ["--api-process-cpu-share", "1.5"],
                                  ["--api-process-cpu-share", "nan"], ["--plans-ahead", "0"]])
def test_bad_timeouts_and_bounds_are_refused(argv: list[str]):
    with pytest.raises(SystemExit) as e:
        parse_config(argv, env={})
    assert e.value.code == 2


def test_overlap_is_left_to_the_executor_unless_a_flag_says():
    assert ServiceConfig().overlap is None
    assert parse_config([], env={}).overlap is None
    assert parse_config(["--overlap", "off"], env={}).overlap is False
    assert parse_config([], env={"NANOSERVE_OVERLAP": "off"}).overlap is False
    assert parse_config(["--overlap"], env={"NANOSERVE_OVERLAP": "off"}).overlap is True


@pytest.mark.parametrize(("device", "flag", "overlap"), [("cpu", None, False), ("cuda:0", None, True),
                                                         ("simulated", None, True), ("cpu", "on", True),
                                                         ("cuda:0", "off", False)])
def test_overlap_by_default_only_beside_an_accelerator(device: str, flag: str | None, overlap: bool):
    """On the CPU the executor's step leaves the scheduler's work nothing to hide behind, and a step queued ahead
    would hold an arrival's prefill back by a whole step: the engine keeps a step in flight only beside an
    accelerator, unless --overlap says."""
    executor = ShadowExecutor(16, 4, 50, (0,))
    executor.info = replace(executor.info, device=device)
    config = parse_config(["--overlap", flag] if flag else [], env={})
    engine = connect_engine(executor, config)
    assert engine.overlap is overlap
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(seq.completion_token_ids) == 4
    assert_all_blocks_free(engine.block_manager)


@pytest.mark.parametrize(("device", "flag", "plans_ahead"), [("cpu", None, 1), ("cuda:0", None, 2),
                                                             ("simulated", None, 2), ("cpu", "2", 2),
                                                             ("cuda:0", "1", 1)])
def test_two_plans_ahead_by_default_only_beside_an_accelerator(device: str, flag: str | None, plans_ahead: int):
    """Beside an accelerator a plan that reaches the executor late would leave the device idle, so the engine keeps
    two sent ahead of the one it waits for; on the CPU each would hold an arrival's prefill back by a forward."""
    executor = ShadowExecutor(16, 4, 50, (0,))
    executor.info = replace(executor.info, device=device)
    config = parse_config(["--overlap", "on", *(["--plans-ahead", flag] if flag else [])], env={})
    engine = connect_engine(executor, config)
    assert engine.plans_ahead == plans_ahead
    seqs = [engine.add_request([1, 2, i], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
        engine.launch_ahead()
    assert [len(seq.completion_token_ids) for seq in seqs] == [6, 6, 6]
    assert_all_blocks_free(engine.block_manager)


@pytest.mark.parametrize(("device", "shorter"), [("cpu", False), ("cuda:0", True), ("simulated", True)],
                         ids=["cpu", "cuda", "simulated"])
def test_the_gil_changes_hands_sooner_unless_the_executor_computes_on_the_scheduler_cpu(device, shorter):
    default = sys.getswitchinterval()
    try:
        set_gil_switch_interval(ExecutorInfo(device=device))
        expected = ACCELERATOR_GIL_SWITCH_INTERVAL_S if shorter else default
        assert sys.getswitchinterval() == pytest.approx(expected)
    finally:
        sys.setswitchinterval(default)


def test_the_scheduling_policy_reaches_the_engine():
    """--scheduling-policy (or its environment variable) picks the engine's scheduler; a bad name is refused."""
    assert parse_config([], env={}).scheduling_policy == ServiceConfig().scheduling_policy
    config = parse_config([], env={"NANOSERVE_SCHEDULING_POLICY": "mixed"})
    assert type(connect_engine(ShadowExecutor(16, 4, 50, (0,)), config).scheduler).__name__ == "MixedScheduler"
    nano = parse_config(["--scheduling-policy", "nano-vllm"], env={"NANOSERVE_SCHEDULING_POLICY": "mixed"})
    assert type(connect_engine(ShadowExecutor(16, 4, 50, (0,)), nano).scheduler).__name__ == "Scheduler"
    with pytest.raises(SystemExit):
        parse_config(["--scheduling-policy", "fcfs"], env={})
