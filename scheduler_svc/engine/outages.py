"""The engine loop's side of an executor outage: the idle probe and each attempt to carry on (``Supervisor`` keeps
the state and the timing; this does the calls and answers the requests)."""

from __future__ import annotations

import logging
import time

from scheduler_svc.core.errors import CacheTooSmall, ExecutorUnavailable, InvalidRequest
from scheduler_svc.engine.checks import IncompatibleExecutor
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import describe_failure
from scheduler_svc.engine.live_requests import LiveRequests
from scheduler_svc.engine.supervision import Supervisor

log = logging.getLogger("nanoserve.scheduler")


def probe(engine: Engine, supervisor: Supervisor) -> None:
    """Idle: is the executor still there, and still the same instance?"""
    try:
        if not engine.probe():
            log.warning("executor restarted while idle")
            supervisor.go_down(time.monotonic())
    except Exception as e:  # gone or hung: as if a step had failed
        log.warning("executor unreachable while idle (%s)", describe_failure(e))
        supervisor.go_down(time.monotonic())

def recover(engine: Engine, requests: LiveRequests, supervisor: Supervisor) -> None:
    """One attempt to carry on with the executor: handshake, reset, requeue every request for recompute."""
    try:
        dropped = engine.recover()
    except IncompatibleExecutor as e:
        reason = f"{e}; requests cannot carry over"
        if supervisor.recovered_incompatible(time.monotonic(), reason):
            log.error("%s; requests fail with UNAVAILABLE until the right executor is back", e)
        requests.end_all(engine, ExecutorUnavailable(reason))
        return
    except Exception as e:  # the executor is still down, or hung: retry later
        delay = supervisor.recovery_failed(time.monotonic())
        log.warning("executor not back (%s); retrying in %.1fs", describe_failure(e), delay)
        return
    supervisor.recovered(time.monotonic())
    adapter_gone, too_large = dropped
    failures = (
        (adapter_gone, InvalidRequest("lora", "the LoRA adapter this request runs through is gone with the executor's "
                                              "restart; load it again and retry")),
        (too_large, CacheTooSmall(f"the restarted executor's KV cache ({engine.info.num_blocks} blocks) is too small "
                                  "for this request; retry with a shorter prompt or max_tokens")),
    )
    for seqs, error in failures:
        for handle in {requests.handle_of(seq): None for seq in seqs}:
            requests.fail(engine, handle, error)
    log.info("executor instance %s is back: %d requests resume by recompute, %d too large for it, %d lost their "
             "LoRA adapter", engine.info.instance_id, len(requests), len(too_large), len(adapter_gone))
