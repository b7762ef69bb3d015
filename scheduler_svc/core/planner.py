"""Turns a scheduled batch into a step plan that carries only what the executor lacks.

The plan is ``common.step``'s plain data; the executor client encodes it for the wire (``common.step_codec``),
an executor in this process takes it as it is.
"""

from __future__ import annotations

from common.step import CachedRequests, NewRequest, StepPlan
from scheduler_svc.core.sequence import Sequence


class Planner:
    """Remembers which requests the executor holds and how many of their blocks it has.

    A sequence the executor does not hold is sent whole; one it holds sends
    only its new block ids and this step's token count (and its proposals). Released sequences
    (finished, aborted, preempted) are listed once so the executor drops them.
    """

    def __init__(self) -> None:
        self.num_blocks_sent: dict[int, int] = {}
        self.step_id = 0
        # What the last plan told the executor to drop, with the blocks each held: ``unbook`` puts it back.
        self._last_dropped: dict[int, int] = {}

    def build(self, seqs: list[Sequence], is_prefill: bool, released: list[int]) -> tuple[StepPlan, list[Sequence]]:
        """Return the plan and the sequences in result order (new first, then cached)."""
        self.step_id += 1
        sent = self.num_blocks_sent
        self._last_dropped = dropped = {seq_id: sent.pop(seq_id) for seq_id in released if seq_id in sent}
        plan = StepPlan(self.step_id, is_prefill, list(dropped))
        new_seqs = [seq for seq in seqs if seq.seq_id not in sent]
        cached_seqs = [seq for seq in seqs if seq.seq_id in sent] if new_seqs else seqs
        for seq in new_seqs:
            # Copies: the plan may be applied on the executor's thread while this one appends tokens.
            plan.new_requests.append(NewRequest(seq.seq_id, list(seq.token_ids), seq.params.settings,
                                                list(seq.block_table), seq.num_cached_tokens,
                                                seq.num_scheduled_tokens, seq.num_prompt_tokens, seq.lora_id))
            sent[seq.seq_id] = len(seq.block_table)
        if cached_seqs:
            # Every column is one comprehension: this runs for every running sequence every decode step.
            num_new_blocks = [len(seq.block_table) - sent[seq.seq_id] for seq in cached_seqs]
            new_block_ids: list[int] = []
            if any(num_new_blocks):
                for seq, n_new in zip(cached_seqs, num_new_blocks, strict=True):
                    if n_new:
                        new_block_ids += seq.block_table[-n_new:]
                        sent[seq.seq_id] += n_new
            scheduled = [seq.num_scheduled_tokens for seq in cached_seqs]
            decode_steps: list[int] = []
            drafts = [seq.num_draft_tokens for seq in cached_seqs]
            draft_ids: list[int] = []
            if any(drafts):  # verification: the proposals follow each row's last token
                for seq in cached_seqs:
                    if seq.num_draft_tokens:
                        draft_ids += seq.draft_token_ids
            else:
                drafts = []
                if not is_prefill and max(scheduled) > 1:  # multi-step decode: one fed token, then the executor's own
                    decode_steps, scheduled = scheduled, [1] * len(scheduled)
            plan.cached_requests = CachedRequests([seq.seq_id for seq in cached_seqs],
                                                  [seq.num_cached_tokens for seq in cached_seqs], scheduled,
                                                  num_new_blocks, new_block_ids, decode_steps, drafts, draft_ids)
        return plan, new_seqs + cached_seqs

    def tables_cut(self, seqs: list[Sequence]) -> None:
        """A verification's result came: the executor cut the block tables of these rows to their computed tokens'
        blocks, as the scheduler did (``core.verification``)."""
        sent = self.num_blocks_sent
        for seq in seqs:
            if seq.seq_id in sent:
                sent[seq.seq_id] = min(sent[seq.seq_id], len(seq.block_table))

    def unbook(self, plan: StepPlan) -> list[int]:
        """The last plan built was dropped by the executor, none of it applied: what it sent counts as unsent.
        Returns the ids it told the executor to drop, for the next plan to tell again."""
        if plan.step_id != self.step_id:
            raise ValueError(f"only the last plan ({self.step_id}) can be given back, not {plan.step_id}")
        sent = self.num_blocks_sent
        for new in plan.new_requests:
            del sent[new.request_id]
        cached = plan.cached_requests
        for seq_id, num_new in zip(cached.request_ids, cached.num_new_blocks, strict=True):
            sent[seq_id] -= num_new
        sent.update(self._last_dropped)
        return plan.finished_request_ids

    def forget_all(self) -> None:
        """The executor lost every request (restart or reset)."""
        self.num_blocks_sent.clear()
