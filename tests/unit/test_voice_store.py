"""Added voices without a stack: the clip decoder (every common format, and what it
refuses), the voice folder (atomic files, reload, debris, corrupt entries) and the
manager's rules, with an engine pair whose Code2Wav encodes in this process."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import math
import os
import stat
import wave

import av
import numpy as np
import pytest

from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.gateway.config import GatewayConfig, TextSection, VoicesSection
from services.gateway.voice_cache import VoiceCache
from services.gateway.voice_clip import decode_clip
from services.gateway.voice_manager import VoiceManager
from services.gateway.voice_store import StoredVoice, StoreError, VoiceStore
from services.gateway.voices import VoiceCatalog, VoiceEntry
from voxring.v1 import code2wav_pb2, common_pb2

FRAME_RATE = 12.5


def clip(fmt: str = "wav", codec: str = "pcm_s16le", seconds: float = 2.0, rate: int = 44100,
         amplitude: float = 0.3, layout: str = "stereo") -> bytes:
    """A tone of ``seconds`` encoded by FFmpeg as ``fmt``/``codec``."""
    channels = 2 if layout == "stereo" else 1
    t = np.arange(int(rate * seconds)) / rate
    tone = (amplitude * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.repeat(tone, channels)[None], format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in (*stream.encode(frame), *stream.encode(None)):
            container.mux(packet)
    return buf.getvalue()


def wav(seconds: float = 2.0, rate: int = 16000, amplitude: float = 0.3) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    pcm = (amplitude * np.sin(2 * np.pi * 300 * t) * 32767).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm)
    return buf.getvalue()


# --- decoding ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("fmt", "codec", "rate"), [
    ("wav", "pcm_s16le", 44100), ("flac", "flac", 44100), ("mp3", "libmp3lame", 44100),
    ("ogg", "libopus", 48000), ("ipod", "aac", 44100),  # ipod: the M4A container
])
def test_every_common_format_decodes_to_mono_int16(fmt, codec, rate):
    decoded = decode_clip(clip(fmt, codec, seconds=2.0, rate=rate), VoicesSection())
    assert decoded.sample_rate == rate
    assert len(decoded.pcm) % 2 == 0 and abs(decoded.seconds - 2.0) < 0.1  # codec padding aside
    assert -16 < decoded.rms_dbfs < -11  # a 0.3 full-scale sine is -13.5 dBFS RMS, in both channels


def test_a_very_high_rate_is_stored_at_48k():
    decoded = decode_clip(clip("wav", "pcm_s16le", seconds=1.5, rate=96000, layout="mono"), VoicesSection())
    assert decoded.sample_rate == 48000 and abs(decoded.seconds - 1.5) < 0.01


@pytest.mark.parametrize(("data", "needle"), [
    (b"", "must not be empty"),
    (b"definitely not audio" * 50, "not a readable audio file"),
    (wav(seconds=0.5), "shorter than the minimum of 1 s"),
    (wav(seconds=11.0), "longer than this server's limit of 10 s"),
    (wav(amplitude=0.0), "silent (digital silence"),
    (wav(amplitude=0.001), "silent (-63"),
    (clip("mp3", "libmp3lame", seconds=12.0), "longer than this server's limit of 10 s"),
])
def test_bad_clips_are_refused_naming_audio(data, needle):
    with pytest.raises(InvalidArgument) as info:
        decode_clip(data, VoicesSection())
    assert info.value.field == "audio" and needle in info.value.reason, info.value.reason


def test_too_many_bytes_is_refused_before_decoding():
    with pytest.raises(InvalidArgument) as info:
        decode_clip(wav(seconds=4.0, rate=48000), VoicesSection(max_clip_mb=0.1))
    assert info.value.field == "audio" and "exceeds this server's limit of 0.1 MB" in info.value.reason


def test_limits_are_checked_in_the_config():
    for bad in (dict(min_clip_seconds=0), dict(min_clip_seconds=5, max_clip_seconds=4),
                dict(max_clip_seconds=61), dict(silence_dbfs=3), dict(max_stored=0)):
        with pytest.raises(Exception, match=next(iter(bad))):
            VoicesSection(**bad)


# --- the folder --------------------------------------------------------------------------------

def record(name: str = "anna", **changes) -> StoredVoice:
    fields = dict(name=name, speaker_id=1, language_code="en-US", description="", transcript="hello",
                  sha256="", sample_rate_hz=16000, seconds=2.0, created_at="2026-01-01T00:00:00Z")
    return StoredVoice(**{**fields, **changes})


def save(store: VoiceStore, name: str = "anna", **changes) -> bytes:
    import hashlib

    data = wav()
    store.save(record(name, sha256=hashlib.sha256(data).hexdigest(), **changes), data)
    return data


def test_save_writes_both_files_atomically_and_privately(tmp_path):
    store = VoiceStore(tmp_path / "voices" / "nested")  # created when missing
    data = save(store)
    files = sorted(p.name for p in store.folder.iterdir())
    assert files == ["anna.json", "anna.wav"]  # no temporary file is left
    assert (store.folder / "anna.wav").read_bytes() == data
    for name in files:
        assert stat.S_IMODE((store.folder / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    assert [v.name for v in store.load()] == ["anna"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path)
    before = save(store)

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        save(store, transcript="other")
    assert (tmp_path / "anna.wav").read_bytes() == before
    assert json.loads((tmp_path / "anna.json").read_text())["transcript"] == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anna.json", "anna.wav"]


def test_load_skips_corrupt_entries_and_removes_debris(tmp_path, caplog):
    store = VoiceStore(tmp_path)
    save(store, "good", created_at="2026-01-02T00:00:00Z")
    save(store, "older", created_at="2026-01-01T00:00:00Z")
    save(store, "hashed")
    (tmp_path / "hashed.wav").write_bytes(wav(amplitude=0.2))  # not the clip its JSON names
    save(store, "renamed")
    (tmp_path / "renamed.json").rename(tmp_path / "other.json")
    save(store, "nowav")
    (tmp_path / "nowav.wav").unlink()
    (tmp_path / "garbled.json").write_text("{not json")
    typed = {**dataclasses.asdict(record("typed")), "speaker_id": "1"}
    (tmp_path / "typed.json").write_text(json.dumps(typed))
    (tmp_path / ".good.wav.abc123.tmp").write_bytes(b"half a clip")
    (tmp_path / "orphan.wav").write_bytes(wav())
    with caplog.at_level(logging.WARNING):
        loaded = store.load()
    assert [v.name for v in loaded] == ["older", "good"]  # oldest first
    log = caplog.text
    for needle in ("hashed.json: hashed.wav does not match its SHA-256", "other.json: holds the name",
                   "nowav.json", "garbled.json: not valid JSON", "typed.json: speaker_id: expected int",
                   "removing .good.wav.abc123.tmp", "removing orphan.wav"):
        assert needle in log, needle
    left = {p.name for p in tmp_path.iterdir()}
    assert ".good.wav.abc123.tmp" not in left and "orphan.wav" not in left
    assert {"garbled.json", "hashed.json", "hashed.wav"} <= left  # a corrupt entry is left to look at


def test_remove_deletes_the_metadata_first(tmp_path, monkeypatch):
    store = VoiceStore(tmp_path)
    save(store)
    removed = []
    real_unlink = type(tmp_path).unlink
    monkeypatch.setattr(type(tmp_path), "unlink", lambda self, **kw: (removed.append(self.name),
                                                                       real_unlink(self, **kw)))
    store.remove("anna")
    assert removed == ["anna.json", "anna.wav"] and not list(tmp_path.iterdir())


# --- the manager -------------------------------------------------------------------------------

@dataclasses.dataclass
class FakeFacts:
    name: str = "voxring-tiny"
    family: str = "csm"
    speakers: tuple = ()
    takes_clips: bool = True
    max_len: int = 512
    frame_rate: float = FRAME_RATE

    def prompt_ids(self, speaker_id: int, text: str) -> list[int]:
        return list(range(len(f"[{speaker_id}]{text}".split()) + 2))


class FakeCode2Wav:
    """Encodes as a codec of 12.5 frames a second would: the frame count is the clip's."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = False

    async def EncodeVoice(self, request, timeout=None):
        self.calls += 1
        if self.down:
            import grpc

            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="connection refused")
        await asyncio.sleep(0)  # a real call awaits: let concurrent creates interleave
        frames = math.ceil(len(request.audio) / 2 / request.sample_rate_hz * FRAME_RATE)
        return code2wav_pb2.EncodeVoiceResponse(frames=common_pb2.Frames(
            num_frames=frames, num_codebooks=2, codes=bytes(frames * 4)))


class FakePair:
    def __init__(self, name: str = "pair-0") -> None:
        self.name, self.retired, self.in_flight, self.down_until = name, False, 0, 0.0
        self.refusing_until = 0.0
        self.talker_refusing = lambda now: None  # no admission watch
        self.label = f"engine pair {name}"
        self.facts = FakeFacts()
        self.code2wav = FakeCode2Wav()

    async def model_facts(self):
        return self.facts

    def mark_down(self, longest=None):
        self.down_until = 1e18

    def mark_up(self):
        self.down_until = 0.0


def manager_for(folder, *, pairs=None, catalog=None, **voices) -> VoiceManager:
    from services.gateway.routing import Router

    config = GatewayConfig(voices=VoicesSection(store=str(folder), **voices),
                           text=TextSection(language_codes=("en-US", "de-DE")))
    catalog = catalog or VoiceCatalog({"narrator": VoiceEntry("narrator", 0)}, "narrator")
    return VoiceManager.from_config(config, folder.parent, catalog, Router(pairs or [FakePair()]))


def run(coro):
    return asyncio.run(coro)


def test_create_encodes_once_saves_and_is_found_by_name(tmp_path):
    manager = manager_for(tmp_path / "store")
    pair = manager.router.pairs[0]
    voice = run(manager.create("anna", clip("flac", "flac"), "  hello there ", speaker_id=3,
                               language_code="de-DE", description="calm"))
    assert (voice.name, voice.speaker_id, voice.language_code, voice.reference_text) == \
        ("anna", 3, "de-DE", "hello there")
    assert voice.removable and voice.clip.frames.num_frames == 25 and pair.code2wav.calls == 1
    assert voice.model == "voxring-tiny"  # its frames are that model's codes: its requests go there
    assert manager.catalog.get("anna") is voice and [v.name for v in manager.list()] == ["narrator", "anna"]
    with wave.open(str(tmp_path / "store" / "anna.wav")) as stored:
        assert (stored.getnchannels(), stored.getsampwidth(), stored.getframerate()) == (1, 2, 44100)
    turn = run(VoiceCache(manager.catalog).context(voice, pair.facts, pair))
    assert turn[0].frames.num_frames == 25 and pair.code2wav.calls == 1  # no second encode
    assert pair.in_flight == 0  # the pair was released


def test_a_restart_loads_the_folder_and_encodes_on_first_use(tmp_path):
    run(manager_for(tmp_path / "store").create("anna", wav(), "hello"))
    config_anna = VoiceCatalog({"anna": VoiceEntry("anna", 0), "narrator": VoiceEntry("narrator", 0)},
                               "narrator")
    clash = manager_for(tmp_path / "store", catalog=config_anna)
    assert not clash.catalog.get("anna").removable  # the voices file's voice wins
    again = manager_for(tmp_path / "store")
    voice = again.catalog.get("anna")
    assert voice.removable and voice.clip.frames is None and voice.reference_text == "hello"
    assert voice.model == "voxring-tiny"  # kept in its record
    pair = again.router.pairs[0]
    turn = run(VoiceCache(again.catalog).context(voice, pair.facts, pair))
    assert turn[0].frames.num_frames == 25 and voice.clip.frames is not None


def test_a_deleted_voice_still_serves_a_request_that_holds_it(tmp_path):
    run(manager_for(tmp_path / "store").create("anna", wav(), "hello"))
    manager = manager_for(tmp_path / "store")
    held = manager.catalog.get("anna")  # a request validated with it; not encoded since the restart
    manager.delete("anna")
    assert manager.catalog.get("anna") is None and not list((tmp_path / "store").iterdir())
    pair = manager.router.pairs[0]
    turn = run(VoiceCache(manager.catalog).context(held, pair.facts, pair))
    assert turn[0].frames.num_frames == 25
    with pytest.raises(NotFound, match="name: no voice 'anna'"):
        manager.delete("anna")
    with pytest.raises(FailedPrecondition, match="voices file"):
        manager.delete("narrator")


@pytest.mark.parametrize("name", ["", "a b", "ümlaut", "x" * 65, ".hidden", "../up", "a/b"])
def test_names_outside_the_rules_are_refused(tmp_path, name):
    with pytest.raises(InvalidArgument) as info:
        run(manager_for(tmp_path / "store").create(name, wav(), "hello"))
    assert info.value.field == "name"


def test_taken_names_and_concurrent_creates(tmp_path):
    manager = manager_for(tmp_path / "store")
    for name, needle in (("narrator", "exists already"), ("NARRATOR", "differs only in case")):
        with pytest.raises(AlreadyExists, match=needle):
            run(manager.create(name, wav(), "hello"))

    async def both():
        return await asyncio.gather(manager.create("twin", wav(), "one"),
                                    manager.create("twin", wav(), "two"), return_exceptions=True)

    results = run(both())
    assert sum(isinstance(r, VoiceEntry) for r in results) == 1
    assert sum(isinstance(r, AlreadyExists) for r in results) == 1
    assert manager.catalog.get("twin").reference_text == "one"


@pytest.mark.parametrize(("fields", "field", "needle"), [
    (dict(transcript="   "), "transcript", "must not be empty"),
    (dict(transcript="x" * 501), "transcript", "exceeds the limit of 500"),
    (dict(transcript="line\x00break"), "transcript", "printable"),
    (dict(speaker_id=-1), "speaker_id", "0..2147483647"),
    (dict(speaker_id=True), "speaker_id", "integer"),
    (dict(language_code="fr-FR"), "language_code", "unsupported language 'fr-FR'"),
    (dict(description="d" * 257), "description", "limit of 256"),
    (dict(audio=wav(seconds=0.2)), "audio", "shorter"),
])
def test_bad_fields_are_refused_naming_them(tmp_path, fields, field, needle):
    args = {"audio": wav(), "transcript": "hello", **fields}
    with pytest.raises(InvalidArgument) as info:
        run(manager_for(tmp_path / "store").create("anna", **args))
    assert info.value.field == field and needle in info.value.reason
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").iterdir())


def test_a_clip_taking_over_half_the_model_is_refused(tmp_path):
    pair = FakePair()
    pair.facts.max_len = 40  # 2 s is 25 frames: more than 20
    with pytest.raises(InvalidArgument) as info:
        run(manager_for(tmp_path / "store", pairs=[pair]).create("anna", wav(), "hello"))
    assert info.value.field == "audio" and "half of the model's length (40" in info.value.reason


def test_no_folder_no_pair_and_a_full_folder(tmp_path):
    catalog = VoiceCatalog.builtin()
    off = VoiceManager(GatewayConfig(), catalog, None, None)
    with pytest.raises(FailedPrecondition, match=r"voices\.store is null"):
        run(off.create("anna", wav(), "hello"))
    down = FakePair()
    down.code2wav.down = True
    with pytest.raises(Unavailable, match=r"Code2Wav could not encode voice anna \(engine pair pair-0\)$"):
        run(manager_for(tmp_path / "a", pairs=[down]).create("anna", wav(), "hello"))  # the detail: logged
    spare = FakePair("pair-1")
    manager = manager_for(tmp_path / "b", pairs=[down, spare], max_stored=1)
    run(manager.create("anna", wav(), "hello"))  # the second pair encodes it
    assert spare.code2wav.calls == 1
    with pytest.raises(ResourceExhausted, match="at most 1 added voices"):
        run(manager.create("bert", wav(), "hello"))


def test_the_clip_limit_must_fit_in_a_grpc_message(tmp_path):
    from services.common.config import ConfigError
    from services.common.sections import ServerSection
    from services.gateway.config import GatewayServerSection

    assert issubclass(GatewayServerSection, ServerSection)
    config = GatewayConfig(server=GatewayServerSection(max_message_mb=4),
                           voices=VoicesSection(store="v", max_clip_mb=8))
    with pytest.raises(ConfigError, match=r"voices\.max_clip_mb"):
        VoiceManager.from_config(config, tmp_path, VoiceCatalog.builtin(), None)


def test_the_launchers_state_folder_keeps_voices_when_the_config_names_none(tmp_path):
    from voxring.stack import Stack

    catalog = VoiceCatalog.builtin()
    env = Stack(root=tmp_path, config_dir=tmp_path, state_dir=tmp_path / "state").stage_env()
    assert env["VOXRING_STATE_DIR"] == str(tmp_path / "state")
    manager = VoiceManager.from_config(GatewayConfig(), tmp_path / "configs", catalog, None, environ=env)
    assert manager.store.folder == tmp_path / "state" / "voices"
    named = GatewayConfig(voices=VoicesSection(store="mine"))
    named_store = VoiceManager.from_config(named, tmp_path, catalog, None, environ=env).store
    assert named_store.folder == tmp_path / "mine"  # the config's folder wins
    assert VoiceManager.from_config(GatewayConfig(), tmp_path, catalog, None, environ={}).store is None


def test_a_format_1_record_loads_as_a_voice_of_any_model_and_format_2_needs_its_model(tmp_path):
    store = VoiceStore(tmp_path)
    save(store, "old")
    old = json.loads((tmp_path / "old.json").read_text())
    del old["model"]
    (tmp_path / "old.json").write_text(json.dumps({**old, "format": 1}))  # written before models
    save(store, "bare")
    bare = json.loads((tmp_path / "bare.json").read_text())
    del bare["model"]
    (tmp_path / "bare.json").write_text(json.dumps(bare))  # format 2 without its model: refused
    assert [(v.name, v.model) for v in store.load()] == [("old", "")]
    with pytest.raises(StoreError, match=r"missing keys \['model'\]"):
        StoredVoice.from_json(bare)
