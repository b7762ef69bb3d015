from nanoserve.v1 import executor_pb2 as _executor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartRecordingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopRecordingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRecordingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RecordingStatus(_message.Message):
    __slots__ = ("active", "directory", "session", "num_records", "num_bytes", "error", "starting")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    active: bool
    directory: str
    session: str
    num_records: int
    num_bytes: int
    error: str
    starting: bool
    def __init__(self, active: _Optional[bool] = ..., directory: _Optional[str] = ..., session: _Optional[str] = ..., num_records: _Optional[int] = ..., num_bytes: _Optional[int] = ..., error: _Optional[str] = ..., starting: _Optional[bool] = ...) -> None: ...

class RecordingHeader(_message.Message):
    __slots__ = ("version", "session", "file_index", "started_at", "with_text")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    WITH_TEXT_FIELD_NUMBER: _ClassVar[int]
    version: int
    session: str
    file_index: int
    started_at: float
    with_text: bool
    def __init__(self, version: _Optional[int] = ..., session: _Optional[str] = ..., file_index: _Optional[int] = ..., started_at: _Optional[float] = ..., with_text: _Optional[bool] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("time_s", "handshake", "plan", "result", "failure", "reset", "end")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    handshake: _executor_pb2.ExecutorInfo
    plan: _executor_pb2.StepPlan
    result: _executor_pb2.StepResult
    failure: StepFailure
    reset: ExecutorReset
    end: RecordingEnd
    def __init__(self, time_s: _Optional[float] = ..., handshake: _Optional[_Union[_executor_pb2.ExecutorInfo, _Mapping]] = ..., plan: _Optional[_Union[_executor_pb2.StepPlan, _Mapping]] = ..., result: _Optional[_Union[_executor_pb2.StepResult, _Mapping]] = ..., failure: _Optional[_Union[StepFailure, _Mapping]] = ..., reset: _Optional[_Union[ExecutorReset, _Mapping]] = ..., end: _Optional[_Union[RecordingEnd, _Mapping]] = ...) -> None: ...

class StepFailure(_message.Message):
    __slots__ = ("step_id", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    error: str
    def __init__(self, step_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ExecutorReset(_message.Message):
    __slots__ = ("num_dropped_requests",)
    NUM_DROPPED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_dropped_requests: int
    def __init__(self, num_dropped_requests: _Optional[int] = ...) -> None: ...

class RecordingEnd(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...
