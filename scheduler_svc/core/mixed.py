"""The mixed scheduling policy: running decodes first, then prefill chunks fill the rest of the token budget in
the same step (as vLLM v1 and Sarathi-Serve schedule).

Under nano-vLLM's policy every arriving prompt stops every running decode for a whole prefill step; here a prompt
joins the decodes' step, and the two share one forward pass (one read of the weights). Decodes go first, so a long
prompt cannot starve them; the prompt at the head of ``waiting`` takes the budget left (chunked when it does not
fit, the step's one chunked prefill; the decodes' proposals, ``core.speculation``, leave it at least half of
what the decodes leave), so decodes delay a prompt only while ``max_num_seqs`` are running. A step
with a prefill chunk is a prefill step to the executor, which runs its decode rows through decode attention and its
chunks through prefill attention in one forward pass (``executor_svc/attention/base.py``); a step of decodes alone
is a decode step, and only such a step decodes more than one token per sequence (multi-step), so a
waiting prompt never waits for a whole window; rows verifying proposals (``core.speculation``) are single steps, and
prefill chunks sit beside them. Budgets, preemption by recompute and block accounting are the
seed's.
"""

from __future__ import annotations

from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_config import POLICY_NAMES
from scheduler_svc.core.sequence import Sequence


class MixedScheduler(Scheduler):
    """``Scheduler`` with decodes and prefill chunks in one step."""

    def schedule(self, propose: bool = True) -> tuple[list[Sequence], bool]:
        num_steps = 1 if self.waiting else self.num_scheduler_steps
        # While a prompt waits, proposals leave it half the budget the decodes leave, so that they never starve it.
        reserved = 0
        if self.speculator is not None and self.waiting:
            head, spare = self.waiting[0], self.max_num_batched_tokens - min(len(self.running), self.max_num_seqs)
            reserved = min(len(head.token_ids) - head.num_cached_tokens, (spare + 1) // 2)
        scheduled = self._schedule_decodes(num_steps, self.max_num_seqs, prefill_may_follow=True, propose=propose,
                                           proposal_budget=self.max_num_batched_tokens - reserved)
        num_decodes = len(scheduled)
        decode_tokens = sum(seq.num_scheduled_tokens for seq in scheduled)
        # A multi-step decode is a step of its own: it preempted what now waits (nothing waited when it began).
        # Verification rows (1 + k tokens each) are single steps: prefill chunks join them in the budget left.
        if decode_tokens == num_decodes + sum(seq.num_draft_tokens for seq in scheduled):
            self._schedule_prefills(scheduled, self.max_num_batched_tokens - decode_tokens, self.max_num_seqs)
        # Settled in plan order: nano-vLLM's prefill order is not this policy's to keep.
        self._prefill_head = None
        return scheduled, len(scheduled) > num_decodes

    def preempt(self, seq: Sequence) -> None:
        """Preempt ``seq`` behind a prompt part-way through its chunks. Under this policy decodes run while a prompt
        is chunked, and that prompt holds the blocks of its whole prompt: queued ahead of it, a preempted sequence
        could wait for those blocks while the prompt waits for its turn, and neither would ever run."""
        super().preempt(seq)
        waiting = self.waiting
        if len(waiting) > 1 and waiting[1].block_table:
            waiting[0], waiting[1] = waiting[1], waiting[0]


# --scheduling-policy: the scheduler of each.
POLICIES: dict[str, type[Scheduler]] = dict(zip(POLICY_NAMES, (Scheduler, MixedScheduler), strict=True))
