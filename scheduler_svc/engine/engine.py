"""The in-process engine: scheduler + planner + any executor, one step at a time.

The gRPC scheduler service runs this same object in its engine loop; tests and benchmarks drive it directly
with a local executor.

With ``overlap`` the engine keeps one step in flight: it schedules and sends step N+1 before it collects step
N, so the executor never waits for the scheduler. The executor feeds its own sampled tokens into the next
decode, and a sequence that turns out to have finished at step N just wastes its slot in step N+1.

A multi-step decode (a window) is pipelined the same way, with the next plan booked on its every step; when
an arrival cuts it short, that booking is given back (``engine.window``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cached_property

from common.executor import Executor
from common.step import LoraAdapterInfo, StepPlan, StepResult
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.mixed import POLICIES
from scheduler_svc.core.planner import Planner
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig, TokenOutput
from scheduler_svc.core.sequence import FinishReason, Sequence, keep_prompt_logprobs
from scheduler_svc.core.validation import ModelLimits, check_request
from scheduler_svc.engine.adapters import Adapters, loads_at_run_time
from scheduler_svc.engine.checks import (
    ExecutorRestarted,
    IncompatibleExecutor,
    StepMismatch,
    serving_config,
    serving_overlap,
    serving_plans_ahead,
)
from scheduler_svc.engine.kv_events import KvEventLog
from scheduler_svc.engine.launched import Launched, StepTimings, Submit, submitter
from scheduler_svc.engine.window import Window

# Told each collected step's computed tokens and the executor's forward seconds (the engine loop's metrics).
OnStep = Callable[[int, float], None]


def _unobserved(num_tokens: int, forward_s: float) -> None:
    """Nobody is listening: benchmarks and tests driving the engine directly."""


@dataclass
class FinishedRequest:
    """A finished request, as ``generate`` returns it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    num_cached_prompt_tokens: int


class Engine:
    """Drives one executor: validates requests, schedules, plans, postprocesses. Built bare (no overlap,
    ``SchedulerConfig()``) it is nano-vLLM's engine step for step; the scheduler service builds it with its serving
    flags (``api.grpc_service.connect_engine``), as bench.overlap's in-process peer does."""

    def __init__(
        self, executor: Executor, config: SchedulerConfig | None = None, overlap: bool | None = False,
        step_timeout_s: float | None = None, plans_ahead: int | None = 1,
    ) -> None:
        """``overlap``, ``plans_ahead`` None: as ``checks.serving_overlap`` and ``serving_plans_ahead`` decide."""
        self.executor = executor
        # Bounds the wait for a step in flight (a synchronous executor bounds its own calls).
        self.step_timeout_s = step_timeout_s
        # Runs the steps of an executor without a stream of its own (an in-process one), in order.
        self._worker: ThreadPoolExecutor | None = None
        self._in_flight: Launched | None = None
        # Steps launched by ``launch_ahead``, in order, after ``_in_flight``: the next ``step`` only collects.
        self._ahead: deque[Launched] = deque()
        self.info = executor.get_info()
        self.overlap = serving_overlap(overlap, self.info.on_cpu)
        self.plans_ahead = serving_plans_ahead(plans_ahead, self.info.on_cpu)
        self.config = serving_config(config or SchedulerConfig(), self.info)
        blocks = BlockManager(self.info.num_blocks, self.info.block_size)
        self.scheduler = POLICIES[self.config.policy](self.config, blocks, set(self.info.eos_token_ids),
                                                      self.info.max_model_len)
        self.planner = Planner()
        self._seq_ids = itertools.count()
        self.num_steps = 0
        # Recoveries onto a new executor instance.
        self.num_restarts = 0
        self.last_timings = StepTimings()
        self.on_step: OnStep = _unobserved
        self.kv_events = KvEventLog()  # the prefix cache's, collected by the engine loop after each iteration
        self.window = Window(executor)
        self.adapters = Adapters(self.info.lora_adapters, self.info.model_id, loads_at_run_time(self.info))

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits.of(self.info)

    def add_request(self, token_ids: list[int], params: SamplingParams, lora: str | None = None,
                    priority: int = 0) -> Sequence:
        """Check and queue a request (through adapter ``lora``; None: the base model); InvalidRequest if it cannot."""
        check_request(token_ids, params, self.limits)
        return self.enqueue(token_ids, params, lora=lora, priority=priority)

    def enqueue(self, token_ids: list[int], params: SamplingParams, resumed: list[int] | None = None,
                lora: str | int | None = None, speculate: bool = True, priority: int = 0,
                arrival: int | None = None, cache_salt: str = "") -> Sequence:
        """Queue a request already checked (``validation``) against this executor's limits; ``resumed`` completion
        tokens count as generated (a stream another scheduler started); ``lora``: an adapter's name, or the id a
        request's first choice took; ``speculate``: not for a choice of n > 1 (``core.speculation``); ``priority``:
        lower first under ``--request-order priority``, ties by ``arrival`` (its 1st choice's id; None: its own);
        ``cache_salt``: its prefix cache's ("": none). InvalidRequest: cache shrunk, adapter gone, priority in fcfs."""
        if priority and not self.scheduler.by_priority:
            raise InvalidRequest("priority", "priority scheduling is off: start the scheduler with --request-order "
                                 "priority, or leave priority at 0")
        tokens = [*token_ids, *(resumed or ())]
        lora_id = lora if isinstance(lora, int) else self.adapters.lora_id(lora)
        seq = Sequence(next(self._seq_ids), tokens, params, self.info.block_size, len(token_ids), lora_id, cache_salt)
        seq.speculate, seq.priority, seq.arrival = speculate, priority, seq.seq_id if arrival is None else arrival
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise InvalidRequest("max_tokens", str(e)) from e
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` now; its blocks are free at once, the executor drops it next step."""
        self.scheduler.finish(seq, FinishReason.ABORT)

    def stop_at(self, seq: Sequence, position: int) -> None:
        """End ``seq`` with STOP at its token ``position`` (a stop string ends there); later tokens are dropped."""
        del seq.token_ids[position + 1 :]
        self.scheduler.finish(seq, FinishReason.STOP)

    def cut_for_loop(self) -> None:
        """The loop has work to do before the next plan (any thread): a request is on its way in, or one was
        cancelled; the window in flight stops after its current step, so that work need not wait for the rest."""
        self.window.cut_for_loop()

    def loop_work_taken(self) -> None:
        """What ``cut_for_loop`` announced is in the scheduler (the loop thread)."""
        self.window.loop_work_taken()

    def cut_for_queued(self) -> None:
        """Requests were queued by the loop thread itself (a request's other choices, once its prompt is computed):
        the window in flight is cut as for an arrival."""
        self.window.cut()

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or bool(self._ahead) or not self.scheduler.is_finished()

    def nothing_to_schedule(self) -> bool:
        """No request waits or runs (a step may still be in flight, or drops wait to be sent)."""
        return self.scheduler.is_finished()

    def has_drops_to_send(self) -> bool:
        """Requests ended since the last plan, which the executor still holds: the next plan drops them."""
        return bool(self.scheduler.released_seq_ids)

    def step(self) -> list[TokenOutput]:
        """Run one step; return the tokens it produced (finished sequences included). With overlap, the step collected
        is the one the previous call launched, and the next one is launched before waiting for it."""
        if self.adapters.retiring:  # here, not after a step settled: a failed unload then loses no step's outputs
            self.adapters.retire(self.executor, self._live())
        if not self.overlap:
            if self._in_flight is not None:  # ``launch_ahead`` sent it once the step before was settled
                launched, self._in_flight = self._in_flight, None
                return self._collect(launched)
            launched = self._launch(self.executor.step)
            if launched is None:
                self._flush_released()
                return []
            return self._collect(launched)
        if self._ahead:
            current, self._in_flight = self._in_flight, self._ahead.popleft()
            return self._collect(current)
        if self._in_flight is not None and self._in_flight.dropped:
            self._collect_dropped(self._in_flight)
            self._in_flight = None
        if self._in_flight is None:
            self._in_flight = self._launch(self._submit)
            if self._in_flight is None:
                self._flush_released()
                return []
        current = self._in_flight
        if current.window:  # booked on its every step unless the next plan may be a prefill; a cut drops it
            ahead = self.window.may_book_ahead(self.scheduler)
            self._in_flight = self._launch(self._submit, current.plan.step_id) if ahead else None
            outputs = self._collect(current)
            if self._in_flight is None and not self.window.loop_work_pending:  # else the loop's work comes first
                self._in_flight = self._launch(self._submit)
            return outputs
        self._in_flight = self._launch(self._submit)
        return self._collect(current)

    def launch_ahead(self) -> bool:
        """Launch steps before the caller processes the tokens ``step`` returned, when they cannot change the next plans
        (``EngineLoop`` says when); whether any was. Without overlap the next step, computed while the outputs are
        processed and sent (W1's split); with overlap up to ``plans_ahead`` past the one in flight, after a plain step
        (a window books its own), sent while the outputs are (W5 ``api``); two keep the device busy past a late one."""
        if not self.overlap:
            if self._in_flight is not None:
                return False
            self._in_flight = self._launch(self._submit)
            return self._in_flight is not None
        before = len(self._ahead)
        while len(self._ahead) < self.plans_ahead:
            last = self._ahead[-1] if self._ahead else self._in_flight
            if last is None or last.window or last.dropped or (ahead := self._launch(self._submit)) is None:
                break
            self._ahead.append(ahead)
        return len(self._ahead) > before

    @cached_property
    def _submit(self) -> Submit:
        """``launched.submitter``: how plans go out without waiting for their results."""
        submit, self._worker = submitter(self.executor)
        return submit

    def _launch(self, run: Callable[[StepPlan], Future[StepResult] | StepResult],
                after_whole: int | None = None) -> Launched | None:
        """Schedule, plan and book a step, and hand its plan to ``run``; None when nothing can run. ``after_whole``:
        the window in flight it is booked on, every step of it counted."""
        if self.scheduler.is_finished():
            return None
        t0 = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule(after_whole is None)
        if not seqs:  # every running sequence awaits its final token from the step in flight
            return None
        if is_prefill:
            now = time.monotonic()
            for seq in seqs:
                if seq.scheduled_at is None:
                    seq.scheduled_at = now
        t1 = time.perf_counter()
        plan, ordered = self.planner.build(seqs, is_prefill, self.scheduler.drain_released())
        plan.after_whole_step_id = after_whole
        record = self.scheduler.advance(ordered, is_prefill)
        t2 = time.perf_counter()
        window = self.config.num_scheduler_steps > 1 and Window.is_window(is_prefill, record)
        if window:
            self.window.sending(plan.step_id)
        result = run(plan)
        if window:
            self.window.sent()
        return Launched(record, plan, window, result, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _result(self, launched: Launched) -> StepResult:
        """Wait for a launched step's result: from the executor instance and for the plan expected."""
        result = launched.result
        if isinstance(result, Future):
            result = result.result(timeout=self.step_timeout_s)
            if self._worker is not None:
                # Hand the GIL over before postprocessing: the in-process executor's thread that starts the next
                # step otherwise waits behind all of it, idle between two steps (W5 in-process). An executor with a
                # stream of its own has its next plan already: this thread would only wait for the GIL (W5 ``api``).
                time.sleep(0)
        if result.instance_id != self.info.instance_id:
            raise ExecutorRestarted(
                f"executor instance changed from {self.info.instance_id} to {result.instance_id}"
            )
        step_id = launched.plan.step_id
        if result.step_id != step_id:
            raise StepMismatch(f"the executor answered step {result.step_id} where step {step_id} was due")
        if launched.window:
            self.window.collected(step_id)
        return result

    def _collect_dropped(self, launched: Launched) -> None:
        """Take the answer to a plan the executor was to drop (its window was cut); its booking is given back."""
        result = self._result(launched)
        if result.num_passes != 0:
            raise StepMismatch(f"the executor ran step {result.step_id}, booked on the whole of step "
                               f"{launched.plan.after_whole_step_id}, which it cut")

    def _collect(self, launched: Launched) -> list[TokenOutput]:
        """Wait for a launched step and settle its tokens."""
        t0 = time.perf_counter()
        result = self._result(launched)
        t1 = time.perf_counter()
        self.num_steps += 1
        if result.prompt_logprobs:
            keep_prompt_logprobs(launched.record.seqs, result.prompt_logprobs)
        num_passes = result.num_passes
        ahead = self._in_flight
        if num_passes is not None and ahead is not None and ahead.plan.after_whole_step_id == launched.plan.step_id:
            self._unbook(ahead)
        record = launched.record
        outputs = self.scheduler.settle(record, result.token_ids, result.logprobs, num_passes,
                                        result.num_sampled_tokens)
        if record.drafts is not None:
            self.planner.tables_cut([seq for seq, drafts in zip(record.seqs, record.drafts, strict=True) if drafts])
        counts = launched.record.counts  # a cut window computed at most num_passes tokens of each sequence
        self.on_step(sum(counts) if num_passes is None else sum(min(c, num_passes) for c in counts),
                     result.forward_ms / 1e3)
        self.last_timings = StepTimings(
            launched.schedule_s, launched.plan_s, launched.send_s + t1 - t0, time.perf_counter() - t1
        )
        return outputs

    def _unbook(self, ahead: Launched) -> None:
        """The window ``ahead`` was booked on was cut: the executor drops it, so its booking is given back."""
        ahead.dropped = True
        Window.give_back(self.scheduler, self.planner, ahead.record, ahead.plan)

    def probe(self) -> bool:
        """Whether the executor still answers as the same instance (it raises when it does not answer)."""
        return self.executor.get_info().instance_id == self.info.instance_id

    def recover(self) -> tuple[list[Sequence], list[Sequence]]:
        """Carry on with a (re)started executor: handshake and reset it, then recompute every request.

        Requests keep the tokens they generated, so greedy and seeded outputs are unchanged. Returns the sequences
        whose LoRA adapter it no longer holds, then those its cache is too small for (both finished with ABORT).
        """
        info = self.executor.get_info()
        old = self.info
        if (info.model_id, info.vocab_size, info.eos_token_ids) != (old.model_id, old.vocab_size, old.eos_token_ids):
            raise IncompatibleExecutor(
                f"the executor now serves {info.model_id!r} (vocab {info.vocab_size}), "
                f"not {old.model_id!r} (vocab {old.vocab_size}); restart the scheduler to switch models"
            )
        try:
            serving_config(self.config, info)
        except ValueError as e:
            raise IncompatibleExecutor(str(e)) from e
        self._abandon_in_flight()
        self.executor.reset()
        if info.instance_id != old.instance_id:
            self.num_restarts += 1
        self.info = info
        self.scheduler.max_model_len = info.max_model_len
        self.planner.forget_all()
        lost = self.adapters.renumber(self.executor, self._live(), info)
        for seq in lost:  # its adapter is gone with the old executor
            self.abort(seq)
        return lost, self.scheduler.requeue_all(BlockManager(info.num_blocks, info.block_size))

    def load_lora(self, name: str, path: str, inplace: bool = False) -> LoraAdapterInfo:
        """``Adapters.load``; to replace one ``inplace``, an idle executor first drops the ended requests it served."""
        if inplace and name in self.adapters:
            self.retire_adapters()
        return self.adapters.load(self.executor, name, path, self._live(), inplace)

    def unload_lora(self, name: str) -> LoraAdapterInfo:
        """``Adapters.unload``: refused to new requests now, dropped once the requests through it end (``retire``)."""
        adapter = self.adapters.unload(name)
        self.retire_adapters()
        return adapter

    def retire_adapters(self) -> None:
        """``Adapters.retire``, once an idle executor has dropped the requests that ended (busy, after a later step)."""
        if self._in_flight is None and not self._ahead:
            self._flush_released()
        else:
            self.adapters.retire(self.executor, self._live())

    def _live(self) -> list[Sequence]:
        return [*self.scheduler.running, *self.scheduler.waiting]

    def _abandon_in_flight(self) -> None:
        """Forget the step in flight before a reset. An in-process executor may still run it (or a window being
        collected) on the worker thread, unsafe to reset meanwhile: the worker's queue is let end. An executor with its
        own stream is not waited for: its reset cancels the stream, and a hung step would cost a second step timeout."""
        self._in_flight = None
        self._ahead.clear()
        if self._worker is not None:
            wait([self._worker.submit(lambda: None)], timeout=self.step_timeout_s)

    def _flush_released(self) -> None:
        """Tell an idle executor to drop requests that finished in the last step, then retire adapters they kept."""
        released = self.scheduler.drain_released()
        plan, _ = self.planner.build([], False, released)
        if plan.finished_request_ids:
            self.executor.step(plan)
        if self.adapters.retiring:
            self.adapters.retire(self.executor, self._live())

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 loras: list[str | None] | None = None) -> list[FinishedRequest]:
        """Run requests to completion (through the LoRA adapters ``loras`` names); outputs in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        loras = loras or [None] * len(prompts)
        seqs = [self.add_request(p, sp, lora) for p, sp, lora in zip(prompts, params, loras, strict=True)]
        while self.has_unfinished():
            self.step()
        self._flush_released()
        return [FinishedRequest(s.token_ids[: s.num_prompt_tokens], s.completion_token_ids, s.finish_reason,
                           s.num_prefix_hit_tokens or 0) for s in seqs]
