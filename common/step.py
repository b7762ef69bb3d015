"""The step-plan contract as plain dataclasses: what the scheduler's engine and the executor's core exchange.

They mirror ``protos/nanoserve/v1/executor.proto`` field for field, with ``None`` where the proto's field is
``optional`` and unset. ``common.step_codec`` is the one translation to and from the messages, used at the gRPC
edge of each service; an executor in the scheduler's process gets these objects with no protobuf in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling import DEFAULTS, GREEDY_BELOW, GenerationDefaults


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """What the executor's sampler needs of one request; the defaults are ``common.sampling.DEFAULTS``.

    ``greedy``, ``plain_greedy`` (greedy without logprobs or logits processors, the sampler's fast path),
    ``has_logits_processors`` and ``penalized`` are checked for every row every step, so they are worked out
    once, when the request arrives.
    """

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    seed: int | None = DEFAULTS["seed"]
    num_logprobs: int | None = DEFAULTS["logprobs"]
    repetition_penalty: float = DEFAULTS["repetition_penalty"]
    presence_penalty: float = DEFAULTS["presence_penalty"]
    frequency_penalty: float = DEFAULTS["frequency_penalty"]
    # (token id, bias) pairs, ids ascending: a tuple keeps the settings immutable and hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = DEFAULTS["min_tokens"]
    # Only with min_tokens: the tokens masked until it is reached.
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = DEFAULTS["ignore_eos"]
    # An llguidance grammar (JSON form) the sampled tokens follow; the model runner masks the logits with it.
    grammar: str | None = None
    # With a grammar under a reasoning parser: it waits for the thinking's end, the completion's first token among
    # these ids (``</think>``), and follows the tokens after it. Empty: the grammar applies from the first token.
    grammar_after_token_ids: tuple[int, ...] = ()
    # Score the prompt's tokens with this many alternatives each (``prompt_logprobs``).
    num_prompt_logprobs: int | None = DEFAULTS["prompt_logprobs"]
    # Only these ids may be sampled (ascending, distinct); empty: any token.
    allowed_token_ids: tuple[int, ...] = ()
    # The bad words as token-id sequences (the scheduler tokenizes them, so the executor needs no tokenizer): the
    # last id of each is banned wherever the completion ends with the ones before it.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The thinking's budget (``executor_svc.sample.thinking_budget``): once this many tokens followed the last start
    # marker with no end marker after it, the end marker is forced. None: no budget; it needs both markers.
    thinking_token_budget: int | None = None
    thinking_start_token_id: int | None = None
    thinking_end_token_id: int | None = None
    # With num_logprobs: the alternatives are these ids' logprobs, in this order, not the most likely ones.
    logprob_token_ids: tuple[int, ...] = ()
    greedy: bool = field(init=False, repr=False, compare=False)
    plain_greedy: bool = field(init=False, repr=False, compare=False)
    penalized: bool = field(init=False, repr=False, compare=False)
    has_logits_processors: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        penalized = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        processors = (penalized or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.allowed_token_ids)
                      or bool(self.bad_words_token_ids) or self.thinking_token_budget is not None)
        object.__setattr__(self, "greedy", self.temperature < GREEDY_BELOW)
        object.__setattr__(self, "plain_greedy", self.greedy and self.num_logprobs is None and not processors)
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "has_logits_processors", processors)


@dataclass(slots=True)
class NewRequest:
    """A request the executor does not hold: sent whole."""

    request_id: int
    token_ids: list[int]
    sampling: SamplingSettings = SamplingSettings()
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    # token_ids[num_prompt_tokens:] is completion (a preempted or recovered request); None: all prompt.
    num_prompt_tokens: int | None = None
    # The LoRA adapter it runs through, an id from ``ExecutorInfo.lora_adapters``; 0: the base model.
    lora_id: int = 0


@dataclass(slots=True)
class CachedRequests:
    """Requests the executor holds, as columns: only what changed."""

    request_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    # Multi-step decode: tokens to decode per request; empty for one step each.
    num_decode_steps: list[int] = field(default_factory=list)
    # Speculative decoding: proposals each request verifies (empty: none), and their ids concatenated (empty: the
    # executor's draft model proposes them).
    num_draft_tokens: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """Defaults as the proto's: a plan that names nothing."""

    step_id: int = 0
    is_prefill: bool = False
    finished_request_ids: list[int] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: CachedRequests = field(default_factory=CachedRequests)
    # The multi-step plan this one counts on running whole (booked before its result came).
    after_whole_step_id: int | None = None


@dataclass(slots=True)
class TokenLogprobs:
    """A token's log-probability and the most likely tokens' at its position, most likely first."""

    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # The token's rank in its distribution, as vLLM counts it: the tokens at least as likely, itself included (ties
    # share the last of their ranks); None where not known.
    rank: int | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """A run of one request's prompt tokens scored: the first at ``first_position``, one entry per token."""

    request_id: int
    first_position: int
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class StepResult:
    """One plan's tokens in result order (new requests first, then cached), and what computing them cost; the
    executor's step code fills it pass by pass, and names the instance and the plan last."""

    token_ids: list[int] = field(default_factory=list)
    # Parallel to token_ids when any request asked (None, or an empty entry, for those that did not); else empty.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # The decode passes a multi-step plan ran when it was cut short (0: a plan dropped unrun); None: all of them.
    num_passes: int | None = None
    instance_id: str = ""
    step_id: int = 0
    # Tokens per scheduled request in token_ids, set only for a plan with drafts (accepted proposals, then one).
    num_sampled_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A LoRA adapter the executor holds: requests name it by ``name``, plans by ``lora_id`` (never reused by one
    executor instance, so it can key the prefix cache)."""

    lora_id: int
    name: str
    path: str = ""
    rank: int = 0


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The tokenizer's own special tokens as text (tokenizer_config.json), which chat templates render as transformers
    renders them; None where the tokenizer config gives none."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """The handshake: what the scheduler must know of the executor before its first plan (defaults: the proto's)."""

    instance_id: str = ""
    model_id: str = ""
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    block_size: int = 0
    num_blocks: int = 0
    bos_token_id: int | None = None
    tensor_parallel_size: int = 1
    # The tokenizer (tokenizer.json) and chat template, so the scheduler needs no model files; "" when absent.
    tokenizer_json: str = ""
    chat_template: str = ""
    attention_backend: str = ""
    # The adapters loaded at start; adapters load and unload at run time only where ``runtime_lora`` (and the
    # scheduler learns of them from those calls' answers).
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()
    max_lora_rank: int = 0
    runtime_lora: bool = False
    # The draft model's id (speculative proposals made by the executor); "" when it has none.
    draft_model_id: str = ""
    # The tokenizer's special tokens; None where the executor read no tokenizer_config.json (the chat template then
    # gets the tokens of bos_token_id and eos_token_ids[0]).
    special_tokens: SpecialTokens | None = None
    # The model's request defaults (generation_config.json); None: it gives none.
    generation_defaults: GenerationDefaults | None = None

    @property
    def on_cpu(self) -> bool:
        """The forward pass runs on the cores the scheduler shares (``device`` "cpu"), not on an accelerator."""
        return self.device.partition(":")[0] == "cpu"
