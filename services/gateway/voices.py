"""The voices a gateway offers: those of the voices file its config names (read strictly),
and those added through the API (services.gateway.voice_manager), which may be removed.

A voice maps a name to the model's speaker id and may carry a reference clip with its
transcript (an audio-context turn that conditions the voice; services.gateway.voice_cache
encodes it through Code2Wav.EncodeVoice).

An alias is another name of a voices-file voice, accepted wherever a voice name is: the
voices file's ``aliases`` list, by default OpenAI's voice names (:data:`OPENAI_VOICES`)
spread over the file's voices in order (:func:`default_aliases`), so that clients written
for OpenAI's API work unchanged. A voice's own name wins over an alias of that name (a
voice added through the API cannot take an alias's name; one kept from before shadows it).
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
    # the served model (ModelInfo model_name) whose speaker this is; null: any model, a request
    # naming none going to the gateway's default model (engines.default_model)
    model: str | None = None
    removable: ClassVar[bool] = False    # a voices-file voice: DeleteVoice refuses it

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ConfigValueError("name", f"must be non-empty without outer spaces, got {self.name!r}")
        if self.speaker_id < 0:
            raise ConfigValueError("speaker_id", f"must be >= 0, got {self.speaker_id}")
        if (self.reference_audio is None) != (self.reference_text is None):
            raise ConfigValueError("reference_text",
                                   "reference_audio and reference_text go together")
        if self.model is not None and not self.model.strip():
            raise ConfigValueError("model", "must be a served model's name or null, got an empty string")


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


# OpenAI's voice names: aliases of the served model's voices unless the voices file says otherwise
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                 "verse")


@dataclass(frozen=True)
class VoiceAlias:
    name: str   # the other name
    voice: str  # the voices-file voice it stands for

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ConfigValueError("name", f"must be non-empty without outer spaces, got {self.name!r}")


def default_aliases(voices: list[str]) -> dict[str, str]:
    """OpenAI's voice names over ``voices`` in turn (alloy the first, ash the second, ... and
    round again); a name that is a voice itself is left out."""
    names = [n for n in OPENAI_VOICES if n not in voices]
    return {name: voices[i % len(voices)] for i, name in enumerate(names)}


@dataclass(frozen=True)
class VoicesFile:
    voices: tuple[VoiceEntry, ...]
    default_voice: str | None = None  # null: the first voice
    aliases: tuple[VoiceAlias, ...] | None = None  # null: default_aliases(); []: none

    def __post_init__(self) -> None:
        if not self.voices:
            raise ConfigValueError("voices", "needs at least one voice")
        names = [v.name for v in self.voices]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigValueError("voices", f"duplicate voice names: {', '.join(dupes)}")
        if self.default_voice is not None and self.default_voice not in names:
            raise ConfigValueError("default_voice", f"{self.default_voice!r} is not a voice here")
        seen: set[str] = set()
        for i, alias in enumerate(self.aliases or ()):
            if alias.name in names or alias.name in seen:
                raise ConfigValueError(f"aliases[{i}].name", f"{alias.name!r} is "
                                       f"{'a voice' if alias.name in names else 'an alias'} already")
            if alias.voice not in names:
                raise ConfigValueError(f"aliases[{i}].voice", f"{alias.voice!r} (for {alias.name!r}) "
                                       f"is not a voice here (voices: {', '.join(names)})")
            seen.add(alias.name)

    def alias_table(self) -> dict[str, str]:
        """Alias -> voice: the file's list, or the default one when the file has none."""
        if self.aliases is None:
            return default_aliases([v.name for v in self.voices])
        return {a.name: a.voice for a in self.aliases}


@dataclass(frozen=True)
class VoiceCatalog:
    voices: dict[str, VoiceEntry]
    default: str
    folder: Path | None = None  # where relative reference clips are found
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> a voices-file voice's name
    # the served models' named speakers (ModelInfo speakers, e.g. a Qwen2.5-Omni checkpoint's), each a
    # voice bound to its model; a voices-file or added voice of the same name wins
    model_voices: dict[str, VoiceEntry] = field(default_factory=dict)

    @classmethod
    def builtin(cls) -> VoiceCatalog:
        voice = VoiceEntry(name="default", speaker_id=0, description="speaker 0 of the model")
        return cls({voice.name: voice}, voice.name, aliases=default_aliases([voice.name]))

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
        return cls(voices, parsed.default_voice or parsed.voices[0].name, path.parent,
                   parsed.alias_table())

    def get(self, name: str) -> VoiceEntry | None:
        """The voice of that name, else the voice that alias stands for, else a served model's
        speaker of that name; "": the default."""
        name = name or self.default
        voice = self.voices.get(name)
        if voice is None and name in self.aliases:
            voice = self.voices.get(self.aliases[name])
        return voice or self.model_voices.get(name)

    def learn_model(self, model: str, speakers: tuple[tuple[str, int], ...]) -> None:
        """A served model's named speakers become voices bound to it (once its pair answers)."""
        for name, speaker_id in speakers:
            if name and name == name.strip():
                self.model_voices.setdefault(name, VoiceEntry(
                    name=name, speaker_id=speaker_id, description=f"speaker {name} of {model}", model=model))

    def listed(self) -> list[VoiceEntry]:
        """Every voice: the voices file's, the added ones, then the models' speakers not shadowed."""
        return [*self.voices.values(), *(v for n, v in self.model_voices.items()
                                          if n not in self.voices and n not in self.aliases)]

    def names(self) -> list[str]:
        return sorted({*self.voices, *self.model_voices})

    def alias_of(self, name: str) -> str | None:
        """The voice an alias stands for; None for a name that is no alias (or is a voice)."""
        return None if name in self.voices else self.aliases.get(name)

    def aliases_of(self, voice: str) -> list[str]:
        """The aliases that stand for ``voice``, in the table's order (none shadowed by a voice)."""
        return [a for a, v in self.aliases.items() if v == voice and a not in self.voices]

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
