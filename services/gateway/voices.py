"""The voices a gateway offers, read strictly from the voices file its config names.

A voice maps a name to the model's speaker id and may carry a reference clip with its
transcript (an audio-context turn that conditions the voice; the gateway-and-SDK issue
encodes it through Code2Wav.EncodeVoice).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import ConfigError, ConfigValueError, parse_section, parse_yaml_text


@dataclass(frozen=True)
class VoiceEntry:
    name: str
    speaker_id: int
    language_code: str = "en-US"
    description: str = ""
    reference_audio: str | None = None  # WAV file, relative to the voices file
    reference_text: str | None = None   # its transcript

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ConfigValueError("name", f"must be non-empty without outer spaces, got {self.name!r}")
        if self.speaker_id < 0:
            raise ConfigValueError("speaker_id", f"must be >= 0, got {self.speaker_id}")
        if (self.reference_audio is None) != (self.reference_text is None):
            raise ConfigValueError("reference_text",
                                   "reference_audio and reference_text go together")


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
