"""A plan's forward passes, shared by every executor's step code.

One pass computes and samples every scheduled chunk. With multi-step decode a
plan asks for several per request: each pass is fed the tokens the one before
sampled, which the request table has recorded by then, so the table itself
only validates, applies and records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from executor_svc.requests import RequestTable, ScheduledChunk
from executor_svc.values import StepOutput, TokenLogprobs
from executor_svc.wire import step_result
from nanoserve.v1 import executor_pb2 as pb

# Computes and samples one token per chunk, in order (0 for a chunk that does not sample), from the input
# the executor packed for them ahead (None: packed now).
ForwardPass = Callable[[list[ScheduledChunk], object | None], StepOutput]


@dataclass
class PreparedStep:
    """A plan applied to the request table, with its input packed when it is a single pass."""

    step_id: int
    chunks: list[ScheduledChunk]
    inputs: object | None = None
    # Every chunk is one pass (no multi-step decode): known here, so ``execute`` need not walk the chunks again.
    single: bool = False


def run_forward_passes(
    table: RequestTable, chunks: list[ScheduledChunk], forward: ForwardPass, inputs: object | None = None,
    single: bool | None = None,
) -> StepOutput:
    """Run ``forward`` over the chunks once per decode step they ask for, recording its tokens in ``table``;
    ``single``: whether each asks for one (None: look).

    Tokens come back chunk after chunk in plan order, each chunk's in the order sampled; the passes' times add up.
    """
    if not chunks:
        return StepOutput()
    if single is None:
        single = all(chunk.num_steps == 1 for chunk in chunks)
    if single:
        output = forward(chunks, inputs)
        table.record_sampled(chunks, output.token_ids)
        return output
    return run_multi_step(table, chunks, forward)


def run_multi_step(table: RequestTable, chunks: list[ScheduledChunk], forward: ForwardPass) -> StepOutput:
    """``run_forward_passes`` when some chunk decodes more than one token; a chunk drops out after its last."""
    token_ids: list[list[int]] = [[] for _ in chunks]
    logprobs: list[list[TokenLogprobs | None]] = [[] for _ in chunks]
    total = StepOutput()
    asked = False
    active = list(range(len(chunks)))
    current = chunks
    for done in range(1, max(chunk.num_steps for chunk in chunks) + 1):
        output = forward(current, None)
        table.record_sampled(current, output.token_ids)
        total.forward_ms += output.forward_ms
        total.sample_ms += output.sample_ms
        asked = asked or bool(output.logprobs)
        step_logprobs = output.logprobs or [None] * len(current)
        for i, token_id, entry in zip(active, output.token_ids, step_logprobs, strict=True):
            token_ids[i].append(token_id)
            logprobs[i].append(entry)
        active = [i for i in active if chunks[i].num_steps > done]
        current = [ScheduledChunk(chunks[i].state, chunks[i].state.num_computed_tokens, 1) for i in active]
    total.token_ids = [token_id for tokens in token_ids for token_id in tokens]
    if asked:
        total.logprobs = [entry for entries in logprobs for entry in entries]
    return total


class TableExecutor(ABC):
    """The executor contract for an executor whose requests live in a ``RequestTable``: the model's, the
    shadow-KV test's and the simulated accelerator's differ only in ``forward`` (and ``pack``).

    A step is two halves, so that a caller can run them on two threads (where ``prepares_ahead``), as the
    servicer's StepStream does:
    ``prepare`` applies the plan and packs the input, and needs only the plans before it to be applied;
    ``execute`` runs and records it, after the step before it. While the device computes step N, step N+1
    is applied and packed; only the tokens N samples are put in at the start of N+1 (vLLM's async
    scheduling keeps them on the device; here they are a few ints).
    """

    info: pb.ExecutorInfo
    table: RequestTable
    # Whether callers should prepare a plan beside the step before. Not where that step is a forward on the CPU:
    # it keeps every core busy, and work beside it stalls the OpenMP team (W1 split: 0.87x -> 0.70x in-process).
    prepares_ahead: bool = True

    def get_info(self) -> pb.ExecutorInfo:
        return self.info

    def reset(self) -> int:
        return self.table.reset()

    def step(self, plan: pb.StepPlan) -> pb.StepResult:
        return self.execute(self.prepare(plan))

    def prepare(self, plan: pb.StepPlan) -> PreparedStep:
        chunks = self.table.apply(plan)
        single = bool(chunks) and all(chunk.num_steps == 1 for chunk in chunks)
        return PreparedStep(plan.step_id, chunks, self.pack(chunks) if single else None, single)

    def execute(self, prepared: PreparedStep) -> pb.StepResult:
        output = run_forward_passes(self.table, prepared.chunks, self.forward, prepared.inputs, prepared.single)
        return step_result(self.info.instance_id, prepared.step_id, output)

    def pack(self, chunks: list[ScheduledChunk]) -> object | None:
        """The step's input, built ahead of ``forward`` (None: ``forward`` reads the chunks when it runs)."""
        return None

    @abstractmethod
    def forward(self, chunks: list[ScheduledChunk], inputs: object | None = None) -> StepOutput:
        """Compute and sample one token per chunk, in order (0 for a chunk short of its end): a ``ForwardPass``."""
