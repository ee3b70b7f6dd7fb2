"""The voices a gateway offers: those of the voices file its config names (read strictly),
and those added through the API (services.gateway.voice_manager), which may be removed.

A voice maps a name to the model's speaker id and may carry a reference clip with its
transcript (an audio-context turn that conditions the voice; services.gateway.voice_cache
encodes it through Code2Wav.EncodeVoice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from services.common.config import ConfigError, ConfigValueError, parse_section, parse_yaml_text


@dataclass(frozen=True)
class VoiceEntry:
    name: str
    speaker_id: int
    language_code: str = "en-US"
    description: str = ""
    reference_audio: str | None = None  # WAV file, relative to the voices file
    reference_text: str | None = None   # its transcript
    removable: ClassVar[bool] = False    # a voices-file voice: DeleteVoice refuses it

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ConfigValueError("name", f"must be non-empty without outer spaces, got {self.name!r}")
        if self.speaker_id < 0:
            raise ConfigValueError("speaker_id", f"must be >= 0, got {self.speaker_id}")
        if (self.reference_audio is None) != (self.reference_text is None):
            raise ConfigValueError("reference_text",
                                   "reference_audio and reference_text go together")


class ClipFrames:
    """The one place an added voice's encoded frames live, shared by every reference to its
    entry: a request that validated with the voice keeps them (or, for a voice loaded at
    start-up and not used yet, the clip itself) even when the voice is deleted meanwhile."""

    def __init__(self, frames: Any = None) -> None:
        self.frames = frames        # common_pb2.Frames once encoded; None: not yet
        self.wav: bytes | None = None  # the clip's WAV, kept here when its file is deleted first


@dataclass(frozen=True)
class UploadedVoice(VoiceEntry):
    """A voice added through the API: ``reference_audio`` is the absolute path of its WAV in
    the voice folder, ``clip_sha256`` that file's content hash."""

    clip_sha256: str = ""
    clip: ClipFrames = field(default_factory=ClipFrames, compare=False, repr=False)
    removable: ClassVar[bool] = True


@dataclass(frozen=True)
class VoicesFile:
    voices: tuple[VoiceEntry, ...]
    default_voice: str | None = None  # null: the first voice

    def __post_init__(self) -> None:
        if not self.voices:
            raise ConfigValueError("voices", "needs at least one voice")
        names = [v.name for v in self.voices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigValueError("voices", f"duplicate voice names: {', '.join(dupes)}")
        if self.default_voice is not None and self.default_voice not in names:
            raise ConfigValueError("default_voice", f"{self.default_voice!r} is not a voice here")


@dataclass(frozen=True)
class VoiceCatalog:
    voices: dict[str, VoiceEntry]
    default: str
    folder: Path | None = None  # where relative reference clips are found

    @classmethod
    def builtin(cls) -> VoiceCatalog:
        voice = VoiceEntry(name="default", speaker_id=0, description="speaker 0 of the model")
        return cls({voice.name: voice}, voice.name)

    @classmethod
    def load(cls, path: Path) -> VoiceCatalog:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read voices file: {exc.strerror}") from None
        data = parse_yaml_text(text, str(path))
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping with a 'voices' list")
        try:
            parsed = parse_section(VoicesFile, data, "voices file")
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        for voice in parsed.voices:
            if voice.reference_audio is not None and not (path.parent / voice.reference_audio).is_file():
                raise ConfigError(f"{path}: voice {voice.name}: reference_audio "
                                  f"{voice.reference_audio!r} does not exist")
        voices = {v.name: v for v in parsed.voices}
        return cls(voices, parsed.default_voice or parsed.voices[0].name, path.parent)

    def get(self, name: str) -> VoiceEntry | None:
        return self.voices.get(name or self.default)

    def add(self, voice: VoiceEntry) -> None:
        """Makes ``voice`` known by its name at once (validation reads this catalog)."""
        if voice.name in self.voices:
            raise ValueError(f"voice {voice.name!r} is already in the catalog")
        self.voices[voice.name] = voice

    def remove(self, name: str) -> VoiceEntry:
        """Forgets an added voice; a request holding its entry keeps using it."""
        voice = self.voices[name]
        if not voice.removable:
            raise ValueError(f"voice {name!r} comes from the voices file")
        return self.voices.pop(name)
