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
    ("tls-off-by-default", "", {}, lambda c: (c.server.tls_cert, c.server.tls_key), (None, None)),
    ("tls-both-keys", "server: {tls_cert: tls/cert.pem, tls_key: /etc/tls/key.pem}", {},
     lambda c: (c.server.tls_cert, c.server.tls_key), ("tls/cert.pem", "/etc/tls/key.pem")),
    ("tls-from-env", "server: {tls_cert: c.pem}", {"VOXRING_GATEWAY__SERVER__TLS_KEY": "k.pem"},
     lambda c: c.server.tls_key, "k.pem"),
    ("auth-off-by-default", "", {}, lambda c: c.auth.token_file, None),
    ("auth-token-file", "auth: {token_file: secrets/token}", {}, lambda c: c.auth.token_file,
     "secrets/token"),
    ("auth-token-file-env", "", {"VOXRING_GATEWAY__AUTH__TOKEN_FILE": "/run/secrets/token"},
     lambda c: c.auth.token_file, "/run/secrets/token"),
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
    ("tls-cert-without-key", "server: {tls_cert: cert.pem}", {},
     ["gateway.yaml", "server.tls_key", "missing", "tls_cert is set"]),
    ("tls-key-without-cert", "server: {tls_key: key.pem}", {},
     ["gateway.yaml", "server.tls_cert", "missing", "tls_key is set"]),
    ("tls-empty-cert", "server: {tls_cert: '', tls_key: key.pem}", {}, ["server.tls_cert", "empty"]),
    ("tls-cert-not-a-string", "server: {tls_cert: 5, tls_key: key.pem}", {},
     ["server.tls_cert", "string"]),
    ("env-tls-cert-alone", "", {"VOXRING_GATEWAY__SERVER__TLS_CERT": "/tls/cert.pem"},
     ["server.tls_key", "missing"]),
    ("auth-empty-token-file", "auth: {token_file: ''}", {}, ["gateway.yaml", "auth.token_file", "empty"]),
    ("auth-token-file-list", "auth: {token_file: [a]}", {}, ["auth.token_file", "string"]),
    ("auth-unknown-key", "auth: {token: abc}", {}, ["auth", "unknown key token", "token_file"]),
    ("env-auth-empty", "", {"VOXRING_GATEWAY__AUTH__TOKEN_FILE": "''"},
     ["VOXRING_GATEWAY__AUTH__TOKEN_FILE", "empty"]),
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


@pytest.mark.parametrize(("stage", "cls"), [("talker", TalkerConfig), ("code2wav", Code2WavConfig)])
def test_internal_stages_refuse_tls(tmp_path, stage, cls):
    """Their peers connect in plaintext: TLS there would only break the stack."""
    path = tmp_path / f"{stage}.yaml"
    path.write_text("server: {tls_cert: c.pem, tls_key: k.pem}")
    with pytest.raises(ConfigError, match=r"server\.tls_cert: TLS is served by the gateway only"):
        load_config(cls, path, stage, environ={})


# --- the files behind server.tls_* and auth.token_file (read at start-up) --------------------


@pytest.fixture
def pki(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ca.issue_cert("localhost")
    paths = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "other_key", "enc_key")}
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(paths["key"]))
    ca.issue_cert("other").private_key_pem.write_to_path(str(paths["other_key"]))
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(server.private_key_pem.bytes(), None)
    paths["enc_key"].write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")))
    return paths


def test_tls_files_are_read_and_checked(pki):
    from services.common.sections import ServerSection, read_tls_files

    assert read_tls_files(ServerSection()) is None
    key, cert = read_tls_files(ServerSection(tls_cert=str(pki["cert"]), tls_key=str(pki["key"])))
    assert key == pki["key"].read_bytes() and cert == pki["cert"].read_bytes()


def test_tls_file_errors_name_the_key(pki, tmp_path, monkeypatch):
    from services.common.sections import ServerSection, read_tls_files

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a PEM file\n")
    fake_cert = tmp_path / "fake-cert.pem"
    fake_cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    cert, key = str(pki["cert"]), str(pki["key"])
    monkeypatch.chdir(tmp_path)
    cases = [
        (dict(tls_cert="missing.pem", tls_key=key),
         ["server.tls_cert", "cannot read", str(tmp_path / "missing.pem"), "No such file"]),
        (dict(tls_cert=cert, tls_key=str(tmp_path / "missing-key.pem")), ["server.tls_key", "cannot read"]),
        (dict(tls_cert=str(tmp_path), tls_key=key), ["server.tls_cert", "cannot read"]),
        (dict(tls_cert=str(garbage), tls_key=key), ["server.tls_cert", "no PEM certificate"]),
        (dict(tls_cert=str(fake_cert), tls_key=key), ["server.tls_cert", "not a valid PEM certificate"]),
        (dict(tls_cert=key, tls_key=key), ["server.tls_cert", "no PEM certificate"]),
        (dict(tls_cert=cert, tls_key=cert), ["server.tls_key", "no PEM private key"]),
        (dict(tls_cert=cert, tls_key=str(pki["other_key"])),
         ["server.tls_key", "is not the private key of the certificate"]),
        (dict(tls_cert=cert, tls_key=str(pki["enc_key"])), ["server.tls_key", "encrypted"]),
    ]
    for fields, needles in cases:
        with pytest.raises(ConfigError) as info:
            read_tls_files(ServerSection(**fields))
        for needle in needles:
            assert needle in str(info.value), (fields, str(info.value))


def test_token_file_is_stripped_and_checked(tmp_path):
    from services.common.auth import BearerTokenInterceptor, read_token_file

    path = tmp_path / "token"
    path.write_text("  abc.DEF-123_~+/=  \n")
    assert read_token_file(path) == "abc.DEF-123_~+/="
    assert "abc" not in repr(BearerTokenInterceptor("abc.DEF-123"))
    cases = [
        (b"", "is empty"), (b" \n\t\n", "is empty"), (b"two words", "one word"),
        (b"line1\nline2", "one word"), ("t\u00f6ken".encode(), "printable ASCII"),
    ]
    for content, needle in cases:
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=needle) as info:
            read_token_file(path)
        assert str(info.value).startswith("auth.token_file: ")
        if content.strip():  # the message never shows the file's content
            assert content.decode("utf-8").split()[0] not in str(info.value)
    with pytest.raises(ConfigError, match=r"auth\.token_file: cannot read .*No such file"):
        read_token_file(tmp_path / "missing")


@pytest.mark.parametrize(("text", "needle", "variable", "raw", "want"), [
    ("engine: {first_audio_headroom: -0.5}", r"engine\.first_audio_headroom: must be in \[0, 10\), got -0\.5",
     "VOXRING_TALKER__ENGINE__FIRST_AUDIO_HEADROOM", "0.25", 0.25),
])
def test_the_talker_names_a_bad_value_and_takes_a_good_one_by_environment(tmp_path, text, needle, variable,
                                                                         raw, want):
    from services.talker.config import TalkerConfig

    path = tmp_path / "talker.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(TalkerConfig, path, "talker", environ={})
    loaded = load_config(TalkerConfig, path, "talker", environ={variable: raw})
    section, key = variable.split("__")[1:]
    assert getattr(getattr(loaded, section.lower()), key.lower()) == want
