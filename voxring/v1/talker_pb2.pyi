from voxring.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("consumer_id", "consumer_instance_token")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    consumer_instance_token: int
    def __init__(self, consumer_id: _Optional[str] = ..., consumer_instance_token: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("ring_name", "wakeup_semaphore", "capacity_bytes", "generation", "talker_instance_token", "liveness_timeout_s", "transport", "address")
    RING_NAME_FIELD_NUMBER: _ClassVar[int]
    WAKEUP_SEMAPHORE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TALKER_INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ring_name: str
    wakeup_semaphore: str
    capacity_bytes: int
    generation: int
    talker_instance_token: int
    liveness_timeout_s: float
    transport: str
    address: str
    def __init__(self, ring_name: _Optional[str] = ..., wakeup_semaphore: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., generation: _Optional[int] = ..., talker_instance_token: _Optional[int] = ..., liveness_timeout_s: _Optional[float] = ..., transport: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Speaker(_message.Message):
    __slots__ = ("name", "speaker_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    speaker_id: int
    def __init__(self, name: _Optional[str] = ..., speaker_id: _Optional[int] = ...) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "tokenizer_json", "prompt_format", "speakers", "max_len", "num_codebooks", "codebook_size", "frame_rate", "sample_rate", "family")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    tokenizer_json: bytes
    prompt_format: str
    speakers: _containers.RepeatedCompositeFieldContainer[Speaker]
    max_len: int
    num_codebooks: int
    codebook_size: int
    frame_rate: float
    sample_rate: int
    family: str
    def __init__(self, model_name: _Optional[str] = ..., tokenizer_json: _Optional[bytes] = ..., prompt_format: _Optional[str] = ..., speakers: _Optional[_Iterable[_Union[Speaker, _Mapping]]] = ..., max_len: _Optional[int] = ..., num_codebooks: _Optional[int] = ..., codebook_size: _Optional[int] = ..., frame_rate: _Optional[float] = ..., sample_rate: _Optional[int] = ..., family: _Optional[str] = ...) -> None: ...

class PromptSegment(_message.Message):
    __slots__ = ("text_token_ids", "frames")
    TEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    text_token_ids: _containers.RepeatedScalarFieldContainer[int]
    frames: _common_pb2.Frames
    def __init__(self, text_token_ids: _Optional[_Iterable[int]] = ..., frames: _Optional[_Union[_common_pb2.Frames, _Mapping]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "handle", "consumer_id", "segments", "sampling", "min_frames", "max_frames", "timeout_s", "first_audio_budget_s", "session")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_AUDIO_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    handle: int
    consumer_id: str
    segments: _containers.RepeatedCompositeFieldContainer[PromptSegment]
    sampling: _common_pb2.SamplingParams
    min_frames: int
    max_frames: int
    timeout_s: float
    first_audio_budget_s: float
    session: bool
    def __init__(self, request_id: _Optional[str] = ..., handle: _Optional[int] = ..., consumer_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[PromptSegment, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_frames: _Optional[int] = ..., max_frames: _Optional[int] = ..., timeout_s: _Optional[float] = ..., first_audio_budget_s: _Optional[float] = ..., session: _Optional[bool] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("consumer_id", "handle", "text_token_ids", "max_frames", "min_frames", "last", "first_audio_budget_s")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_AUDIO_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    handle: int
    text_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_frames: int
    min_frames: int
    last: bool
    first_audio_budget_s: float
    def __init__(self, consumer_id: _Optional[str] = ..., handle: _Optional[int] = ..., text_token_ids: _Optional[_Iterable[int]] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., last: _Optional[bool] = ..., first_audio_budget_s: _Optional[float] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("consumer_id", "handle")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    handle: int
    def __init__(self, consumer_id: _Optional[str] = ..., handle: _Optional[int] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("found", "dropped")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    dropped: int
    def __init__(self, found: _Optional[bool] = ..., dropped: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("admission", "queue_position")
    class Admission(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ADMISSION_UNSPECIFIED: _ClassVar[SubmitResponse.Admission]
        ADMISSION_ADMITTED: _ClassVar[SubmitResponse.Admission]
        ADMISSION_QUEUED: _ClassVar[SubmitResponse.Admission]
    ADMISSION_UNSPECIFIED: SubmitResponse.Admission
    ADMISSION_ADMITTED: SubmitResponse.Admission
    ADMISSION_QUEUED: SubmitResponse.Admission
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    admission: SubmitResponse.Admission
    queue_position: int
    def __init__(self, admission: _Optional[_Union[SubmitResponse.Admission, str]] = ..., queue_position: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("consumer_id", "handle")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    handle: int
    def __init__(self, consumer_id: _Optional[str] = ..., handle: _Optional[int] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class TalkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TalkerStats(_message.Message):
    __slots__ = ("running", "waiting", "free_slots", "paused_rows", "steps_per_s", "frames_per_s", "mean_frames_per_step", "model_name")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    FRAMES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_FRAMES_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    free_slots: int
    paused_rows: int
    steps_per_s: float
    frames_per_s: float
    mean_frames_per_step: float
    model_name: str
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_slots: _Optional[int] = ..., paused_rows: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., frames_per_s: _Optional[float] = ..., mean_frames_per_step: _Optional[float] = ..., model_name: _Optional[str] = ...) -> None: ...

class WatchAdmissionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdmissionVerdict(_message.Message):
    __slots__ = ("refusal", "retry_after_s", "room", "room_refusal", "room_retry_after_s")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    ROOM_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    ROOM_RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    refusal: str
    retry_after_s: float
    room: int
    room_refusal: str
    room_retry_after_s: float
    def __init__(self, refusal: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., room: _Optional[int] = ..., room_refusal: _Optional[str] = ..., room_retry_after_s: _Optional[float] = ...) -> None: ...
