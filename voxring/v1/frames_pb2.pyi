from voxring.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeMessage(_message.Message):
    __slots__ = ("consumer_id", "consumer_instance_token", "tick_s", "first_audio_s")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TICK_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_AUDIO_S_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    consumer_instance_token: int
    tick_s: float
    first_audio_s: float
    def __init__(self, consumer_id: _Optional[str] = ..., consumer_instance_token: _Optional[int] = ..., tick_s: _Optional[float] = ..., first_audio_s: _Optional[float] = ...) -> None: ...

class FrameRecord(_message.Message):
    __slots__ = ("handle", "seq", "first_frame", "num_frames", "num_codebooks", "flags", "finish_reason", "codes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    seq: int
    first_frame: int
    num_frames: int
    num_codebooks: int
    flags: int
    finish_reason: _common_pb2.FinishReason
    codes: bytes
    def __init__(self, handle: _Optional[int] = ..., seq: _Optional[int] = ..., first_frame: _Optional[int] = ..., num_frames: _Optional[int] = ..., num_codebooks: _Optional[int] = ..., flags: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., codes: _Optional[bytes] = ...) -> None: ...

class RecordBatch(_message.Message):
    __slots__ = ("records", "closed")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[FrameRecord]
    closed: bool
    def __init__(self, records: _Optional[_Iterable[_Union[FrameRecord, _Mapping]]] = ..., closed: _Optional[bool] = ...) -> None: ...
