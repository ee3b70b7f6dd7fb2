"""The gateway's TLS (``server.tls_cert``/``tls_key``) and bearer token
(``auth.token_file``) against real processes: a talker, a Code2Wav and a gateway serving
TLS on a free loopback port with a throwaway CA (trustme). Synthesis through the SDK and
the CLI with the CA and the token; plaintext, missing and wrong tokens refused; gRPC
health open without a token (``voxring health``); the token never in the gateway's
debug log; bad TLS or token settings stop start-up naming the key."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from models.tiny.talker import ensure_tiny_checkpoint
from tests.conftest import REPO, StageGroup, stage_env
from voxring import errors
from voxring.cli import main as cli_main
from voxring.client import AsyncClient, Client

trustme = pytest.importorskip("trustme")

# Unique per run, so that "not in the log" means something.
TOKEN = f"vx-token-{secrets.token_hex(16)}"
WRONG = f"vx-wrong-{secrets.token_hex(16)}"
CLI_TIMEOUT_S = 30.0  # bound on any CLI subprocess


def _write_pki(folder: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for localhost and 127.0.0.1."""
    ca = trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    paths = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    return paths


@pytest.fixture(scope="module")
def stack(model_cache):
    """talker + Code2Wav on unix sockets, the gateway on 127.0.0.1:<free port> with TLS
    and a token, debug logging; one stack for the whole module."""
    ensure_tiny_checkpoint(root=model_cache / "models")  # made once, before timed starts
    d = Path(tempfile.mkdtemp(prefix="vx-sec-", dir="/tmp"))  # short: unix socket paths
    pki = _write_pki(d)
    (d / "token").write_text(TOKEN + "\n")  # the newline is stripped
    configs = {
        "talker": f"server: {{listen: 'unix:{d}/talker.sock', drain_timeout: 5, grace: 1}}\n"
                  f"engine: {{k_max: 4, buckets: [1, 2, 4], max_num_seqs: 4, max_len: 256}}\n",
        "code2wav": f"server: {{listen: 'unix:{d}/code2wav.sock', drain_timeout: 5, grace: 1}}\n"
                    f"engine: {{max_slots: 8}}\n"
                    f"talkers: {{attach: [{{id: talker-0, address: 'unix:{d}/talker.sock'}}]}}\n",
        "gateway": f"server: {{listen: '127.0.0.1:0', drain_timeout: 5, grace: 1,"
                   f" tls_cert: '{pki['cert']}', tls_key: '{pki['key']}'}}\n"
                   f"auth: {{token_file: token}}\n"  # relative to the config file's folder
                   f"logging: {{level: debug}}\n"
                   f"engines: {{pairs: [{{talker: 'unix:{d}/talker.sock',"
                   f" code2wav: 'unix:{d}/code2wav.sock'}}]}}\n"
                   f"limits: {{default_audio_seconds: 0.5}}\n",
    }
    stages = StageGroup(d)
    try:
        for stage in ("talker", "code2wav", "gateway"):
            address = stages.start(stage, configs[stage], timeout=60).address
        yield {"address": address, "port": int(address.rpartition(":")[2]), "dir": d,
               "ca": pki["ca"].read_bytes(), "ca_path": pki["ca"], "token_path": d / "token"}
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


def _secure_channel(stack, root_certificates: bytes | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates or stack["ca"])
    return grpc.secure_channel(stack["address"], credentials)


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- TLS and the token through the SDK ------------------------------------------------------


def test_tls_and_token_synthesize(stack):
    with Client(stack["address"], token=TOKEN, root_certificates=stack["ca"], timeout=60) as client:
        assert client.tls and TOKEN not in repr(client)
        result = client.synthesize("Hello over TLS.", encoding="wav", seed=7, max_audio_seconds=0.4)
        assert result.audio[:4] == b"RIFF" and result.usage.frames > 0
        with client.stream("Streaming too.", seed=7, max_audio_seconds=0.4) as stream:
            chunks = list(stream)
        assert chunks and stream.result is not None and stream.result.usage.frames > 0
        assert [v.name for v in client.voices()] == ["default"]


def test_async_client_with_tls_and_token(stack):
    async def scenario():
        async with AsyncClient(stack["address"], token=TOKEN, root_certificates=stack["ca"],
                               timeout=30) as client:
            voices = await client.voices()
            with pytest.raises(errors.Unauthenticated):
                async with AsyncClient(stack["address"], root_certificates=stack["ca"],
                                       timeout=30) as anonymous:
                    await anonymous.voices()
            return voices

    assert asyncio.run(scenario()).default_voice == "default"


def test_tls_server_name_override_and_certificate_check(stack):
    # The certificate names localhost and 127.0.0.1: the override to "localhost" passes...
    with Client(stack["address"], token=TOKEN, root_certificates=stack["ca"],
                tls_server_name="localhost", timeout=10) as client:
        assert client.voices().default_voice == "default"
    # ...a name the certificate does not carry fails the handshake.
    with Client(stack["address"], token=TOKEN, root_certificates=stack["ca"],
                tls_server_name="not-the-server.example", timeout=10) as client, \
            pytest.raises(errors.Unavailable):
        client.voices()


def test_untrusted_certificate_is_refused(stack):
    other_ca = trustme.CA().cert_pem.bytes()
    with Client(stack["address"], token=TOKEN, root_certificates=other_ca, timeout=10) as client, \
            pytest.raises(errors.Unavailable):
        client.voices()


def test_plaintext_client_cannot_talk_to_the_tls_gateway(stack):
    with Client(stack["address"], token=TOKEN, timeout=5) as client, pytest.raises(errors.Unavailable):
        client.voices()


@pytest.mark.parametrize("call", ["voices", "synthesize", "stream"])
def test_missing_token_is_unauthenticated(stack, call):
    with Client(stack["address"], root_certificates=stack["ca"], timeout=10) as client, \
            pytest.raises(errors.Unauthenticated) as info:
        if call == "voices":
            client.voices()
        elif call == "synthesize":
            client.synthesize("Hello.")
        else:
            list(client.stream("Hello."))
    assert info.value.code == "UNAUTHENTICATED"
    assert "authorization: Bearer <token>" in info.value.message
    assert TOKEN not in info.value.message


# ids, not the values: the tokens are random (every xdist worker must collect the same ids)
# and a secret has no business in a test report
@pytest.mark.parametrize("token", [WRONG, TOKEN + "x", TOKEN[:-1], "x"],
                         ids=["other-token", "token-and-more", "token-short-by-one", "x"])
def test_wrong_token_is_unauthenticated(stack, token):
    with Client(stack["address"], token=token, root_certificates=stack["ca"], timeout=10) as client, \
            pytest.raises(errors.Unauthenticated) as info:
        client.voices()
    assert info.value.message == "invalid bearer token"


@pytest.mark.parametrize("value", ["Basic " + TOKEN, TOKEN, "Bearer", "Bearer   "],
                         ids=["basic-scheme", "no-scheme", "bearer-no-token", "bearer-blank-token"])
def test_malformed_authorization_is_unauthenticated(stack, value):
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with _secure_channel(stack) as channel:  # a stream-stream method: reflection
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(reflect.ServerReflectionInfo(iter([request]), timeout=10,
                                              metadata=[("authorization", value)]))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in info.value.details()


def test_bearer_scheme_is_case_insensitive(stack):
    with Client(stack["address"], metadata=[("authorization", f"bearer {TOKEN}")],
                root_certificates=stack["ca"], timeout=10) as client:
        assert client.voices().default_voice == "default"


def test_reflection_needs_the_token(stack):
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with _secure_channel(stack) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10,
                                                 metadata=[("authorization", f"Bearer {TOKEN}")]))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "voxring.v1.Synthesizer" in names


@pytest.mark.parametrize("service", ["", "voxring.v1.Synthesizer"])
def test_health_needs_no_token(stack, service):
    with _secure_channel(stack) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- the CLI ---------------------------------------------------------------------------------


def _voxring(*args: str, timeout: float = CLI_TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "voxring.cli", *args], cwd=REPO, env=stage_env(),
                            capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def test_health_command_against_the_tls_gateway(stack):
    result, _ = _voxring("health", stack["address"], "--tls-ca", str(stack["ca_path"]))
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING"), result.stderr
    result, _ = _voxring("health", f"localhost:{stack['port']}", "--tls-ca", str(stack["ca_path"]),
                         "--service", "voxring.v1.Synthesizer", "--tls-server-name", "localhost")
    assert (result.returncode, result.stdout.strip()) == (0, "SERVING"), result.stderr


def test_health_command_fails_cleanly(stack):
    checks = [
        # nothing listens there: exit 1 within the deadline
        (["health", f"127.0.0.1:{_free_port()}", "--timeout", "2"], "UNAVAILABLE"),
        (["health", f"unix:{stack['dir']}/nobody.sock", "--timeout", "2"], "UNAVAILABLE"),
        # plaintext against TLS
        (["health", stack["address"], "--timeout", "2"], "UNAVAILABLE"),
        # a service the gateway does not have
        (["health", stack["address"], "--tls-ca", str(stack["ca_path"]), "--service", "nope.Nope"],
         "NOT_FOUND"),
    ]
    for args, needle in checks:
        result, _ = _voxring(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert needle in result.stderr + result.stdout, (args, result.stderr)
    result, _ = _voxring("health", stack["address"], "--tls-ca", str(stack["dir"] / "missing.pem"))
    assert result.returncode == 2 and "--tls-ca" in result.stderr and "cannot read" in result.stderr


def test_health_command_stays_light(stack):
    """The probe path imports neither torch nor the services."""
    probe = ("import sys; from voxring.cli import main; rc = main(sys.argv[1:]); "
             "bad = [m for m in ('torch', 'services', 'numpy') if m in sys.modules]; "
             "print('heavy:', bad); sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", probe, "health", stack["address"], "--tls-ca",
                             str(stack["ca_path"])], cwd=REPO, env=stage_env(), capture_output=True,
                            text=True, timeout=CLI_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout


def test_cli_say_and_voices_with_token_file_and_ca(stack, tmp_path, capsys, monkeypatch):
    tls = ["--target", stack["address"], "--tls-ca", str(stack["ca_path"])]
    out = tmp_path / "hello.wav"
    assert cli_main(["say", "Hello.", "-o", str(out), "--seed", "3", "--token-file",
                     str(stack["token_path"]), *tls]) == 0, capsys.readouterr().err
    assert out.read_bytes()[:4] == b"RIFF"
    monkeypatch.delenv("VOXRING_TOKEN_FILE", raising=False)
    capsys.readouterr()
    assert cli_main(["voices", *tls]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("VOXRING_TOKEN_FILE", str(stack["token_path"]))  # the default of --token-file
    assert cli_main(["voices", *tls, "--tls-server-name", "localhost"]) == 0
    assert "default" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert cli_main(["voices", *tls, "--token-file", str(empty)]) == 2
    assert "--token-file" in (err := capsys.readouterr().err) and "empty" in err
    monkeypatch.setenv("VOXRING_TOKEN_FILE", str(tmp_path / "missing"))
    assert cli_main(["voices", *tls]) == 2
    assert "$VOXRING_TOKEN_FILE" in (err := capsys.readouterr().err) and "cannot read" in err
    wrong = tmp_path / "wrong"
    wrong.write_text(WRONG)
    assert cli_main(["bench", "--requests", "1", "--token-file", str(wrong), *tls]) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and WRONG not in err


def test_the_token_never_reaches_the_log(stack):
    """With debug logging, after right, wrong and missing tokens: neither the token nor
    what a caller sent appears in the gateway's log (the refusals do)."""
    for token in (TOKEN, WRONG, None):
        with Client(stack["address"], token=token, root_certificates=stack["ca"], timeout=10) as client:
            try:
                client.voices()
            except errors.Unauthenticated:
                assert token != TOKEN
    log = (stack["dir"] / "gateway.log").read_text(errors="replace")
    assert " DEBUG " in log, "the gateway does not log at debug level"
    assert "UNAUTHENTICATED" in log and "bearer-token authentication on" in log
    assert TOKEN not in log and WRONG not in log
    for stage in ("talker", "code2wav"):
        assert TOKEN not in (stack["dir"] / f"{stage}.log").read_text(errors="replace")


# --- start-up errors -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki_dir():
    d = Path(tempfile.mkdtemp(prefix="vx-pki-", dir="/tmp"))
    paths = _write_pki(d)
    (d / "empty-token").write_text("  \n")
    yield d, paths
    shutil.rmtree(d, ignore_errors=True)


BAD_STARTS = [
    ("cert-without-key", "server: {{tls_cert: '{cert}'}}", ["server.tls_key", "tls_cert is set"]),
    ("key-without-cert", "server: {{tls_key: '{key}'}}", ["server.tls_cert", "tls_key is set"]),
    ("missing-cert-file", "server: {{tls_cert: '{dir}/nope.pem', tls_key: '{key}'}}",
     ["server.tls_cert", "nope.pem", "No such file"]),
    ("key-is-not-a-key", "server: {{tls_cert: '{cert}', tls_key: '{cert}'}}", ["server.tls_key"]),
    ("empty-token-file", "auth: {{token_file: '{dir}/empty-token'}}", ["auth.token_file", "empty"]),
    ("missing-token-file", "auth: {{token_file: no-such-token}}", ["auth.token_file", "cannot read"]),
]


@pytest.mark.parametrize(("text", "needles"), [row[1:] for row in BAD_STARTS],
                         ids=[row[0] for row in BAD_STARTS])
def test_bad_tls_or_token_settings_stop_start_up(pki_dir, tmp_path, text, needles):
    d, paths = pki_dir
    config = tmp_path / "gateway.yaml"
    config.write_text("server: {listen: '127.0.0.1:0'}\n" if "server:" not in text else "")
    config.write_text(config.read_text() + text.format(cert=paths["cert"], key=paths["key"], dir=d)
                      + "\nengines: {pairs: [{talker: 'unix:/nonexistent/t.sock',"
                        " code2wav: 'unix:/nonexistent/c.sock'}]}\n")
    result = subprocess.run([sys.executable, "-m", "services.gateway", "--config", str(config)],
                            cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "config error" in result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in {result.stderr!r}"
