"""The folder that keeps added voices across restarts (``voices.store``).

Each voice is two files named after it: ``NAME.wav`` (the clip, mono int16) and
``NAME.json`` (what it is: speaker, language, transcript, the clip's SHA-256). The JSON
is the commit point. Saving writes the WAV, then the JSON; deleting removes the JSON,
then the WAV. Every write goes to a temporary file in the folder (``.NAME...tmp``: voice
names never start with a dot), is fsynced and renamed over the target with
``os.replace``, and the folder is fsynced after each rename, so a crash at any moment
leaves the voice whole or absent: a WAV without its JSON is a half-saved or half-deleted
voice and is removed at the next load, as are left-over temporary files.

One gateway owns a folder: two gateways sharing one would not see each other's changes.
:meth:`VoiceStore.load` runs at start-up, before serving; the manager runs :meth:`save`
in a worker thread, off the event loop, and :meth:`remove` (two unlinks) on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from services.gateway.voice_cache import read_wav

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2 added `model`; a format-1 record loads as a voice of any model
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # 1..64 characters, no leading dot


class StoreError(ValueError):
    """An entry of the folder that cannot be loaded; the message says why."""


@dataclass(frozen=True)
class StoredVoice:
    """What ``NAME.json`` holds."""

    name: str
    speaker_id: int
    language_code: str
    description: str
    transcript: str
    sha256: str          # of NAME.wav's bytes
    sample_rate_hz: int
    seconds: float
    created_at: str      # ISO 8601, UTC
    model: str = ""      # the served model whose pair encoded the clip ("": any, a format-1 record)
    format: int = FORMAT_VERSION

    @classmethod
    def from_json(cls, data: object) -> StoredVoice:
        if not isinstance(data, dict):
            raise StoreError("expected a JSON object")
        types = {"name": str, "speaker_id": int, "language_code": str, "description": str,
                 "transcript": str, "sha256": str, "sample_rate_hz": int, "seconds": (int, float),
                 "created_at": str, "format": int}
        if data.get("format") == FORMAT_VERSION:
            types["model"] = str
        unknown = sorted(set(data) - set(types))
        missing = sorted(set(types) - set(data))
        if unknown or missing:
            raise StoreError(f"unknown keys {unknown} / missing keys {missing}")
        for key, kind in types.items():
            if not isinstance(data[key], kind) or isinstance(data[key], bool):
                raise StoreError(f"{key}: expected {getattr(kind, '__name__', 'a number')}, "
                                 f"got {data[key]!r}")
        if data["format"] not in (1, FORMAT_VERSION):
            raise StoreError(f"format {data['format']} is not 1 or {FORMAT_VERSION}")
        if data["speaker_id"] < 0 or not data["transcript"].strip():
            raise StoreError("speaker_id must be >= 0 and the transcript not empty")
        return cls(**data)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, whatever happens (mode 0600)."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Makes the folder's renames and unlinks durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VoiceStore:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def wav_path(self, name: str) -> Path:
        return self.folder / f"{name}.wav"

    def _json_path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def save(self, record: StoredVoice, wav: bytes) -> Path:
        """Writes the voice (WAV first, its JSON last); returns the WAV's path."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        wav_path = self.wav_path(record.name)
        write_atomic(wav_path, wav)
        write_atomic(self._json_path(record.name), json.dumps(asdict(record), indent=2).encode())
        return wav_path

    def remove(self, name: str) -> None:
        """Deletes the voice: its JSON first (after that it is gone for good), then the WAV."""
        self._json_path(name).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.wav_path(name).unlink()
        fsync_folder(self.folder)

    def load(self) -> list[StoredVoice]:
        """The folder's voices, oldest first; a corrupt entry is logged and skipped (its
        files are left for a person to look at), debris of an interrupted save or delete
        is removed. A folder that does not exist yet holds no voices."""
        if not self.folder.is_dir():
            return []
        voices, named = [], set()
        for path in sorted(self.folder.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                self._remove_debris(path, "a temporary file of an interrupted save")
            elif path.suffix == ".json":
                named.add(path.stem)
                try:
                    voices.append(self._load_one(path))
                except (StoreError, OSError, ValueError) as exc:
                    log.error("voice store %s: skipping %s: %s", self.folder, path.name, exc)
        for path in sorted(self.folder.glob("*.wav")):
            if path.stem not in named:
                self._remove_debris(path, "a clip without its metadata (interrupted save or delete)")
        return sorted(voices, key=lambda v: (v.created_at, v.name))

    def _load_one(self, path: Path) -> StoredVoice:
        try:
            record = StoredVoice.from_json(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise StoreError(f"not valid JSON ({exc})") from None
        if record.name != path.stem or not NAME_PATTERN.fullmatch(record.name):
            raise StoreError(f"holds the name {record.name!r}, not {path.stem!r}")
        data = self.wav_path(record.name).read_bytes()
        if hashlib.sha256(data).hexdigest() != record.sha256:
            raise StoreError(f"{record.name}.wav does not match its SHA-256")
        try:
            read_wav(data, record.name)
        except Exception as exc:  # Internal: not a mono int16 WAV
            raise StoreError(str(exc)) from None
        return record

    def _remove_debris(self, path: Path, what: str) -> None:
        log.warning("voice store %s: removing %s, %s", self.folder, path.name, what)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
