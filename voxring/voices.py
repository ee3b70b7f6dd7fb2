"""The SDK's voices: what ``voices()`` lists and what ``create_voice()`` sends, shared
by :mod:`voxring.client`'s two clients."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from voxring.errors import InvalidArgument
from voxring.v1 import synthesizer_pb2 as pb


@dataclass(frozen=True)
class Voice:
    name: str
    speaker_id: int
    language_code: str
    has_reference: bool   # a reference clip conditions this voice
    description: str
    is_default: bool
    removable: bool = False  # added through the API: delete_voice() may remove it
    aliases: tuple[str, ...] = ()  # other names that select it (OpenAI's "alloy", ... by default)


class Voices(list[Voice]):
    """The server's voices in its order; ``default_voice`` names the default one."""

    def __init__(self, voices: Sequence[Voice], default_voice: str) -> None:
        super().__init__(voices)
        self.default_voice = default_voice


def voice_of(message: pb.Voice, default_voice: str = "") -> Voice:
    return Voice(name=message.name, speaker_id=message.speaker_id, language_code=message.language_code,
                 has_reference=message.has_reference, description=message.description,
                 is_default=message.name == default_voice, removable=message.removable,
                 aliases=tuple(message.aliases))


def voices_of(response: pb.ListVoicesResponse) -> Voices:
    return Voices([voice_of(v, response.default_voice) for v in response.voices], response.default_voice)


def clip_bytes(audio: bytes | bytearray | memoryview | str | os.PathLike[str]) -> bytes:
    """The clip's bytes: given as bytes, or read from a file path. A file that cannot be
    read is InvalidArgument naming ``audio`` (raised here, before anything is sent)."""
    if isinstance(audio, bytes | bytearray | memoryview):
        return bytes(audio)
    if isinstance(audio, str | os.PathLike):
        path = Path(audio)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"audio: cannot read {path}: {exc.strerror or exc}",
                                  field="audio") from None
    raise InvalidArgument(f"audio: expected bytes or a file path, got {type(audio).__name__}",
                          field="audio")


def create_voice_request(name: str, audio, transcript: str, *, speaker_id: int = 0,
                         language_code: str | None = None,
                         description: str | None = None) -> pb.CreateVoiceRequest:
    """The wire request of ``create_voice``; the server checks every field (the SDK only
    what cannot travel: a speaker id outside uint32, a clip it cannot read)."""
    if isinstance(speaker_id, bool) or not isinstance(speaker_id, int) or not 0 <= speaker_id < 2**32:
        raise InvalidArgument(f"speaker_id: must be a non-negative integer, got {speaker_id!r}",
                              field="speaker_id")
    return pb.CreateVoiceRequest(name=name, audio=clip_bytes(audio), transcript=transcript,
                                 speaker_id=speaker_id, language_code=language_code or "",
                                 description=description or "")
