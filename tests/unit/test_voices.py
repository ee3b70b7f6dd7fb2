"""The voices file is read as strictly as the stage configs; its aliases (OpenAI's voice names
by default) resolve wherever a voice name is taken, and are listed with their voice."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import numpy as np
import pytest

from services.common.config import ConfigError
from services.common.errors import AlreadyExists, InvalidArgument
from services.gateway.audio import wav_bytes
from services.gateway.config import GatewayConfig, VoicesSection
from services.gateway.servicer import SynthesizerServicer
from services.gateway.streaming_config import session_settings
from services.gateway.validation import validate
from services.gateway.voice_manager import VoiceManager
from services.gateway.voice_store import StoredVoice, VoiceStore
from services.gateway.voices import OPENAI_VOICES, VoiceCatalog, VoiceEntry
from voxring.v1 import synthesizer_pb2 as pb
from voxring.voices import voices_of


def _load(tmp_path, text):
    path = tmp_path / "voices.yaml"
    path.write_text(text)
    return VoiceCatalog.load(path)


def test_good_file_with_reference_clip(tmp_path):
    (tmp_path / "ref.wav").write_bytes(b"RIFF")
    catalog = _load(tmp_path, "voices:\n  - {name: a, speaker_id: 0}\n"
                              "  - {name: b, speaker_id: 3, reference_audio: ref.wav,"
                              " reference_text: hello}\n")
    assert catalog.default == "a"
    assert catalog.get("").name == "a" and catalog.get("b").speaker_id == 3
    assert catalog.get("c") is None


@pytest.mark.parametrize(("text", "needle"), [
    ("voices: []\n", "needs at least one voice"),
    ("{}\n", "missing required key voices"),
    ("voices:\n  - {name: a, speaker_id: 0}\n  - {name: a, speaker_id: 1}\n", "duplicate voice names: a"),
    ("default_voice: z\nvoices:\n  - {name: a, speaker_id: 0}\n", "default_voice: 'z' is not a voice"),
    ("voices:\n  - {name: a, speaker_id: 0, reference_text: hi}\n", "go together"),
    ("voices:\n  - {name: a, speaker_id: 0, reference_audio: none.wav, reference_text: hi}\n",
     "'none.wav' does not exist"),
    ("voices:\n  - {name: a, speaker: 0}\n", "unknown key speaker"),
    ("voices:\n  - {name: a, speaker_id: '0'}\n", "speaker_id: expected an integer"),
    ("- a\n", "expected a mapping"),
])
def test_bad_voices_files(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    assert needle in str(info.value) and "voices.yaml" in str(info.value)


# --- aliases: other names of the voices-file voices (OpenAI's by default) ----------------------

TWO = "voices:\n  - {name: a, speaker_id: 0}\n  - {name: b, speaker_id: 1}\n"


def test_openais_voice_names_spread_over_the_voices_by_default(tmp_path):
    catalog = _load(tmp_path, TWO)
    assert list(catalog.aliases) == list(OPENAI_VOICES)  # all eleven, in OpenAI's order
    assert catalog.aliases_of("a") == ["alloy", "ballad", "echo", "nova", "sage", "verse"]
    assert catalog.aliases_of("b") == ["ash", "coral", "fable", "onyx", "shimmer"]
    assert catalog.get("alloy").name == "a" and catalog.get("shimmer").name == "b"
    builtin = VoiceCatalog.builtin()  # voices.file null: every name is "default"'s
    assert builtin.aliases_of("default") == list(OPENAI_VOICES) and builtin.get("verse").name == "default"


def test_a_voice_named_like_openais_is_itself_and_no_alias(tmp_path):
    catalog = _load(tmp_path, "voices:\n  - {name: a, speaker_id: 0}\n  - {name: nova, speaker_id: 4}\n")
    assert "nova" not in catalog.aliases and catalog.get("nova").speaker_id == 4
    assert catalog.alias_of("nova") is None and catalog.alias_of("alloy") == "a"


def test_the_file_sets_its_own_aliases_or_none(tmp_path):
    catalog = _load(tmp_path, TWO + "aliases:\n  - {name: alloy, voice: b}\n  - {name: narrator, voice: a}\n")
    assert catalog.aliases == {"alloy": "b", "narrator": "a"}
    assert catalog.get("alloy").name == "b" and catalog.get("narrator").name == "a"
    assert catalog.get("ash") is None  # not in the list: not an alias
    assert _load(tmp_path, TWO + "aliases: []\n").aliases == {}
    assert _load(tmp_path, TWO + "aliases: null\n").aliases["alloy"] == "a"  # null: the default


def test_a_voice_wins_over_an_alias_of_its_name():
    """A voice added through the API under an alias's name (one kept from before aliases) shadows it."""
    catalog = VoiceCatalog.builtin()
    catalog.add(VoiceEntry(name="alloy", speaker_id=7))
    assert catalog.get("alloy").speaker_id == 7 and catalog.get("ash").name == "default"
    assert "alloy" not in catalog.aliases_of("default") and catalog.alias_of("alloy") is None


@pytest.mark.parametrize(("aliases", "needle"), [
    ("  - {name: alloy, voice: c}\n", "aliases[0].voice: 'c' (for 'alloy') is not a voice here"),
    ("  - {name: x, voice: a}\n  - {name: alloy, voice: nobody}\n", "aliases[1].voice: 'nobody'"),
    ("  - {name: b, voice: a}\n", "aliases[0].name: 'b' is a voice already"),
    ("  - {name: x, voice: a}\n  - {name: x, voice: b}\n", "aliases[1].name: 'x' is an alias already"),
    ("  - {name: ' x', voice: a}\n", "aliases[0].name: must be non-empty"),
    ("  - {name: x}\n", "aliases[0]: missing required key voice"),
    ("  - {name: x, voice: a, speaker_id: 1}\n", "unknown key speaker_id"),
])
def test_bad_aliases_are_config_errors_naming_the_key(tmp_path, aliases, needle):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, TWO + "aliases:\n" + aliases)
    assert needle in str(info.value) and "voices.yaml" in str(info.value), str(info.value)


def test_every_request_path_resolves_an_alias_and_names_voice_for_an_unknown_one(tmp_path):
    catalog = _load(tmp_path, TWO)
    config = GatewayConfig()
    valid = validate(pb.SynthesizeSpeechRequest(text="hi", voice_name="ash"), config, catalog)
    assert valid.voice.name == "b"  # gRPC's voice_name and HTTP's voice
    session = session_settings(pb.StreamingConfig(voice_name="alloy"), config, catalog)
    assert session.valid.voice.name == "a"  # StreamingSynthesize and the WebSocket's config
    with pytest.raises(InvalidArgument) as info:
        validate(pb.SynthesizeSpeechRequest(text="hi", voice_name="Alloy"), config, catalog)
    assert info.value.field == "voice_name" and "aliases: alloy, ash" in info.value.reason


def test_listings_show_each_voices_aliases(tmp_path):
    catalog = _load(tmp_path, TWO)
    servicer = SynthesizerServicer(GatewayConfig(), catalog, backend=None)
    listed = asyncio.run(servicer.ListVoices(pb.ListVoicesRequest(), None))
    assert {v.name: list(v.aliases) for v in listed.voices} == {
        "a": catalog.aliases_of("a"), "b": catalog.aliases_of("b")}
    sdk = voices_of(listed)
    assert sdk[1].aliases == ("ash", "coral", "fable", "onyx", "shimmer")


def _manager(tmp_path, catalog) -> VoiceManager:
    config = GatewayConfig(voices=VoicesSection(store=str(tmp_path / "store")))
    return VoiceManager(config, catalog, None, VoiceStore(tmp_path / "store"))


def test_creating_a_voice_named_like_an_alias_is_refused_naming_name(tmp_path):
    manager = _manager(tmp_path, VoiceCatalog.builtin())
    with pytest.raises(AlreadyExists) as info:
        asyncio.run(manager.create("alloy", b"RIFF", "hello there"))
    assert str(info.value).startswith("name: 'alloy' is an alias of the voice 'default'")
    assert not manager._pending and manager.catalog.get("alloy").name == "default"


def test_a_stored_voice_named_like_an_alias_is_kept_and_shadows_it(tmp_path, caplog):
    wav = wav_bytes(np.zeros(24000, np.int16).tobytes(), 24000)
    record = StoredVoice(name="echo", speaker_id=2, language_code="en-US", description="", transcript="hi",
                         sha256=hashlib.sha256(wav).hexdigest(), sample_rate_hz=24000, seconds=1.0,
                         created_at="2024-01-01T00:00:00.000+00:00")
    VoiceStore(tmp_path / "store").save(record, wav)
    manager = _manager(tmp_path, VoiceCatalog.builtin())
    with caplog.at_level(logging.WARNING):
        assert manager.load() == 1
    assert manager.catalog.get("echo").speaker_id == 2 and "also an alias of the voice default" in caplog.text
    assert "echo" not in manager.catalog.aliases_of("default")
