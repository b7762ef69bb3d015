from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_SIDE_LEFT: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_RIGHT: _ClassVar[TruncationSide]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_REPETITION: _ClassVar[FinishReason]
TRUNCATION_SIDE_LEFT: TruncationSide
TRUNCATION_SIDE_RIGHT: TruncationSide
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_REPETITION: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "template_kwargs", "continue_final_message")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    template_kwargs: _struct_pb2.Struct
    continue_final_message: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "n", "allowed_token_ids", "bad_words", "thinking_token_budget", "logprob_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    n: int
    allowed_token_ids: TokenIdList
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    thinking_token_budget: int
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., n: _Optional[int] = ..., allowed_token_ids: _Optional[_Union[TokenIdList, _Mapping]] = ..., bad_words: _Optional[_Iterable[str]] = ..., thinking_token_budget: _Optional[int] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIdList(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StoppingOptions(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "max_tokens_to_room", "cap_max_tokens_to_room", "repetition_detection")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_TO_ROOM_FIELD_NUMBER: _ClassVar[int]
    CAP_MAX_TOKENS_TO_ROOM_FIELD_NUMBER: _ClassVar[int]
    REPETITION_DETECTION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    max_tokens_to_room: bool
    cap_max_tokens_to_room: bool
    repetition_detection: RepetitionDetection
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., max_tokens_to_room: _Optional[bool] = ..., cap_max_tokens_to_room: _Optional[bool] = ..., repetition_detection: _Optional[_Union[RepetitionDetection, _Mapping]] = ...) -> None: ...

class RepetitionDetection(_message.Message):
    __slots__ = ("max_pattern_size", "min_pattern_size", "min_count")
    MAX_PATTERN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_PATTERN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    max_pattern_size: int
    min_pattern_size: int
    min_count: int
    def __init__(self, max_pattern_size: _Optional[int] = ..., min_pattern_size: _Optional[int] = ..., min_count: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "grammar", "json_object", "from_first_token")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    FROM_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: ChoiceList
    grammar: str
    json_object: bool
    from_first_token: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., from_first_token: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "tokens", "sampling", "stopping", "add_special_tokens", "skip_special_tokens", "truncate_prompt_tokens", "structured_output", "prompt_logprobs", "resume", "stream_interval", "lora", "priority", "return_prompt_token_ids", "cache_salt", "truncation_side")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatPrompt
    tokens: TokenPrompt
    sampling: SamplingOptions
    stopping: StoppingOptions
    add_special_tokens: bool
    skip_special_tokens: bool
    truncate_prompt_tokens: int
    structured_output: StructuredOutput
    prompt_logprobs: int
    resume: ResumeFrom
    stream_interval: int
    lora: str
    priority: int
    return_prompt_token_ids: bool
    cache_salt: str
    truncation_side: TruncationSide
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stopping: _Optional[_Union[StoppingOptions, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., resume: _Optional[_Union[ResumeFrom, _Mapping]] = ..., stream_interval: _Optional[int] = ..., lora: _Optional[str] = ..., priority: _Optional[int] = ..., return_prompt_token_ids: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ...) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("completion_token_ids",)
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, completion_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "index", "prompt_logprobs", "stop_string", "stop_token_id", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_string: str
    stop_token_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "dtype", "device", "vocab_size", "max_model_len", "eos_token_ids", "has_chat_template", "has_tokenizer", "block_size", "num_blocks", "executor_instance_id", "lora_adapters")
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
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
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
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterCard]
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., has_tokenizer: _Optional[bool] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., executor_instance_id: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterCard, _Mapping]]] = ...) -> None: ...

class LoraAdapterCard(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_blocks", "num_free_blocks", "num_cached_blocks", "num_steps", "num_finished_stop", "num_finished_length", "num_aborted", "num_prefix_cache_hit_tokens", "num_preemptions", "num_spec_drafts", "num_spec_draft_tokens", "num_spec_accepted_tokens", "spec_acceptance_rate", "num_generation_tokens", "num_finished_repetition")
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
    NUM_SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REPETITION_FIELD_NUMBER: _ClassVar[int]
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
    num_spec_drafts: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    spec_acceptance_rate: float
    num_generation_tokens: int
    num_finished_repetition: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_finished_stop: _Optional[int] = ..., num_finished_length: _Optional[int] = ..., num_aborted: _Optional[int] = ..., num_prefix_cache_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_spec_drafts: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., spec_acceptance_rate: _Optional[float] = ..., num_generation_tokens: _Optional[int] = ..., num_finished_repetition: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...
