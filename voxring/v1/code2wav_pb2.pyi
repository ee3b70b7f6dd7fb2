from voxring.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenRequest(_message.Message):
    __slots__ = ("request_id", "talker_id", "max_frames", "pacing", "speaker_id", "seed", "session")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TALKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PACING_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    talker_id: str
    max_frames: int
    pacing: Pacing
    speaker_id: int
    seed: int
    session: bool
    def __init__(self, request_id: _Optional[str] = ..., talker_id: _Optional[str] = ..., max_frames: _Optional[int] = ..., pacing: _Optional[_Union[Pacing, _Mapping]] = ..., speaker_id: _Optional[int] = ..., seed: _Optional[int] = ..., session: _Optional[bool] = ...) -> None: ...

class Pacing(_message.Message):
    __slots__ = ("decode_margin_s", "steady_frames", "min_chunk_frames")
    DECODE_MARGIN_S_FIELD_NUMBER: _ClassVar[int]
    STEADY_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    decode_margin_s: float
    steady_frames: int
    min_chunk_frames: int
    def __init__(self, decode_margin_s: _Optional[float] = ..., steady_frames: _Optional[int] = ..., min_chunk_frames: _Optional[int] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("opened", "chunk", "finished", "segment_end")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_END_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    chunk: AudioChunk
    finished: Finished
    segment_end: SegmentEnd
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., chunk: _Optional[_Union[AudioChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., segment_end: _Optional[_Union[SegmentEnd, _Mapping]] = ...) -> None: ...

class SegmentEnd(_message.Message):
    __slots__ = ("segment_index", "finish_reason", "frames", "sample_offset")
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    segment_index: int
    finish_reason: _common_pb2.FinishReason
    frames: int
    sample_offset: int
    def __init__(self, segment_index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., frames: _Optional[int] = ..., sample_offset: _Optional[int] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    def __init__(self, handle: _Optional[int] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("pcm", "chunk_index", "sample_offset", "num_frames")
    PCM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    pcm: bytes
    chunk_index: int
    sample_offset: int
    num_frames: int
    def __init__(self, pcm: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., sample_offset: _Optional[int] = ..., num_frames: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "frames", "first_frame_s", "first_chunk_s", "decode_s")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    frames: int
    first_frame_s: float
    first_chunk_s: float
    decode_s: float
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., frames: _Optional[int] = ..., first_frame_s: _Optional[float] = ..., first_chunk_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...

class EncodeVoiceRequest(_message.Message):
    __slots__ = ("audio", "sample_rate_hz")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    sample_rate_hz: int
    def __init__(self, audio: _Optional[bytes] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class EncodeVoiceResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _common_pb2.Frames
    def __init__(self, frames: _Optional[_Union[_common_pb2.Frames, _Mapping]] = ...) -> None: ...

class Code2WavStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Code2WavStats(_message.Message):
    __slots__ = ("active_slots", "queued_frames", "chunks_per_s", "audio_seconds_per_s", "dropped_records", "sequence_gaps", "duplicate_records")
    ACTIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_PER_S_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_GAPS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_RECORDS_FIELD_NUMBER: _ClassVar[int]
    active_slots: int
    queued_frames: int
    chunks_per_s: float
    audio_seconds_per_s: float
    dropped_records: int
    sequence_gaps: int
    duplicate_records: int
    def __init__(self, active_slots: _Optional[int] = ..., queued_frames: _Optional[int] = ..., chunks_per_s: _Optional[float] = ..., audio_seconds_per_s: _Optional[float] = ..., dropped_records: _Optional[int] = ..., sequence_gaps: _Optional[int] = ..., duplicate_records: _Optional[int] = ...) -> None: ...
