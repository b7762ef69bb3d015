"""The executor's copy of each request, updated from plan deltas.

Shared by every executor (model, shadow-KV, echo, simulated): a plan is checked
whole before any of it is applied, so a rejected plan changes nothing. The
table validates and applies plans and records the tokens sampled; the forward
passes that sample them are the step code's (``executor_svc.core.step_pipeline``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from itertools import count, repeat
from typing import Any

from common.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from common.step import SamplingSettings, StepPlan

INVALID = "INVALID_ARGUMENT"
PRECONDITION = "FAILED_PRECONDITION"
# A request's planned counts while a verification step of it runs: how many proposals it accepts is not known yet.
UNKNOWN = -1
# Block-table versions: next() is atomic under the GIL, so states of executors on several threads never share one.
TABLE_VERSIONS = count()


class PlanError(ValueError):
    """A plan refused without applying any of it.

    ``code`` is the gRPC status name the servicer answers with: INVALID_ARGUMENT
    for a malformed plan (one naming a request twice, whatever the held state),
    FAILED_PRECONDITION for one that contradicts the held state (unknown
    request, wrong computed-token count).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RequestState:
    request_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    sampling: SamplingSettings
    # token_ids[num_prompt_tokens:] is the completion, which presence/frequency penalties and min_tokens count.
    num_prompt_tokens: int
    # A penalized request's token counts (logits_processors.TokenCounts), made at its first sample and grown as it
    # samples; dropped with the state, so a preempted request rebuilds them from the tokens it comes back with.
    token_counts: Any = None
    # Its allowed ids and bad words made ready for the sampler (``token_masks.TokenMasks``), at its first sample.
    token_masks: Any = None
    # Where its thinking started (``thinking_budget.ThinkingCount``), under a thinking budget, made at its first sample.
    thinking_count: Any = None
    # The grammar's llguidance matcher, built by the model runner at the first sampled token (or, where the grammar
    # waits for the thinking's end, at that end); it goes with the state.
    matcher: object | None = None
    # With a grammar that waits for the thinking's end: whether it still waits (None: the completion not read yet,
    # as for a request that comes back).
    grammar_waits: bool | None = None
    # What num_computed_tokens and len(token_ids) will be once every step applied so far has run: a plan is
    # checked against these, so the next plan can be applied while the step before it still runs.
    planned_computed: int = 0
    planned_len: int = 0
    # The adapter its tokens run through (``NewRequest.lora_id``; 0: the base model).
    lora_id: int = 0
    # Unique over every state and every change of its block table (``runtime.model_input.DecodeTables``).
    table_version: int = field(default_factory=lambda: next(TABLE_VERSIONS))


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens ``[start, start + num_tokens)`` of ``state`` computed this step; a decode chunk
    with ``num_steps`` > 1 then decodes that many tokens back to back (multi-step decode).

    A verification chunk (``num_drafts`` > 0) is the request's last token then ``num_drafts`` proposals, which are
    not among its tokens: ``drafts`` holds them, or is None until the executor's draft model proposes them."""

    state: RequestState
    start: int
    num_tokens: int
    num_steps: int = 1
    num_drafts: int = 0
    drafts: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last token, so its logits are sampled. Applied while the step before
        it runs, a decode chunk ends one past the last token known: the one that step is sampling."""
        return self.start + self.num_tokens >= len(self.state.token_ids)  # read per row each step: no self.end

    def input_tokens(self) -> list[int]:
        """The tokens this chunk computes: its request's, then its proposals."""
        if self.num_drafts:
            return [*self.state.token_ids[self.start : self.start + 1], *self.drafts]
        return self.state.token_ids[self.start : self.end]


class RequestTable:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, max_model_len: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        # Positions at or past it have no rotary embedding: a plan reaching there is refused, not half-run.
        self.max_model_len = max_model_len
        self.requests: dict[int, RequestState] = {}
        # The adapter ids a new request may name (beside 0, the base model): the model executor's loaded ones.
        self.lora_ids: Container[int] = frozenset()
        # Held while a plan is checked and applied, so that ``retire_lora`` sees every request it admits.
        self._lock = threading.Lock()
        # Whether this executor verifies speculative proposals, and proposes its own (a draft model).
        self.verifies_drafts = False
        self.has_draft_model = False

    def __len__(self) -> int:
        return len(self.requests)

    def retire_lora(self, lora_id: int) -> bool:
        """Stop accepting requests for adapter ``lora_id`` unless a held request runs through it (then False, and
        nothing changes): once True, no plan can bring it back, so its weights can go."""
        with self._lock:
            if any(state.lora_id == lora_id for state in self.requests.values()):
                return False
            self.lora_ids = frozenset(self.lora_ids) - {lora_id}
            return True

    def reset(self) -> int:
        n = len(self.requests)
        self.requests.clear()
        return n

    def apply(self, plan: StepPlan) -> list[ScheduledChunk]:
        """Validate ``plan`` against the state every step applied before leaves, then apply it; chunks in result
        order. The steps applied before need not have run yet (``planned_*``); their tokens are recorded by
        ``record_sampled`` when they have.
        """
        with self._lock:
            self._validate(plan)
            return self._apply(plan)

    def _apply(self, plan: StepPlan) -> list[ScheduledChunk]:
        for request_id in plan.finished_request_ids:
            del self.requests[request_id]
        chunks = []
        for new in plan.new_requests:
            state = RequestState(
                new.request_id,
                list(new.token_ids),
                list(new.block_table),
                new.num_computed_tokens,
                new.sampling,
                len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens,
                lora_id=new.lora_id,
            )
            end = new.num_computed_tokens + new.num_scheduled_tokens
            state.planned_computed, state.planned_len = end, len(state.token_ids) + (end == len(state.token_ids))
            self.requests[new.request_id] = state
            chunks.append(ScheduledChunk(state, new.num_computed_tokens, new.num_scheduled_tokens))
        # Runs for every held request every decode step: plain lists and local names.
        cached = plan.cached_requests
        new_block_ids = cached.new_block_ids
        requests = self.requests
        offset = 0
        columns = (cached.request_ids, cached.num_computed_tokens, cached.num_scheduled_tokens, cached.num_new_blocks)
        # Validated: with num_decode_steps there are no new requests and one entry per cached one.
        steps = cached.num_decode_steps or repeat(1)
        drafts = cached.num_draft_tokens or repeat(0)
        draft_ids = cached.draft_token_ids
        at = 0
        for request_id, computed, scheduled, n_new, num_steps, k in zip(*columns, steps, drafts, strict=False):
            state = requests[request_id]
            if n_new:
                state.block_table += new_block_ids[offset : offset + n_new]
                state.table_version = next(TABLE_VERSIONS)
                offset += n_new
            if k:  # a verification: how many tokens it gives is known once it ran (``record_sampled``)
                proposals = draft_ids[at : at + k] if draft_ids else None
                at += k
                chunks.append(ScheduledChunk(state, computed, scheduled, 1, k, proposals))
                state.planned_computed = state.planned_len = UNKNOWN
                continue
            chunks.append(ScheduledChunk(state, computed, scheduled, num_steps))
            end = computed + scheduled
            if end == state.planned_len:  # it samples, num_steps tokens
                state.planned_len += num_steps
                end += num_steps - 1
            state.planned_computed = end
        return chunks

    def record_sampled(self, chunks: list[ScheduledChunk], token_ids: list[int],
                       num_sampled: Sequence[int] = ()) -> None:
        """Advance each request past its chunk and append the token sampled for it; with ``num_sampled``
        (``StepResult.num_sampled_tokens``) each chunk has that many tokens in ``token_ids``."""
        if num_sampled:
            self._record_verified(chunks, token_ids, num_sampled)
            return
        for chunk, token_id in zip(chunks, token_ids, strict=True):
            state = chunk.state
            end = chunk.start + chunk.num_tokens
            if end == len(state.token_ids):
                state.token_ids.append(token_id)
            state.num_computed_tokens = end

    def _record_verified(self, chunks: list[ScheduledChunk], token_ids: list[int], num_sampled: Sequence[int]) -> None:
        """``record_sampled`` for a plan with proposals: a verification chunk's request gains its accepted proposals
        and one token of the executor's own, has computed up to that last one, and keeps only the blocks of its
        computed tokens (the scheduler frees the rest: ``StepResult.num_sampled_tokens``)."""
        at = 0
        for chunk, n in zip(chunks, num_sampled, strict=True):
            state = chunk.state
            if not chunk.num_drafts:
                self.record_sampled([chunk], token_ids[at : at + 1])
                at += n
                continue
            state.token_ids += token_ids[at : at + n]
            at += n
            state.num_computed_tokens = computed = chunk.start + n
            del state.block_table[-(-computed // self.block_size) :]
            state.table_version = next(TABLE_VERSIONS)
            state.planned_computed, state.planned_len = computed, len(state.token_ids)

    def _check_blocks(self, request_id: int, block_ids, needed_tokens: int, table_len: int) -> None:
        bad = next((b for b in block_ids if b >= self.num_blocks), None)
        if bad is not None:
            raise PlanError(INVALID, f"request {request_id}: block id {bad} is out of range [0, {self.num_blocks})")
        if table_len * self.block_size < needed_tokens:
            raise PlanError(
                INVALID,
                f"request {request_id}: {table_len} blocks hold {table_len * self.block_size} tokens, "
                f"{needed_tokens} needed",
            )

    def _check_sampling(self, request_id: int, params: SamplingSettings) -> None:
        """The ranges of ``common.sampling`` the logits processors rely on; an id outside the vocab would fail the
        step. Stop token ids outside the vocabulary are allowed: they can never be sampled, so nothing masks them.
        """
        ranges = (("temperature", 0 <= params.temperature < math.inf, "finite and >= 0"),
                  ("top_p", 0 < params.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= params.min_p <= 1, "in [0, 1]"),
                  ("repetition_penalty", 0 < params.repetition_penalty < math.inf, "> 0"))
        for name, ok, what in ranges:
            if not ok:
                raise PlanError(INVALID, f"request {request_id}: {name} must be {what}, got {getattr(params, name)}")
        for name in ("num_logprobs", "num_prompt_logprobs")[1 if params.logprob_token_ids else 0:]:  # named: any
            if (value := getattr(params, name)) is not None and value > MAX_LOGPROBS:
                raise PlanError(INVALID, f"request {request_id}: {name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(params, name) <= MAX_PENALTY:
                raise PlanError(INVALID, f"request {request_id}: {name} must be in [-{MAX_PENALTY:g}, "
                                         f"{MAX_PENALTY:g}], got {getattr(params, name)}")
        for token_id, bias in params.logit_bias:
            if not 0 <= token_id < self.vocab_size or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise PlanError(INVALID, f"request {request_id}: logit_bias {token_id}: {bias} needs a token id in "
                                         f"the vocabulary and a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("allowed_token_ids", "grammar_after_token_ids", "logprob_token_ids"):
            bad = next((t for t in getattr(params, name) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise PlanError(INVALID, f"request {request_id}: {name}: {bad} is outside the vocabulary")
        markers = (params.thinking_start_token_id, params.thinking_end_token_id)
        if params.thinking_token_budget is not None and not all(t is not None and 0 <= t < self.vocab_size
                                                                for t in markers):
            raise PlanError(INVALID, f"request {request_id}: a thinking budget needs both markers in the vocabulary, "
                                     f"got {markers}")
        for word in params.bad_words_token_ids:
            if not word or not all(0 <= t < self.vocab_size for t in word):
                raise PlanError(INVALID, f"request {request_id}: bad word {list(word)} needs one token id at least, "
                                         "each in the vocabulary")

    def _validate(self, plan: StepPlan) -> None:
        # Each id at most once among the finished, and once among the new and cached: applying drops each
        # finished id once. A finished request may come back as new (preempted), not as cached.
        dropped: set[int] = set()
        for rid in plan.finished_request_ids:
            if rid in dropped:
                raise PlanError(INVALID, f"request {rid} is finished twice in the plan")
            if rid not in self.requests:
                raise PlanError(PRECONDITION, f"finished request {rid} is unknown to this executor")
            dropped.add(rid)
        seen: set[int] = set()
        for new in plan.new_requests:
            rid = new.request_id
            if rid in seen:
                raise PlanError(INVALID, f"request {rid} is named twice among the plan's new requests")
            if rid in self.requests and rid not in dropped:
                raise PlanError(PRECONDITION, f"new request {rid} is already held by this executor")
            seen.add(rid)
            n = len(new.token_ids)
            if new.num_scheduled_tokens < 1 or new.num_computed_tokens + new.num_scheduled_tokens > n:
                raise PlanError(
                    INVALID,
                    f"request {rid}: computed {new.num_computed_tokens} + scheduled "
                    f"{new.num_scheduled_tokens} tokens must be within its {n} tokens, at least one scheduled",
                )
            bad = next((t for t in new.token_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise PlanError(INVALID, f"request {rid}: token id {bad} is outside the vocabulary")
            if n > self.max_model_len:
                raise PlanError(INVALID, f"request {rid}: {n} tokens pass the maximum length {self.max_model_len}")
            if new.num_prompt_tokens is not None and new.num_prompt_tokens > n:
                raise PlanError(INVALID, f"request {rid}: {new.num_prompt_tokens} prompt tokens of its {n} tokens")
            self._check_sampling(rid, new.sampling)
            if new.lora_id and new.lora_id not in self.lora_ids:
                raise PlanError(PRECONDITION, f"request {rid}: adapter id {new.lora_id} is not loaded")
            end = new.num_computed_tokens + new.num_scheduled_tokens
            self._check_blocks(rid, new.block_table, end, len(new.block_table))
        cached = plan.cached_requests
        columns = (cached.num_computed_tokens, cached.num_scheduled_tokens, cached.num_new_blocks)
        if any(len(c) != len(cached.request_ids) for c in columns) or sum(cached.num_new_blocks) != len(
            cached.new_block_ids
        ):
            raise PlanError(INVALID, "cached_requests columns have different lengths")
        if cached.num_draft_tokens:
            self._validate_drafts(plan)
        steps = cached.num_decode_steps
        if steps:
            self._validate_multi_step(plan, steps)
        new_block_ids = cached.new_block_ids
        requests, block_size, max_model_len = self.requests, self.block_size, self.max_model_len
        offset = 0
        n = len(cached.request_ids)
        rows = zip(cached.request_ids, *columns, steps or repeat(1, n), cached.num_draft_tokens or repeat(0, n),
                   strict=True)
        for rid, computed, scheduled, n_new, num_steps, k in rows:
            if rid in seen:
                raise PlanError(INVALID, f"request {rid} is named twice among the plan's new and cached requests")
            if rid in dropped:
                raise PlanError(INVALID, f"request {rid} is both finished and cached in the plan")
            state = requests.get(rid)
            if state is None:
                raise PlanError(PRECONDITION, f"cached request {rid} is unknown to this executor")
            seen.add(rid)
            if state.planned_computed == UNKNOWN:
                raise PlanError(PRECONDITION, f"request {rid}: the verification step before has not returned; plan it "
                                              "once its tokens are known")
            if k and (scheduled != 1 + k or computed + 1 != state.planned_len):
                raise PlanError(INVALID, f"request {rid}: verifying {k} proposals schedules its last token and them "
                                         f"({1 + k} tokens from {state.planned_len - 1}), not {scheduled} from "
                                         f"{computed}")
            if computed != state.planned_computed:
                raise PlanError(
                    PRECONDITION,
                    f"request {rid}: plan says {computed} tokens computed, executor has "
                    f"{state.planned_computed}",
                )
            if scheduled < 1 or computed + scheduled - k > state.planned_len:  # proposals come after its tokens
                raise PlanError(
                    INVALID, f"request {rid}: cannot schedule {scheduled} tokens after {computed} computed"
                )
            if num_steps > 1 and computed + scheduled != state.planned_len:
                raise PlanError(INVALID, f"request {rid}: a multi-step decode must start at its last token, "
                                         f"{state.planned_len - 1}; it starts at {computed}")
            end = computed + scheduled + num_steps - 1
            if end > max_model_len:
                raise PlanError(INVALID, f"request {rid}: computing up to position {end - 1} passes the maximum "
                                         f"length {max_model_len}")
            # A request that gains no block and whose table already covers the chunk has nothing to check.
            if n_new or len(state.block_table) * block_size < end:
                self._check_blocks(rid, new_block_ids[offset : offset + n_new], end, len(state.block_table) + n_new)
                offset += n_new

    def _validate_drafts(self, plan: StepPlan) -> None:
        """The proposal columns: one count per cached request, the ids all given (or none: the draft model's)."""
        cached = plan.cached_requests
        counts, ids = cached.num_draft_tokens, cached.draft_token_ids
        if not self.verifies_drafts:
            raise PlanError(PRECONDITION, "this executor does not verify speculative proposals")
        if cached.num_decode_steps:
            raise PlanError(INVALID, "a plan has num_decode_steps or num_draft_tokens, not both")
        if len(counts) != len(cached.request_ids):
            raise PlanError(INVALID, "num_draft_tokens needs one entry per cached request")
        if ids and len(ids) != sum(counts):
            raise PlanError(INVALID, f"draft_token_ids has {len(ids)} ids, num_draft_tokens sums to {sum(counts)}")
        if not ids and any(counts) and not self.has_draft_model:
            raise PlanError(PRECONDITION, "the plan leaves proposals to a draft model; this executor has none "
                                          "(ExecutorInfo.draft_model_id is empty)")
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise PlanError(INVALID, f"draft token id {bad} is outside the vocabulary")

    @staticmethod
    def _validate_multi_step(plan: StepPlan, steps: list[int]) -> None:
        cached = plan.cached_requests
        if plan.is_prefill or plan.new_requests:
            raise PlanError(INVALID, "num_decode_steps is for decode plans only (no prefill, no new requests)")
        if len(steps) != len(cached.request_ids):
            raise PlanError(INVALID, "num_decode_steps needs one entry per cached request")
        for rid, scheduled, num_steps in zip(cached.request_ids, cached.num_scheduled_tokens, steps, strict=True):
            if num_steps < 1 or scheduled != 1:
                raise PlanError(
                    INVALID, f"request {rid}: a multi-step decode needs 1 scheduled token and >= 1 steps, got "
                    f"{scheduled} and {num_steps}",
                )
