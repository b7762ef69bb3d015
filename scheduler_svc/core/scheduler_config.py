"""The scheduler core's configuration: per-step budgets, the policy, and speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

# --scheduling-policy's names; ``core.mixed.POLICIES`` maps each to its scheduler.
POLICY_NAMES = ("nano-vllm", "mixed")
# --request-order's names (``core.request_order``): arrival order, or requests' priority then arrival.
REQUEST_ORDERS = ("fcfs", "priority")
# --speculative's names: "ngram" proposes from the sequence's own tokens here, in the scheduler (``core.ngram``);
# "draft" lets the executor's draft model propose (its handshake names one: ``ExecutorInfo.draft_model_id``).
SPECULATIVE_METHODS = ("ngram", "draft")
# vLLM's n-gram window when neither end is given (one given: both are it).
DEFAULT_NGRAM_SIZE = 5
# Proposals per sequence per step when not given (vLLM has no default for n-gram proposals).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass
class SchedulerConfig:
    """Per-step budgets (vLLM's names) and the policy. The defaults are nano-vLLM's exact semantics (one decode step
    per plan, its policy, no speculation), which the seed tests and the differential against it rely on; the
    service's serving defaults (``scheduler_svc.config.ServiceConfig``: 8 steps per plan, overlap) are set by
    ``connect_engine``."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Decode tokens per sequence per plan (vLLM's multi-step scheduling): the executor feeds each
    # sampled token into the next forward pass itself, so the scheduling, the RPC and the plan are
    # paid once per this many decode steps. Stops (EOS, stop strings) are seen after the whole plan.
    num_scheduler_steps: int = 1
    # "nano-vllm": prefill first, never mixed with decode (the seed's); "mixed": decodes first, prefill chunks fill
    # the rest of the budget in the same step (``core.mixed``).
    policy: str = "nano-vllm"
    # The most distinct LoRA adapters in one step (the base model not counted); None: no bound.
    max_loras: int | None = None
    # Speculative decoding (``core.speculation``): None (off), or one of SPECULATIVE_METHODS.
    speculative: str | None = None
    # The most tokens proposed per sequence per step (each verified in the same forward pass as its last token);
    # None: DEFAULT_NUM_SPECULATIVE_TOKENS with speculation.
    num_speculative_tokens: int | None = None
    # The n-gram proposer's window: the longest suffix it matches first, down to the shortest (vLLM's
    # prompt_lookup_max / prompt_lookup_min; None: as vLLM, the other end, or DEFAULT_NGRAM_SIZE for both).
    ngram_min: int | None = None
    ngram_max: int | None = None
    # No proposals while more sequences than this run (vLLM's disable_by_batch_size): a large batch is bound by
    # compute, where every proposed token costs as much as a decoded one. None: never off (the engine sets a CPU
    # executor's default, ``engine.checks.CPU_SPECULATION_BATCH_LIMIT``).
    speculative_disable_by_batch_size: int | None = None
    # The order requests are admitted and preempted in: "fcfs" (arrival, the seed's) or "priority"
    # (``core.request_order``).
    request_order: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        if self.request_order not in REQUEST_ORDERS:
            raise ValueError(f"request_order must be one of {', '.join(REQUEST_ORDERS)}, got {self.request_order!r}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        self._check_speculation()

    def _check_speculation(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        if self.speculative is None:
            given = [name for name in ("num_speculative_tokens", "speculative_disable_by_batch_size", "ngram_min",
                                       "ngram_max") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with speculative decoding, which is off: set "
                                 f"speculative too")
            return
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.speculative != "ngram" and (self.ngram_min is not None or self.ngram_max is not None):
            raise ValueError("ngram_min and ngram_max set the n-gram proposer's window: they need speculative ngram")
        if self.ngram_min is None:
            self.ngram_min = DEFAULT_NGRAM_SIZE if self.ngram_max is None else self.ngram_max
        if self.ngram_max is None:
            self.ngram_max = self.ngram_min
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1, got "
                             f"{self.speculative_disable_by_batch_size}")
