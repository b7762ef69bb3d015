"""The in-process engine: scheduler + planner + any executor, one step at a time.

The gRPC scheduler service runs this same object in its engine loop; tests and
benchmarks drive it directly with a local executor.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from nanoserve.v1 import executor_pb2 as pb
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.executor import Executor
from scheduler_svc.planner import Planner
from scheduler_svc.sampling import InvalidRequest, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sequence import FinishReason, Sequence


class ExecutorRestarted(RuntimeError):
    """The executor answered with a new instance id: its KV cache is gone."""


class IncompatibleExecutor(RuntimeError):
    """The executor came back serving another model or vocabulary; requests cannot carry over."""


@dataclass(slots=True)
class TokenOutput:
    """One completion token a step produced for ``seq``."""

    seq: Sequence
    token_id: int
    logprobs: pb.TokenLogprobs | None


@dataclass
class StepTimings:
    """Wall seconds of each phase of the last step: what the split costs per step."""

    schedule_s: float = 0.0
    plan_s: float = 0.0
    execute_s: float = 0.0
    postprocess_s: float = 0.0


@dataclass
class Completion:
    """A finished request, as ``generate`` returns it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    num_cached_prompt_tokens: int


class Engine:
    """Drives one executor: validates requests, schedules, plans, postprocesses."""

    def __init__(self, executor: Executor, config: SchedulerConfig | None = None) -> None:
        self.executor = executor
        self.config = config or SchedulerConfig()
        self.info = executor.get_info()
        self.scheduler = Scheduler(
            self.config,
            BlockManager(self.info.num_blocks, self.info.block_size),
            set(self.info.eos_token_ids),
            self.info.max_model_len,
        )
        self.planner = Planner()
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.last_timings = StepTimings()

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if len(token_ids) >= self.info.max_model_len:
            raise InvalidRequest(
                "prompt",
                f"{len(token_ids)} tokens leave no room to generate: the model's maximum length "
                f"is {self.info.max_model_len} tokens",
            )
        vocab = self.info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")

    def add_request(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; raise InvalidRequest when it can never run."""
        self.validate_prompt(token_ids)
        params.validate()
        seq = Sequence(next(self._seq_ids), token_ids, params, self.info.block_size)
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise InvalidRequest("max_tokens", str(e)) from e
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` now; its blocks are free at once, the executor drops it next step."""
        self.scheduler.finish(seq, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> list[TokenOutput]:
        """Run one step; return the tokens it produced (finished sequences included)."""
        if self.scheduler.is_finished():
            self._flush_released()
            return []
        t0 = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule()
        t1 = time.perf_counter()
        plan, ordered = self.planner.build(seqs, is_prefill, self.scheduler.drain_released())
        t2 = time.perf_counter()
        result = self.executor.step(plan)
        t3 = time.perf_counter()
        if result.instance_id != self.info.instance_id:
            raise ExecutorRestarted(
                f"executor instance changed from {self.info.instance_id} to {result.instance_id}"
            )
        self.num_steps += 1
        advanced = self.scheduler.postprocess(ordered, list(result.token_ids), is_prefill)
        logprobs = result.logprobs
        if logprobs:
            # ``advanced`` keeps plan order, so each sequence's logprobs are found by its plan index.
            index = {id(seq): i for i, seq in enumerate(ordered)}
            outputs = [TokenOutput(seq, seq.token_ids[-1], logprobs[index[id(seq)]]) for seq in advanced]
        else:
            outputs = [TokenOutput(seq, seq.token_ids[-1], None) for seq in advanced]
        self.last_timings = StepTimings(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return outputs

    def recover(self) -> list[Sequence]:
        """Carry on with a (re)started executor: handshake and reset it, then recompute every request.

        Requests keep the tokens they generated, so greedy and seeded outputs are unchanged.
        Returns the sequences the new cache is too small for (finished with ABORT).
        """
        info = self.executor.get_info()
        old = self.info
        if (info.model_id, info.vocab_size, list(info.eos_token_ids)) != (
            old.model_id, old.vocab_size, list(old.eos_token_ids)
        ):
            raise IncompatibleExecutor(
                f"the executor now serves {info.model_id!r} (vocab {info.vocab_size}), "
                f"not {old.model_id!r} (vocab {old.vocab_size}); restart the scheduler to switch models"
            )
        self.executor.reset()
        self.info = info
        self.scheduler.max_model_len = info.max_model_len
        self.planner.forget_all()
        return self.scheduler.requeue_all(BlockManager(info.num_blocks, info.block_size))

    def _flush_released(self) -> None:
        """Tell an idle executor to drop requests that finished in the last step."""
        released = self.scheduler.drain_released()
        plan, _ = self.planner.build([], False, released)
        if plan.finished_request_ids:
            self.executor.step(plan)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run requests to completion; outputs in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.has_unfinished():
            self.step()
        self._flush_released()
        return [
            Completion(
                s.token_ids[: s.num_prompt_tokens],
                s.completion_token_ids,
                s.finish_reason,
                s.num_prefix_hit_tokens or 0,
            )
            for s in seqs
        ]
