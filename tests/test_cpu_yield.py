"""With ``--yield-cpu on`` beside an executor on the CPU, the scheduler's threads and the executor's helper threads run
in SCHED_IDLE, so that none preempts the forward pass, and the executor's own computing thread keeps its priority; by
default every thread keeps it."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from common.cpu_yield import give_way, thread_ids, yield_cpu
from tests.service_fixtures import (
    HOST,
    api_process_pid,
    assert_idle,
    executor_argv,
    free_port,
    running_stack,
    token_request,
)
from tests.test_reliability_faults import SHADOW

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not thread_ids(), reason="needs Linux's SCHED_IDLE")


def policies(pid: int) -> dict[int, int]:
    """Each thread's scheduling policy; threads that ended while read are left out."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(tid)] = os.sched_getscheduler(int(tid))
        except ProcessLookupError:
            continue
    return found


def settled(pid: int, check, timeout_s: float = 10.0) -> dict[int, int]:
    """The policies once ``check`` holds for them (the services apply theirs just after they report SERVING)."""
    deadline = time.monotonic() + timeout_s
    while not check(found := policies(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


@pytest.mark.parametrize(("put", "policy"), [(yield_cpu, os.SCHED_IDLE), (give_way, os.SCHED_BATCH)],
                         ids=["yield_cpu-idle", "give_way-batch"])
def test_the_given_threads_and_no_other_change_class(put, policy: int):
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    try:
        assert put([helper.native_id]) == 1
        assert os.sched_getscheduler(helper.native_id) == policy
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
    finally:
        stop.set()
        helper.join()


def test_beside_an_accelerator_the_api_process_gives_way_and_the_scheduler_does_not(tmp_path: Path):
    port = free_port()
    simulated = [sys.executable, "-m", "executor_svc.fakes.simulated", "--host", HOST, "--port", str(port),
                 "--step-ms", "1"]
    with running_stack(simulated, tmp_path, executor_port=port) as stack:
        stack.stub.GenerateOnce(token_request([3, 4, 5], 8, ignore_eos=True), timeout=30)
        api = settled(api_process_pid(stack.scheduler.pid), lambda found: set(found.values()) == {os.SCHED_BATCH})
        scheduler = policies(stack.scheduler.pid)
        assert_idle(stack.stub)
    assert set(api.values()) == {os.SCHED_BATCH}, api
    assert set(scheduler.values()) == {os.SCHED_OTHER}, scheduler


def test_asked_to_yield_beside_a_cpu_executor_the_scheduler_and_the_executor_helpers_do(tmp_path: Path):
    port = free_port()
    executor_cmd = executor_argv("shadow", port, {**SHADOW, "yield_cpu": "on"})
    with running_stack(executor_cmd, tmp_path, executor_port=port, yield_cpu="on") as stack:
        stack.stub.GenerateOnce(token_request([3, 4, 5], 8, ignore_eos=True), timeout=30)
        scheduler = settled(stack.scheduler.pid, lambda found: set(found.values()) == {os.SCHED_IDLE})
        api = settled(api_process_pid(stack.scheduler.pid), lambda found: set(found.values()) == {os.SCHED_IDLE})
        executor = settled(stack.executor.pid, lambda found: os.SCHED_IDLE in found.values())
        assert_idle(stack.stub)
    assert set(scheduler.values()) == {os.SCHED_IDLE}, scheduler
    assert set(api.values()) == {os.SCHED_IDLE}, api
    assert executor.pop(stack.executor.pid) == os.SCHED_OTHER  # the thread that computes the steps
    assert sum(policy == os.SCHED_IDLE for policy in executor.values()) >= 3, executor  # gRPC's and the stream's


def test_by_default_every_thread_keeps_its_priority(tmp_path: Path):
    port = free_port()
    with running_stack(executor_argv("shadow", port, SHADOW), tmp_path, executor_port=port) as stack:
        stack.stub.GenerateOnce(token_request([3, 4, 5], 8, ignore_eos=True), timeout=30)
        time.sleep(0.5)  # past the moment they would have yielded
        scheduler, executor = policies(stack.scheduler.pid), policies(stack.executor.pid)
        api = policies(api_process_pid(stack.scheduler.pid))
        assert_idle(stack.stub)
    assert set(scheduler.values()) == set(executor.values()) == set(api.values()) == {os.SCHED_OTHER}, (
        scheduler, executor, api)
