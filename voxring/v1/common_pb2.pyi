from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_DEADLINE: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_STALLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_DEADLINE: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_STALLED: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "repetition_window", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    repetition_window: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., repetition_window: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Frames(_message.Message):
    __slots__ = ("num_frames", "num_codebooks", "codes")
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    num_frames: int
    num_codebooks: int
    codes: bytes
    def __init__(self, num_frames: _Optional[int] = ..., num_codebooks: _Optional[int] = ..., codes: _Optional[bytes] = ...) -> None: ...
