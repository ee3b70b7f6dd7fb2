"""Strict configuration: each row is a YAML snippet (and environment) with the value or
the error message it must give."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.code2wav.config import Code2WavConfig
from services.common.config import ConfigError, load_config
from services.gateway.config import GatewayConfig
from services.talker.config import TalkerConfig

REPO = Path(__file__).resolve().parents[2]


def _load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> GatewayConfig:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(GatewayConfig, path, "gateway", environ=env or {})


# (id, yaml, env, getter, expected value)
GOOD = [
    ("bool-true-lower", "logging: {json: true}", {}, lambda c: c.logging.json, True),
    ("bool-TRUE-upper", "logging: {json: TRUE}", {}, lambda c: c.logging.json, True),
    ("bool-False-mixed", "logging: {json: fAlSe}", {}, lambda c: c.logging.json, False),
    ("bool-one", "logging: {json: 1}", {}, lambda c: c.logging.json, True),
    ("bool-zero", "logging: {json: 0}", {}, lambda c: c.logging.json, False),
    ("bool-quoted-true", "logging: {json: 'True'}", {}, lambda c: c.logging.json, True),
    ("null-key-is-default", "server: {drain_timeout: null}", {},
     lambda c: c.server.drain_timeout, 30.0),
    ("null-section-is-default", "logging: null", {}, lambda c: c.logging.level, "info"),
    ("empty-file-is-default", "", {}, lambda c: c, GatewayConfig()),
    ("int-for-float", "server: {grace: 2}", {}, lambda c: c.server.grace, 2.0),
    ("float-exponent-yaml12", "server: {grace: 1e-1}", {}, lambda c: c.server.grace, 0.1),
    ("leading-zero-is-decimal", "server: {max_message_mb: 010}", {},
     lambda c: c.server.max_message_mb, 10),
    ("on-stays-a-string", "text: {language_codes: [on]}", {},
     lambda c: c.text.language_codes, ("on",)),
    ("list-of-ints", "audio: {sample_rates: [16000, 24000]}", {},
     lambda c: c.audio.sample_rates, (16000, 24000)),
    ("env-overrides-nested-key", "server: {drain_timeout: 3}",
     {"VOXRING_GATEWAY__SERVER__DRAIN_TIMEOUT": "7.5"}, lambda c: c.server.drain_timeout, 7.5),
    ("env-bool-any-case", "", {"VOXRING_GATEWAY__LOGGING__JSON": "TRUE"},
     lambda c: c.logging.json, True),
    ("env-null-restores-default", "server: {drain_timeout: 3}",
     {"VOXRING_GATEWAY__SERVER__DRAIN_TIMEOUT": "null"}, lambda c: c.server.drain_timeout, 30.0),
    ("env-list", "", {"VOXRING_GATEWAY__AUDIO__SAMPLE_RATES": "[8000, 48000]"},
     lambda c: c.audio.sample_rates, (8000, 48000)),
    ("env-other-stage-ignored", "", {"VOXRING_TALKER__SERVER__NOPE": "1"},
     lambda c: c.server.drain_timeout, 30.0),
]


@pytest.mark.parametrize(("text", "env", "get", "expected"),
                         [row[1:] for row in GOOD], ids=[row[0] for row in GOOD])
def test_good_values(tmp_path, text, env, get, expected):
    assert get(_load(tmp_path, text, env)) == expected


# (id, yaml, env, substrings the message must contain)
BAD = [
    ("bool-typo", "logging: {json: ture}", {}, ["gateway.yaml", "logging.json", "boolean", "'ture'"]),
    ("bool-free-text", "logging: {json: yes please}", {}, ["logging.json", "'yes please'"]),
    ("bool-yaml11-yes", "logging: {json: yes}", {}, ["logging.json", "'yes'"]),
    ("bool-yaml11-no", "logging: {json: no}", {}, ["logging.json", "'no'"]),
    ("bool-yaml11-on", "logging: {json: on}", {}, ["logging.json", "'on'"]),
    ("bool-yaml11-off", "logging: {json: off}", {}, ["logging.json", "'off'"]),
    ("bool-two", "logging: {json: 2}", {}, ["logging.json", "boolean"]),
    ("unknown-key", "server: {lisen: 127.0.0.1:1}", {}, ["gateway.yaml", "server", "unknown key lisen"]),
    ("unknown-section", "sever: {listen: 127.0.0.1:1}", {}, ["gateway.yaml", "unknown section sever"]),
    ("wrong-type-number", "server: {drain_timeout: soon}", {},
     ["server.drain_timeout", "expected a number", "'soon'"]),
    ("float-for-int", "server: {max_message_mb: 1.5}", {}, ["server.max_message_mb", "integer"]),
    ("bool-for-int", "server: {max_message_mb: true}", {}, ["server.max_message_mb", "integer"]),
    ("quoted-int", "server: {max_message_mb: '5'}", {}, ["server.max_message_mb", "integer"]),
    ("scalar-for-list", "text: {language_codes: en-US}", {}, ["text.language_codes", "list"]),
    ("section-not-mapping", "server: 5", {}, ["gateway.yaml", "server", "mapping"]),
    ("bad-port", "server: {listen: '127.0.0.1:70000'}", {}, ["server.listen", "port"]),
    ("negative-timeout", "server: {drain_timeout: -1}", {}, ["server.drain_timeout", ">= 0"]),
    ("bad-level", "logging: {level: loud}", {}, ["logging.level", "loud"]),
    ("duplicate-key", "server: {grace: 1, grace: 2}", {}, ["gateway.yaml", "duplicate key 'grace'"]),
    ("top-level-list", "- 1", {}, ["gateway.yaml", "mapping"]),
    ("syntax-error", "server: {grace: [1", {}, ["gateway.yaml", "invalid YAML"]),
    ("env-bool-typo", "", {"VOXRING_GATEWAY__LOGGING__JSON": "ture"},
     ["VOXRING_GATEWAY__LOGGING__JSON", "boolean", "'ture'"]),
    ("env-yaml11-on", "", {"VOXRING_GATEWAY__LOGGING__JSON": "on"},
     ["VOXRING_GATEWAY__LOGGING__JSON", "'on'"]),
    ("env-wrong-type", "", {"VOXRING_GATEWAY__SERVER__GRACE": "abc"},
     ["VOXRING_GATEWAY__SERVER__GRACE", "number"]),
    ("env-unknown-key", "", {"VOXRING_GATEWAY__SERVER__GRAIC": "1"},
     ["VOXRING_GATEWAY__SERVER__GRAIC", "unknown key server.graic"]),
    ("env-unknown-section", "", {"VOXRING_GATEWAY__SERVR__GRACE": "1"},
     ["VOXRING_GATEWAY__SERVR__GRACE", "unknown section servr"]),
    ("env-malformed-name", "", {"VOXRING_GATEWAY__GRACE": "1"},
     ["VOXRING_GATEWAY__GRACE", "<SECTION>__<KEY>"]),
    ("env-invalid-value", "", {"VOXRING_GATEWAY__SERVER__LISTEN": "nowhere"},
     ["VOXRING_GATEWAY__SERVER__LISTEN", "HOST:PORT"]),
]


@pytest.mark.parametrize(("text", "env", "needles"),
                         [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_bad_values(tmp_path, text, env, needles):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text, env)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read config"):
        load_config(GatewayConfig, tmp_path / "nope.yaml", "gateway", environ={})


def test_config_is_frozen(tmp_path):
    config = _load(tmp_path, "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.listen = "0.0.0.0:1"


@pytest.mark.parametrize(("stage", "cls"), [("gateway", GatewayConfig), ("talker", TalkerConfig),
                                            ("code2wav", Code2WavConfig)])
def test_shipped_configs_load_and_document_the_defaults(stage, cls):
    """deploy/configs/<stage>.yaml loads, and its values are the code's defaults (so the
    comments in the file tell the truth), except the voices file the gateway names."""
    loaded = load_config(cls, REPO / "deploy" / "configs" / f"{stage}.yaml", stage, environ={})
    if stage == "gateway":
        assert loaded.voices.file == "voices.yaml"
        loaded = dataclasses.replace(loaded, voices=cls().voices)
    assert loaded == cls()


def test_internal_stages_default_to_loopback():
    from services.common.sections import is_loopback

    for cls in (GatewayConfig, TalkerConfig, Code2WavConfig):
        assert is_loopback(cls().server.listen)
    assert GatewayConfig().server.listen == "127.0.0.1:50051"
