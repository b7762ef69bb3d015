"""A minimal scheduler for executor-level speculative-decoding tests: it owns block tables, sends prefill,
decode and verification plans, and cuts a request's table after a verification as the contract says."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.executor import Executor
from common.step import CachedRequests, NewRequest, SamplingSettings, StepPlan, StepResult

GREEDY = SamplingSettings(temperature=0.0)


@dataclass
class Tracked:
    """The scheduler's view of one request."""

    token_ids: list[int]
    block_table: list[int]
    num_computed: int = 0
    completion: list[int] = field(default_factory=list)


class SpecDriver:
    """Runs requests to ``max_tokens`` on an executor, proposing with ``propose(request_id, tokens, k)`` (None
    entries: the executor's draft model proposes) and keeping every block table exactly as the executor must."""

    def __init__(self, executor: Executor) -> None:
        info = executor.get_info()
        self.executor, self.block_size = executor, info.block_size
        self.free = list(range(info.num_blocks))
        self.requests: dict[int, Tracked] = {}
        self.step_id = 0
        self.results: list[StepResult] = []

    def _grow(self, tracked: Tracked, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(tracked.block_table)
        new = [self.free.pop(0) for _ in range(max(0, needed))]
        tracked.block_table += new
        return new

    def step(self, plan: StepPlan) -> StepResult:
        self.step_id += 1
        plan.step_id = self.step_id
        result = self.executor.step(plan)
        self.results.append(result)
        return result

    def prefill(self, prompts: dict[int, list[int]], sampling: SamplingSettings = GREEDY) -> None:
        new = []
        for rid, prompt in prompts.items():
            tracked = self.requests[rid] = Tracked(list(prompt), [])
            self._grow(tracked, len(prompt))
            new.append(NewRequest(rid, list(prompt), sampling, list(tracked.block_table), 0, len(prompt)))
        result = self.step(StepPlan(is_prefill=True, new_requests=new))
        for rid, token in zip(prompts, result.token_ids, strict=True):
            tracked = self.requests[rid]
            tracked.num_computed = len(tracked.token_ids)
            tracked.token_ids.append(token)
            tracked.completion.append(token)

    def decode(self, drafts: dict[int, list[int] | int]) -> StepResult:
        """One step of every request named: a list of proposals, or a count the executor's draft model fills."""
        cached = CachedRequests()
        given: list[int] = []
        for rid, proposal in drafts.items():
            tracked = self.requests[rid]
            k = proposal if isinstance(proposal, int) else len(proposal)
            new = self._grow(tracked, tracked.num_computed + 1 + k)
            cached.request_ids.append(rid)
            cached.num_computed_tokens.append(tracked.num_computed)
            cached.num_scheduled_tokens.append(1 + k)
            cached.num_new_blocks.append(len(new))
            cached.new_block_ids += new
            cached.num_draft_tokens.append(k)
            if not isinstance(proposal, int):
                given += proposal
        cached.draft_token_ids = given
        result = self.step(StepPlan(cached_requests=cached))
        counts = result.num_sampled_tokens or [1] * len(drafts)
        at = 0
        for rid, n in zip(drafts, counts, strict=True):
            tracked = self.requests[rid]
            tokens = result.token_ids[at : at + n]
            at += n
            tracked.token_ids += tokens
            tracked.completion += tokens
            tracked.num_computed += n
            keep = -(-tracked.num_computed // self.block_size)
            self.free += tracked.block_table[keep:]
            del tracked.block_table[keep:]
        return result

    def generate(self, prompts: dict[int, list[int]], max_tokens: int,
                 propose: Callable[[int, list[int]], list[int] | int],
                 sampling: SamplingSettings = GREEDY) -> dict[int, list[int]]:
        """Each request's first ``max_tokens`` completion tokens (the last step may give a few more)."""
        self.prefill(prompts, sampling)
        while live := [rid for rid, t in self.requests.items() if len(t.completion) < max_tokens]:
            self.decode({rid: propose(rid, self.requests[rid].token_ids) for rid in live})
        return {rid: t.completion[:max_tokens] for rid, t in self.requests.items()}

    def finish(self) -> None:
        """Drop every request: the executor holds none after, and every block is free."""
        self.step(StepPlan(finished_request_ids=list(self.requests)))
        for tracked in self.requests.values():
            self.free += tracked.block_table
        self.requests.clear()
