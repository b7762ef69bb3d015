"""Turns a scheduled batch into a StepPlan that carries only what the executor lacks."""

from __future__ import annotations

from nanoserve.v1 import executor_pb2 as pb
from scheduler_svc.sequence import Sequence


def sampling_to_proto(seq: Sequence) -> pb.SamplingParams:
    p = seq.params
    msg = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.num_logprobs = p.logprobs
    return msg


class Planner:
    """Remembers which requests the executor holds and how many of their blocks it has.

    A sequence the executor does not hold is sent whole; one it holds sends
    only its new block ids and this step's token count. Released sequences
    (finished, aborted, preempted) are listed once so the executor drops them.
    """

    def __init__(self) -> None:
        self.num_blocks_sent: dict[int, int] = {}
        self.step_id = 0

    def build(self, seqs: list[Sequence], is_prefill: bool, released: list[int]) -> tuple[pb.StepPlan, list[Sequence]]:
        """Return the plan and the sequences in result order (new first, then cached)."""
        self.step_id += 1
        sent = self.num_blocks_sent
        finished = [seq_id for seq_id in released if sent.pop(seq_id, None) is not None]
        plan = pb.StepPlan(step_id=self.step_id, is_prefill=is_prefill, finished_request_ids=finished)
        new_seqs = [seq for seq in seqs if seq.seq_id not in sent]
        cached_seqs = [seq for seq in seqs if seq.seq_id in sent] if new_seqs else seqs
        for seq in new_seqs:
            plan.new_requests.add(
                request_id=seq.seq_id,
                token_ids=seq.token_ids,
                sampling=sampling_to_proto(seq),
                block_table=seq.block_table,
                num_computed_tokens=seq.num_cached_tokens,
                num_scheduled_tokens=seq.num_scheduled_tokens,
            )
            sent[seq.seq_id] = len(seq.block_table)
        if cached_seqs:
            # Every column is built by a comprehension and sent with one extend: this runs for
            # every running sequence every decode step.
            num_new_blocks = [len(seq.block_table) - sent[seq.seq_id] for seq in cached_seqs]
            new_block_ids: list[int] = []
            if any(num_new_blocks):
                for seq, n_new in zip(cached_seqs, num_new_blocks, strict=True):
                    if n_new:
                        new_block_ids += seq.block_table[-n_new:]
                        sent[seq.seq_id] += n_new
            cached = plan.cached_requests
            cached.request_ids.extend([seq.seq_id for seq in cached_seqs])
            cached.num_computed_tokens.extend([seq.num_cached_tokens for seq in cached_seqs])
            scheduled = [seq.num_scheduled_tokens for seq in cached_seqs]
            if not is_prefill and max(scheduled) > 1:  # multi-step decode: one fed token, then the executor's own
                cached.num_decode_steps.extend(scheduled)
                scheduled = [1] * len(scheduled)
            cached.num_scheduled_tokens.extend(scheduled)
            cached.num_new_blocks.extend(num_new_blocks)
            cached.new_block_ids.extend(new_block_ids)
        return plan, new_seqs + cached_seqs

    def forget_all(self) -> None:
        """The executor lost every request (restart or reset)."""
        self.num_blocks_sent.clear()
