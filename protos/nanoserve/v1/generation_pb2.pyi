from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: str | None = ..., content: str | None = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Iterable[ChatMessage | _Mapping] | None = ..., add_generation_prompt: bool | None = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Iterable[int] | None = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: int
    def __init__(self, temperature: float | None = ..., top_k: int | None = ..., top_p: float | None = ..., min_p: float | None = ..., seed: int | None = ..., logprobs: int | None = ...) -> None: ...

class StoppingOptions(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: int | None = ..., stop: _Iterable[str] | None = ..., stop_token_ids: _Iterable[int] | None = ..., ignore_eos: bool | None = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "tokens", "sampling", "stopping", "add_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatPrompt
    tokens: TokenPrompt
    sampling: SamplingOptions
    stopping: StoppingOptions
    add_special_tokens: bool
    def __init__(self, request_id: str | None = ..., text: str | None = ..., chat: ChatPrompt | _Mapping | None = ..., tokens: TokenPrompt | _Mapping | None = ..., sampling: SamplingOptions | _Mapping | None = ..., stopping: StoppingOptions | _Mapping | None = ..., add_special_tokens: bool | None = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: int | None = ..., logprob: float | None = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    def __init__(self, token_id: int | None = ..., logprob: float | None = ..., top: _Iterable[Logprob | _Mapping] | None = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: int | None = ..., completion_tokens: int | None = ..., cached_prompt_tokens: int | None = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, request_id: str | None = ..., text: str | None = ..., token_ids: _Iterable[int] | None = ..., logprobs: _Iterable[TokenLogprob | _Mapping] | None = ..., finish_reason: FinishReason | str | None = ..., usage: Usage | _Mapping | None = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "dtype", "device", "vocab_size", "max_model_len", "eos_token_ids", "has_chat_template", "has_tokenizer", "block_size", "num_blocks", "executor_instance_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    has_tokenizer: bool
    block_size: int
    num_blocks: int
    executor_instance_id: str
    def __init__(self, model_id: str | None = ..., architecture: str | None = ..., dtype: str | None = ..., device: str | None = ..., vocab_size: int | None = ..., max_model_len: int | None = ..., eos_token_ids: _Iterable[int] | None = ..., has_chat_template: bool | None = ..., has_tokenizer: bool | None = ..., block_size: int | None = ..., num_blocks: int | None = ..., executor_instance_id: str | None = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_blocks", "num_free_blocks", "num_cached_blocks", "num_steps", "num_finished_stop", "num_finished_length", "num_aborted", "num_prefix_cache_hit_tokens", "num_preemptions")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_steps: int
    num_finished_stop: int
    num_finished_length: int
    num_aborted: int
    num_prefix_cache_hit_tokens: int
    num_preemptions: int
    def __init__(self, num_waiting: int | None = ..., num_running: int | None = ..., num_blocks: int | None = ..., num_free_blocks: int | None = ..., num_cached_blocks: int | None = ..., num_steps: int | None = ..., num_finished_stop: int | None = ..., num_finished_length: int | None = ..., num_aborted: int | None = ..., num_prefix_cache_hit_tokens: int | None = ..., num_preemptions: int | None = ...) -> None: ...
