from voxring.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    LINEAR_PCM: _ClassVar[AudioEncoding]
    WAV: _ClassVar[AudioEncoding]
    OGG_OPUS: _ClassVar[AudioEncoding]
    MP3: _ClassVar[AudioEncoding]
    FLAC: _ClassVar[AudioEncoding]
    AAC: _ClassVar[AudioEncoding]

class LengthLimit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LENGTH_LIMIT_UNSPECIFIED: _ClassVar[LengthLimit]
    LENGTH_LIMIT_REQUESTED: _ClassVar[LengthLimit]
    LENGTH_LIMIT_DEFAULT: _ClassVar[LengthLimit]
    LENGTH_LIMIT_SERVER: _ClassVar[LengthLimit]
    LENGTH_LIMIT_TEXT: _ClassVar[LengthLimit]
    LENGTH_LIMIT_MODEL: _ClassVar[LengthLimit]
ENCODING_UNSPECIFIED: AudioEncoding
LINEAR_PCM: AudioEncoding
WAV: AudioEncoding
OGG_OPUS: AudioEncoding
MP3: AudioEncoding
FLAC: AudioEncoding
AAC: AudioEncoding
LENGTH_LIMIT_UNSPECIFIED: LengthLimit
LENGTH_LIMIT_REQUESTED: LengthLimit
LENGTH_LIMIT_DEFAULT: LengthLimit
LENGTH_LIMIT_SERVER: LengthLimit
LENGTH_LIMIT_TEXT: LengthLimit
LENGTH_LIMIT_MODEL: LengthLimit

class SynthesizeSpeechRequest(_message.Message):
    __slots__ = ("text", "language_code", "encoding", "sample_rate_hz", "voice_name", "temperature", "top_k", "top_p", "repetition_penalty", "repetition_window", "seed", "max_audio_seconds", "request_id", "speed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    VOICE_NAME_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    language_code: str
    encoding: AudioEncoding
    sample_rate_hz: int
    voice_name: str
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    repetition_window: int
    seed: int
    max_audio_seconds: float
    request_id: str
    speed: float
    def __init__(self, text: _Optional[str] = ..., language_code: _Optional[str] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hz: _Optional[int] = ..., voice_name: _Optional[str] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., repetition_window: _Optional[int] = ..., seed: _Optional[int] = ..., max_audio_seconds: _Optional[float] = ..., request_id: _Optional[str] = ..., speed: _Optional[float] = ...) -> None: ...

class SynthesizeSpeechResponse(_message.Message):
    __slots__ = ("audio", "chunk_index", "sample_offset", "sample_rate_hz", "encoding", "request_id", "finish_reason", "usage")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    chunk_index: int
    sample_offset: int
    sample_rate_hz: int
    encoding: AudioEncoding
    request_id: str
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    def __init__(self, audio: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., sample_offset: _Optional[int] = ..., sample_rate_hz: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("frames", "audio_seconds", "time_to_first_audio_s", "real_time_factor", "seed", "length_limit")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_AUDIO_S_FIELD_NUMBER: _ClassVar[int]
    REAL_TIME_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LENGTH_LIMIT_FIELD_NUMBER: _ClassVar[int]
    frames: int
    audio_seconds: float
    time_to_first_audio_s: float
    real_time_factor: float
    seed: int
    length_limit: LengthLimit
    def __init__(self, frames: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., time_to_first_audio_s: _Optional[float] = ..., real_time_factor: _Optional[float] = ..., seed: _Optional[int] = ..., length_limit: _Optional[_Union[LengthLimit, str]] = ...) -> None: ...

class StreamingSynthesizeRequest(_message.Message):
    __slots__ = ("config", "text", "flush", "clear")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    config: StreamingConfig
    text: str
    flush: Flush
    clear: Clear
    def __init__(self, config: _Optional[_Union[StreamingConfig, _Mapping]] = ..., text: _Optional[str] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., clear: _Optional[_Union[Clear, _Mapping]] = ...) -> None: ...

class StreamingConfig(_message.Message):
    __slots__ = ("voice_name", "language_code", "encoding", "sample_rate_hz", "temperature", "top_k", "top_p", "repetition_penalty", "repetition_window", "seed", "max_audio_seconds", "request_id", "min_segment_chars", "max_wait_s")
    VOICE_NAME_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_SEGMENT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    voice_name: str
    language_code: str
    encoding: AudioEncoding
    sample_rate_hz: int
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    repetition_window: int
    seed: int
    max_audio_seconds: float
    request_id: str
    min_segment_chars: int
    max_wait_s: float
    def __init__(self, voice_name: _Optional[str] = ..., language_code: _Optional[str] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hz: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., repetition_window: _Optional[int] = ..., seed: _Optional[int] = ..., max_audio_seconds: _Optional[float] = ..., request_id: _Optional[str] = ..., min_segment_chars: _Optional[int] = ..., max_wait_s: _Optional[float] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Clear(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamingSynthesizeResponse(_message.Message):
    __slots__ = ("audio", "segment_done", "done", "request_id")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    audio: StreamingAudio
    segment_done: SegmentDone
    done: SessionDone
    request_id: str
    def __init__(self, audio: _Optional[_Union[StreamingAudio, _Mapping]] = ..., segment_done: _Optional[_Union[SegmentDone, _Mapping]] = ..., done: _Optional[_Union[SessionDone, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class StreamingAudio(_message.Message):
    __slots__ = ("audio", "chunk_index", "sample_offset", "sample_rate_hz", "encoding", "segment_index", "segment_text")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_TEXT_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    chunk_index: int
    sample_offset: int
    sample_rate_hz: int
    encoding: AudioEncoding
    segment_index: int
    segment_text: str
    def __init__(self, audio: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., sample_offset: _Optional[int] = ..., sample_rate_hz: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., segment_index: _Optional[int] = ..., segment_text: _Optional[str] = ...) -> None: ...

class SegmentDone(_message.Message):
    __slots__ = ("segment_index", "text", "finish_reason", "usage")
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    segment_index: int
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    def __init__(self, segment_index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class SessionDone(_message.Message):
    __slots__ = ("finish_reason", "usage", "segments")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    segments: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., segments: _Optional[int] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "speaker_id", "language_code", "has_reference", "description", "removable", "aliases", "model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    HAS_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REMOVABLE_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    speaker_id: int
    language_code: str
    has_reference: bool
    description: str
    removable: bool
    aliases: _containers.RepeatedScalarFieldContainer[str]
    model: str
    def __init__(self, name: _Optional[str] = ..., speaker_id: _Optional[int] = ..., language_code: _Optional[str] = ..., has_reference: _Optional[bool] = ..., description: _Optional[str] = ..., removable: _Optional[bool] = ..., aliases: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ...) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices", "default_voice")
    VOICES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VOICE_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    default_voice: str
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ..., default_voice: _Optional[str] = ...) -> None: ...

class CreateVoiceRequest(_message.Message):
    __slots__ = ("name", "audio", "transcript", "speaker_id", "language_code", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_CODE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    audio: bytes
    transcript: str
    speaker_id: int
    language_code: str
    description: str
    def __init__(self, name: _Optional[str] = ..., audio: _Optional[bytes] = ..., transcript: _Optional[str] = ..., speaker_id: _Optional[int] = ..., language_code: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
