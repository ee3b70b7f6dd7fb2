"""Adding, listing and removing voices: the one object the gRPC servicer and the HTTP API
both call (``servicer.voice_manager``).

:meth:`VoiceManager.create` checks every field (InvalidArgument naming it), decodes the
clip (services.gateway.voice_clip), encodes it once through an engine pair's
``Code2Wav.EncodeVoice`` so the voice is usable at once, saves it in the voice folder
(services.gateway.voice_store) and adds it to the catalog that validation reads.
:meth:`VoiceManager.delete` removes an added voice; a request that already validated
with it finishes (the entry it holds keeps the frames). Call both from the server's
event loop: a name is reserved there before the first await, so of concurrent creates
of one name exactly one wins, and the others get ALREADY_EXISTS.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from services.common.config import ConfigError
from services.common.error_codes import VOICE_NOT_FOUND
from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.gateway.audio import wav_bytes
from services.gateway.config import GatewayConfig
from services.gateway.routing import REQUEST_DOWN_S, ModelFacts, Router
from services.gateway.voice_cache import encode_clip
from services.gateway.voice_clip import Clip, decode_clip
from services.gateway.voice_store import NAME_PATTERN, StoredVoice, VoiceStore
from services.gateway.voices import ClipFrames, UploadedVoice, VoiceCatalog, VoiceEntry
from voxring.v1 import common_pb2

log = logging.getLogger(__name__)
MAX_SPEAKER_ID = 2**31 - 1
# the launcher's state folder (voxring up: .voxring/); its voices/ is the store when voices.store is null
STATE_DIR_ENV = "VOXRING_STATE_DIR"


class VoiceManager:
    """``catalog``: the voices validation knows (the voices file's, then the added ones);
    ``store``: None when the config keeps no voice folder (adding is refused)."""

    def __init__(self, config: GatewayConfig, catalog: VoiceCatalog, router: Router | None,
                 store: VoiceStore | None) -> None:
        self.config = config
        self.catalog = catalog
        self.router = router
        self.store = store
        self._pending: set[str] = set()  # names being created (reserved before the first await)
        self._commits: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, config: GatewayConfig, base: Path, catalog: VoiceCatalog, router: Router,
                    environ: Mapping[str, str] | None = None) -> VoiceManager:
        """The manager of ``voices.store`` (relative to ``base``, the config file's folder), with
        the folder's voices loaded. When that is null: ``<VOXRING_STATE_DIR>/voices`` where the
        launcher set that variable (``environ``, default os.environ), else no folder."""
        folder, origin = _store_folder(config, base, os.environ if environ is None else environ)
        if folder is None:
            return cls(config, catalog, router, None)
        if config.voices.max_clip_mb >= config.server.max_message_mb:
            raise ConfigError(f"voices.max_clip_mb: {config.voices.max_clip_mb:g} MB does not fit in "
                              f"a CreateVoice message (server.max_message_mb: "
                              f"{config.server.max_message_mb}); lower it or raise that")
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{origin}: {folder} exists and is not a folder")
        manager = cls(config, catalog, router, VoiceStore(folder))
        manager.load()
        return manager

    # --- reading -------------------------------------------------------------------------------

    def load(self) -> int:
        """Adds the folder's voices to the catalog (at start-up); how many. A name that a
        voices-file voice has already is skipped (that one wins)."""
        loaded = 0
        for record in self.store.load():
            if record.name in self.catalog.voices:
                log.warning("voice store: %s is also a voice of the voices file, which wins; the "
                            "stored one is not offered (rename or delete one of them)", record.name)
                continue
            if (target := self.catalog.alias_of(record.name)) is not None:
                log.warning("voice store: %s is also an alias of the voice %s; the stored voice wins "
                            "(rename it to free the alias)", record.name, target)
            self.catalog.add(self._entry(record, self.store.wav_path(record.name), ClipFrames()))
            loaded += 1
        log.info("voice store %s: %d added voice%s loaded", self.store.folder, loaded,
                 "" if loaded == 1 else "s")
        return loaded

    def list(self) -> list[VoiceEntry]:
        """Every voice: the voices file's first, then the added ones (``removable``), then the
        served models' named speakers."""
        return self.catalog.listed()

    @property
    def default(self) -> str:
        return self.catalog.default

    # --- adding --------------------------------------------------------------------------------

    async def create(self, name: str, audio: bytes, transcript: str, speaker_id: int = 0,
                     language_code: str = "", description: str = "") -> VoiceEntry:
        """Adds a voice; it is usable by name as soon as this returns."""
        if self.store is None:
            raise FailedPrecondition("this server keeps no voice folder (voices.store is null): "
                                     "adding voices is off")
        self._check_name(name)
        transcript = self._check_text("transcript", transcript, self.config.voices.max_transcript_chars,
                                      required=True)
        description = self._check_text("description", description,
                                       self.config.voices.max_description_chars)
        language = self._check_fields(speaker_id, language_code)
        await self._check_family()
        self._reserve(name)
        committing = False
        try:
            clip = await asyncio.to_thread(decode_clip, audio, self.config.voices)
            frames, model = await self._encode(clip, name, speaker_id, transcript)
            wav = wav_bytes(clip.pcm, clip.sample_rate)
            record = StoredVoice(
                name=name, speaker_id=speaker_id, language_code=language, description=description,
                transcript=transcript, sha256=hashlib.sha256(wav).hexdigest(),
                sample_rate_hz=clip.sample_rate, seconds=round(clip.seconds, 3),
                created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
                model=model)
            # From here the voice is kept even if the caller leaves: the commit runs to its end.
            committing = True
            task = asyncio.ensure_future(self._commit(record, wav, frames))
            self._commits.add(task)
            task.add_done_callback(self._commits.discard)
            return await asyncio.shield(task)
        finally:
            if not committing:
                self._pending.discard(name)

    async def _commit(self, record: StoredVoice, wav: bytes, frames: common_pb2.Frames) -> VoiceEntry:
        try:
            path = await asyncio.to_thread(self.store.save, record, wav)
        except OSError as exc:
            log.error("voice store %s: cannot save %s: %s", self.store.folder, record.name, exc)
            raise Internal(f"cannot save voice {record.name}: {exc.strerror or exc}") from None
        finally:
            self._pending.discard(record.name)
        entry = self._entry(record, path, ClipFrames(frames))
        self.catalog.add(entry)
        log.info("voice %s added (speaker %d, %.2f s clip, %d frames)", record.name, record.speaker_id,
                 record.seconds, frames.num_frames)
        return entry

    def _reserve(self, name: str) -> None:
        """Claims ``name`` for this create; no await since the checks, so no other create of
        it can be between them. A name only in case different is refused too: on a
        case-insensitive file system its files would be the other voice's. So is an alias's
        name: the new voice would silently take it over from the voice it stands for."""
        if (target := self.catalog.alias_of(name)) is not None:
            raise AlreadyExists(f"name: {name!r} is an alias of the voice {target!r} (the voices "
                                "file's aliases); choose another name", field="name")
        folded = name.casefold()
        for other in (*self.catalog.voices, *self._pending):
            if other == name:
                raise AlreadyExists(f"name: a voice {name!r} exists already", field="name")
            if other.casefold() == folded:
                raise AlreadyExists(f"name: {name!r} differs only in case from the voice {other!r}",
                                    field="name")
        added = sum(v.removable for v in self.catalog.voices.values()) + len(self._pending)
        if added >= self.config.voices.max_stored:
            raise ResourceExhausted(f"this server keeps at most {self.config.voices.max_stored} added "
                                    "voices; delete one first")
        self._pending.add(name)

    async def _check_family(self) -> None:
        """Up front, before the clip is decoded: the default model (whose pairs encode the clip) must
        be of a family that conditions on a clip; FAILED_PRECONDITION otherwise (a Qwen2.5-Omni
        model's voices are its checkpoint's speakers). Unknown while none of its pairs answers:
        _encode says so."""
        if self.router is None:
            return
        try:
            default = await self.router.learn(await self.router.pick())
        except Unavailable:
            return
        if not default.takes_clips:
            raise FailedPrecondition(f"the default model {default.name} ({default.family} family) makes no "
                                     "voice from a clip: its voices are its checkpoint's speakers",
                                     field="audio")

    async def _encode(self, clip: Clip, name: str, speaker_id: int,
                      transcript: str) -> tuple[common_pb2.Frames, str]:
        """The clip's frames from a pair of the default model (each tried once, like a request),
        checked to leave room in the model's length for the requests that use the voice, and that
        model's name: the voice is its (its frames are that model's codes)."""
        if self.router is None:
            raise Unavailable("no engine pair configured to encode the clip")
        tried: frozenset[str] = frozenset()
        while True:
            pair = await self.router.acquire(tried)
            try:
                facts = await pair.model_facts()
                frames = await encode_clip(pair, clip.pcm, clip.sample_rate, name)
            except Unavailable:
                pair.mark_down(REQUEST_DOWN_S)
                tried |= {pair.name}
                if not any(p.name not in tried and not p.retired and p.serves(None, self.router.default_model)
                           for p in self.router.pairs):
                    raise
                continue
            finally:
                self.router.release(pair)
            pair.mark_up()
            self._check_room(facts, frames, speaker_id, transcript)
            return frames, facts.name

    @staticmethod
    def _check_room(facts: ModelFacts, frames: common_pb2.Frames, speaker_id: int, transcript: str) -> None:
        """The voice's turn may take at most half of the model's positions: the rest is for
        the text and the audio of each request with it."""
        budget = facts.max_len // 2
        audio = frames.num_frames + 1
        if audio > budget:
            raise InvalidArgument("audio", f"the clip is {frames.num_frames} frames, more than half of "
                                  f"the model's length ({facts.max_len} positions): use a shorter clip")
        words = len(facts.prompt_ids(speaker_id, transcript))
        if audio + words > budget:
            raise InvalidArgument("transcript", f"{words} tokens with the clip's {frames.num_frames} "
                                  f"frames exceed half of the model's length ({facts.max_len}): "
                                  "shorten the transcript or the clip")

    # --- removing ------------------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Removes an added voice: its files (metadata first), then its catalog entry. A
        request already running with it finishes normally."""
        voice = self.catalog.voices.get(name) if isinstance(name, str) else None
        if voice is None:
            raise NotFound(f"name: no voice {name!r}", field="name", error_code=VOICE_NOT_FOUND)
        if not isinstance(voice, UploadedVoice) or self.store is None:
            raise FailedPrecondition(f"name: voice {name!r} comes from the voices file; only voices "
                                     "added through the API can be deleted", field="name")
        if voice.clip.frames is None:  # never used since start-up: keep the clip for running requests
            try:
                voice.clip.wav = Path(voice.reference_audio).read_bytes()
            except OSError as exc:
                log.warning("voice %s: cannot read its clip before deleting it: %s", name, exc)
        try:
            self.store.remove(name)
        except FileNotFoundError:
            log.warning("voice %s: its metadata was already gone from the folder", name)
        except OSError as exc:
            raise Internal(f"cannot delete voice {name}: {exc.strerror or exc}") from None
        self.catalog.remove(name)
        log.info("voice %s deleted", name)

    # --- checks --------------------------------------------------------------------------------

    @staticmethod
    def _check_name(name: object) -> None:
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InvalidArgument("name", f"must be 1 to 64 letters, digits, '.', '_' or '-', not "
                                  f"starting with '.', got {name!r}")

    @staticmethod
    def _check_text(field: str, text: object, limit: int, required: bool = False) -> str:
        if not isinstance(text, str):
            raise InvalidArgument(field, f"expected text, got {type(text).__name__}")
        text = text.strip()
        if required and not text:
            raise InvalidArgument(field, "must not be empty: say what the clip says")
        if len(text) > limit:
            raise InvalidArgument(field, f"{len(text)} characters exceeds the limit of {limit}")
        if not text.isprintable():
            raise InvalidArgument(field, "must be printable text (no control characters)")
        return text

    def _check_fields(self, speaker_id: object, language_code: object) -> str:
        """Checks the speaker and the language (as validation does for requests); the
        language, the server's default for an empty one."""
        if isinstance(speaker_id, bool) or not isinstance(speaker_id, int) \
                or not 0 <= speaker_id <= MAX_SPEAKER_ID:
            raise InvalidArgument("speaker_id", f"must be an integer 0..{MAX_SPEAKER_ID}, "
                                  f"got {speaker_id!r}")
        codes = self.config.text.language_codes
        if not isinstance(language_code, str):
            raise InvalidArgument("language_code", f"expected text, got {type(language_code).__name__}")
        language = language_code or codes[0]
        if language not in codes:
            raise InvalidArgument("language_code", f"unsupported language {language_code!r} "
                                  f"(one of {', '.join(codes)})")
        return language

    @staticmethod
    def _entry(record: StoredVoice, path: Path, clip: ClipFrames) -> UploadedVoice:
        return UploadedVoice(name=record.name, speaker_id=record.speaker_id,
                             language_code=record.language_code, description=record.description,
                             reference_audio=str(path.resolve()), reference_text=record.transcript,
                             clip_sha256=record.sha256, clip=clip, model=record.model or None)


def _store_folder(config: GatewayConfig, base: Path, environ: Mapping[str, str]) -> tuple[Path | None, str]:
    """The voice folder and what named it: ``voices.store``, else the launcher's state folder's
    ``voices/`` (so a stack started by ``voxring up`` can add voices); (None, "") for neither."""
    if config.voices.store is not None:
        return base / config.voices.store, "voices.store"
    if state_dir := environ.get(STATE_DIR_ENV):
        return Path(state_dir) / "voices", STATE_DIR_ENV
    return None, ""
