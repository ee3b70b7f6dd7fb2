"""The OpenAI-compatible HTTP API against real processes: a talker, a Code2Wav and gateways
whose ``http.listen`` is 127.0.0.1:0 (read from their ready files), driven as users drive it:
the official ``openai`` client, curl and plain HTTP.

One stack for the module: the pair, an open gateway (the audio formats, streaming, SSE,
bad inputs, body limit, duplicate ids, disconnects, voices), a second gateway with TLS
(trustme), a bearer token and max_in_flight 1 against the same pair (401, https, 429), and
a third whose pair does not exist (503). Audio is checked by decoders independent of the
server's encoders: libsndfile (soundfile) for WAV and FLAC, FFmpeg's demuxers (PyAV) for
MP3, AAC and Ogg/Opus, and PCM by its length; the expected length is that of the same
request over gRPC (the same seed with temperature 0 gives the same frames).
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
from pathlib import Path

import grpc
import httpx2 as httpx  # the HTTP client the installed openai package is built on
import pytest

from models.tiny.talker import ensure_tiny_checkpoint
from services.gateway.voices import OPENAI_VOICES
from tests.conftest import StageGroup
from tests.integration.http_helpers import (
    clip_wav,
    decode_av,
    metric,
    pair_configs,
    read_response_head,
    read_to_end,
    refused_or_closed,
    start_stages,
    write_pki,
)
from tests.talker_client import wait_for
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, synthesizer_pb2_grpc, talker_pb2, talker_pb2_grpc
from voxring.v1 import synthesizer_pb2 as pb

openai = pytest.importorskip("openai")

TOKEN = "vx-http-token-0123456789"
SPF, RATE = 1920, 24000         # voxring-tiny: samples per codec frame, its sample rate
MAX_CHARS = 200                 # the open gateway's text.max_chars
MAX_BODY_MB = 1
TEXT = "Hello over HTTP."
SHORT = {"seed": 7, "temperature": 0.0, "max_audio_seconds": 0.8}  # greedy: the same frames each time
LONG_S = 30.0                   # a stream (375 frames) that runs while the test uses it
WAIT_S = 30.0                   # bound on every wait for the stack
CURL = Path("/usr/bin/curl")    # the path `make tools` installs it at on CI


def _gateway_config(d: Path, name: str, extra: str, talker: str = "talker",
                    code2wav: str = "code2wav") -> str:
    """A gateway on unix:<name>.sock routing to the pair's sockets; ``extra`` goes in server."""
    return (f"server: {{listen: 'unix:{d}/{name}.sock', drain_timeout: 5, grace: 1{extra}}}\n"
            f"engines: {{pairs: [{{talker: 'unix:{d}/{talker}.sock',"
            f" code2wav: 'unix:{d}/{code2wav}.sock'}}]}}\n"
            f"metrics: {{listen: '127.0.0.1:0'}}\n")


@pytest.fixture(scope="module")
def stack(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-http-", dir="/tmp"))  # short: unix socket paths
    pki = write_pki(d)
    (d / "token").write_text(TOKEN + "\n")
    configs = {
        **pair_configs(d),
        "gateway": _gateway_config(d, "gateway", "") +
        f"http: {{listen: '127.0.0.1:0', max_body_mb: {MAX_BODY_MB}}}\n"
        f"text: {{max_chars: {MAX_CHARS}}}\nvoices: {{store: voices}}\n",
        "gateway-tls": _gateway_config(d, "gateway-tls", f", tls_cert: '{pki['cert']}', "
                                                         f"tls_key: '{pki['key']}'") +
        "http: {listen: '127.0.0.1:0'}\nauth: {token_file: token}\nadmission: {max_in_flight: 1}\n",
        "gateway-dead": _gateway_config(d, "gateway-dead", "", "no-talker", "no-code2wav") +
        "http: {listen: '127.0.0.1:0'}\n",
    }
    stages = StageGroup(d)
    try:
        info = start_stages(stages, configs)
        channels = {s: grpc.insecure_channel(f"unix:{d}/{s}.sock") for s in ("gateway", "talker", "code2wav")}
        yield {"http": info["gateway"]["http"], "tls": info["gateway-tls"]["http"],
               "dead": info["gateway-dead"]["http"], "metrics": info["gateway"]["metrics"],
               "ca": ssl.create_default_context(cafile=str(pki["ca"])), "dir": d, "stages": stages,
               "grpc": synthesizer_pb2_grpc.SynthesizerStub(channels["gateway"]),
               "talker": talker_pb2_grpc.TalkerStub(channels["talker"]),
               "code2wav": code2wav_pb2_grpc.Code2WavStub(channels["code2wav"])}
        for channel in channels.values():
            channel.close()
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


@pytest.fixture(scope="module")
def frames(stack) -> int:
    """Frames of TEXT with SHORT's settings, over gRPC (the reference for every format)."""
    final = None
    for message in stack["grpc"].SynthesizeOnline(
            pb.SynthesizeSpeechRequest(text=TEXT, **SHORT), timeout=WAIT_S):
        final = message
    assert final.usage.frames > 0
    return final.usage.frames


def _client(stack, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{stack['http']}/v1", api_key="unused", max_retries=0,
                         timeout=WAIT_S, **options)


def _speech(client: openai.OpenAI, fmt: str, **extra) -> bytes:
    response = client.audio.speech.create(model="tts-1", voice="default", input=TEXT,
                                          response_format=fmt, extra_body={**SHORT, **extra})
    return response.content


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_decode_to_the_exact_length(stack, frames, fmt):
    audio, rate = read_to_end(_speech(_client(stack), fmt))
    assert rate == RATE and len(audio) == frames * SPF


def test_pcm_is_raw_int16_at_the_models_rate(stack, frames):
    assert len(_speech(_client(stack), "pcm")) == frames * SPF * 2


@pytest.mark.parametrize(("fmt", "codec", "frame_samples", "decoded_rate"), [
    ("mp3", "mp3", 1152, RATE), ("aac", "aac", 1024, RATE), ("opus", "opus", 960, 48000)])
def test_lossy_formats_decode_to_the_length_within_a_codec_frame(stack, frames, fmt, codec, frame_samples,
                                                                 decoded_rate):
    samples, rate, name = decode_av(_speech(_client(stack), fmt))
    assert name.startswith(codec)  # FFmpeg's mp3 decoder is mp3float
    assert rate == decoded_rate  # Opus always decodes at 48 kHz
    expected = frames * SPF * rate / RATE  # FFmpeg decodes Opus at 48 kHz
    # encoder delay and the last frame's padding: at most two codec frames of the decoder's rate
    assert abs(samples - expected) <= 2 * frame_samples, (samples, expected)


def test_usage_counts_the_audio_sent_at_a_speed(stack, frames):
    messages = list(stack["grpc"].SynthesizeOnline(
        pb.SynthesizeSpeechRequest(text=TEXT, encoding=pb.LINEAR_PCM, speed=2.0, **SHORT), timeout=WAIT_S))
    usage, samples = messages[-1].usage, sum(len(m.audio) for m in messages) // 2
    assert usage.frames == frames  # the same frames, played twice as fast
    assert usage.audio_seconds == pytest.approx(samples / RATE)
    assert usage.audio_seconds < 0.6 * frames * SPF / RATE


def test_streaming_response_arrives_in_several_chunks(stack, frames):
    client = _client(stack)
    with client.audio.speech.with_streaming_response.create(
            model="voxring-tiny", voice="default", input=TEXT, response_format="pcm",
            extra_body=SHORT) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers["x-sample-rate"] == str(RATE)
        assert response.headers["x-model"] == "voxring-tiny"  # whatever model the client named
        chunks = [chunk for chunk in response.iter_bytes() if chunk]
    assert len(chunks) > 1 and sum(map(len, chunks)) == frames * SPF * 2


@pytest.fixture
def curl() -> Path:
    """curl, or a skip (a failure on CI, where `make test` installs it first)."""
    if not CURL.is_file():
        reason = f"{CURL} is missing (apt-get install curl; `make tools` does it on CI)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return CURL


def test_sse_deltas_are_the_audio_and_done_has_usage(stack, frames, curl):
    body = json.dumps({"model": "tts-1", "voice": "default", "input": TEXT, "response_format": "pcm",
                       "stream_format": "sse", **SHORT})
    out = subprocess.run([str(curl), "-sN", "--max-time", str(WAIT_S), "-X", "POST",
                          "-H", "Content-Type: application/json", "-d", body,
                          f"http://{stack['http']}/v1/audio/speech"],
                         capture_output=True, check=True, timeout=WAIT_S + 5).stdout.decode()
    events = [json.loads(line[len("data: "):]) for line in out.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"
    assert sum(len(base64.b64decode(e["audio"])) for e in deltas) == frames * SPF * 2
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == frames and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    ours = events[-1]["voxring"]  # the gRPC API's usage: SHORT's cap ends the audio
    assert ours["finish_reason"] == "length" and ours["frames"] == frames and ours["seed"] == SHORT["seed"]
    assert ours["audio_seconds"] == pytest.approx(frames * SPF / RATE) and ours["time_to_first_audio_s"] > 0


BAD_FIELDS = [  # (field, value) -> 400 naming the field
    ("model", 5), ("model", ""), ("input", 5), ("input", ""), ("input", "x" * (MAX_CHARS + 1)),
    ("voice", 5), ("voice", "nobody"), ("voice", {"id": 5}), ("response_format", "ogg"),
    ("response_format", 5), ("speed", "fast"), ("speed", 5.0), ("speed", 0.1), ("instructions", 5),
    ("stream_format", "chunks"), ("seed", "x"), ("seed", -1), ("temperature", "hot"),
    ("temperature", -1), ("top_k", 1.5), ("top_k", -1), ("top_p", 0), ("top_p", "x"),
    ("repetition_penalty", 0), ("repetition_window", "x"), ("max_audio_seconds", 1e6),
    ("max_audio_seconds", "x"), ("sample_rate", 12345), ("sample_rate", "x"), ("request_id", 5),
    ("request_id", " padded "), ("colour", "blue"),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS])
def test_bad_fields_are_400_naming_the_field(stack, field, value):
    body = {"model": "tts-1", "voice": "default", "input": TEXT, field: value}
    response = httpx.post(f"http://{stack['http']}/v1/audio/speech", json=body, timeout=WAIT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert field in error["message"]


def test_missing_fields_and_non_json_bodies_are_400(stack):
    url = f"http://{stack['http']}/v1/audio/speech"
    missing = httpx.post(url, json={"model": "tts-1", "voice": "default"}, timeout=WAIT_S)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
    garbage = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"},
                         timeout=WAIT_S)
    assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_its_bad_request_error(stack):
    with pytest.raises(openai.BadRequestError) as caught:
        _client(stack).audio.speech.create(model="tts-1", voice="no-such-voice", input=TEXT)
    assert caught.value.body["param"] == "voice"


def test_huge_content_length_is_413_before_the_body_is_sent(stack):
    host, port = stack["http"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n" + b"{" * 65536)  # 64 KiB of 100 MB
        head = read_response_head(sock)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_chunked_body_over_the_limit_is_413_while_it_arrives(stack):
    host, port = stack["http"].rsplit(":", 1)
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        while not select.select([sock], [], [], 0)[0] and sent < 8 * MAX_BODY_MB * 2**20:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed while this chunk was on its way
            sent += 65536
        head = read_response_head(sock)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert sent < 8 * MAX_BODY_MB * 2**20  # refused before the client stopped on its own


def _open_stream(base: str, request_id: str, **client_options) -> tuple:
    """A long pcm stream whose first audio has arrived (so it is running on both stages)."""
    client = httpx.Client(timeout=WAIT_S, **client_options)
    body = {"model": "tts-1", "voice": "default", "input": TEXT, "response_format": "pcm",
            "max_audio_seconds": LONG_S, "request_id": request_id}
    response = client.send(client.build_request("POST", f"{base}/v1/audio/speech", json=body), stream=True)
    assert response.status_code == 200, response.read()
    chunks = response.iter_bytes()  # kept: a dropped iterator closes the response
    assert next(chunks)
    return client, response, chunks


def test_duplicate_id_is_409_and_a_disconnect_frees_both_stages(stack):
    completed = metric(stack["metrics"], "voxring_requests_completed_total")
    client, response, _chunks = _open_stream(f"http://{stack['http']}", "http-dup-1")
    try:
        again = httpx.post(f"http://{stack['http']}/v1/audio/speech", timeout=WAIT_S, json={
            "model": "tts-1", "voice": "default", "input": TEXT, "request_id": "http-dup-1"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_exists"
        assert stack["talker"].Stats(talker_pb2.TalkerStatsRequest(), timeout=5).running >= 1
    finally:
        response.close()  # the client goes away mid-stream
        client.close()
    wait_for(lambda: stack["talker"].Stats(talker_pb2.TalkerStatsRequest(), timeout=5).running == 0
             and stack["code2wav"].Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5).active_slots == 0,
             WAIT_S, "the talker's row and Code2Wav's slot freed after the disconnect")
    # cancelled, not finished: the request never completed
    assert metric(stack["metrics"], "voxring_requests_completed_total") == completed
    counted = 'voxring_http_requests_total{route="/v1/audio/speech",status="409"}'
    assert metric(stack["metrics"], counted) >= 1


def test_the_gateway_counts_each_starts_open_and_submit(stack):
    names = ("voxring_start_opens_total", "voxring_start_open_seconds_total", "voxring_start_submits_total",
             "voxring_start_submit_seconds_total")
    before = {name: metric(stack["metrics"], name) for name in names}
    response = httpx.post(f"http://{stack['http']}/v1/audio/speech", timeout=WAIT_S, json={
        "model": "tts-1", "voice": "default", "input": TEXT, "response_format": "pcm"})
    assert response.status_code == 200 and response.content
    after = {name: metric(stack["metrics"], name) for name in names}
    assert after["voxring_start_opens_total"] == before["voxring_start_opens_total"] + 1
    assert after["voxring_start_submits_total"] == before["voxring_start_submits_total"] + 1
    assert after["voxring_start_open_seconds_total"] > before["voxring_start_open_seconds_total"]
    assert after["voxring_start_submit_seconds_total"] > before["voxring_start_submit_seconds_total"]
    assert metric(stack["metrics"], "voxring_event_loop_lag_seconds_count") >= 1  # the loop is sampled
    assert metric(stack["metrics"], "voxring_gc_pause_seconds_count") >= 1  # and its collections timed


def test_tls_gateway_needs_the_token(stack, frames):
    base = f"https://{stack['tls']}"
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN}):
        refused = httpx.get(f"{base}/v1/models", headers=headers, verify=stack["ca"], timeout=WAIT_S)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(verify=stack["ca"], timeout=WAIT_S) as http:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, http_client=http, max_retries=0)
        assert len(_speech(client, "pcm")) == frames * SPF * 2
        assert [m.id for m in client.models.list().data] == ["voxring-tiny", "tts-1", "tts-1-hd",
                                                             "gpt-4o-mini-tts"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", http_client=http,
                          max_retries=0).models.list()


def test_max_in_flight_is_429_with_retry_after(stack):
    tls = {"verify": stack["ca"], "headers": {"Authorization": f"Bearer {TOKEN}"}}
    client, response, _chunks = _open_stream(f"https://{stack['tls']}", "http-busy-1", **tls)
    try:
        busy = httpx.post(f"https://{stack['tls']}/v1/audio/speech", timeout=WAIT_S, **tls, json={
            "model": "tts-1", "voice": "default", "input": TEXT})
        assert busy.status_code == 429, busy.text
        assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        response.close()
        client.close()


def test_unreachable_pair_is_503(stack):
    speech = httpx.post(f"http://{stack['dead']}/v1/audio/speech", timeout=WAIT_S, json={
        "model": "tts-1", "voice": "default", "input": TEXT})
    assert speech.status_code == 503 and speech.json()["error"]["type"] == "server_error"
    assert httpx.get(f"http://{stack['dead']}/v1/models", timeout=WAIT_S).status_code == 503


def test_models_docs_and_playground(stack):
    base = f"http://{stack['http']}"
    models = httpx.get(f"{base}/v1/models", timeout=WAIT_S).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "voxring-tiny"
    assert httpx.get(f"{base}/v1/models/voxring-tiny", timeout=WAIT_S).json()["id"] == "voxring-tiny"
    # OpenAI's ids too, and model_not_found for others: test_http_openai.py
    assert httpx.get(f"{base}/v1/models/whisper-1", timeout=WAIT_S).status_code == 404
    schema = httpx.get(f"{base}/openapi.json", timeout=WAIT_S).json()
    assert {"/v1/audio/speech", "/v1/models", "/v1/audio/voices"} <= set(schema["paths"])
    assert httpx.get(f"{base}/docs", timeout=WAIT_S).status_code == 200
    page = httpx.get(f"{base}/", timeout=WAIT_S)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


def test_voices_list_create_delete(stack):
    base = f"http://{stack['http']}/v1/audio/voices"
    listed = httpx.get(base, timeout=WAIT_S).json()
    assert {"name": "default", "speaker_id": 0, "language_code": "en-US",
            "description": "speaker 0 of the model", "has_reference": False, "removable": False,
            "default": True, "aliases": list(OPENAI_VOICES),
            "model": None} in listed["data"]  # voices.file null
    form = {"name": "http-voice", "transcript": "A steady tone for the test.", "speaker_id": "1",
            "description": "made by the test"}
    files = {"file": ("clip.wav", clip_wav(), "audio/wav")}
    created = httpx.post(base, data=form, files=files, timeout=WAIT_S)
    assert created.status_code == 201, created.text
    assert created.json() | {"default": False} == {
        "name": "http-voice", "speaker_id": 1, "language_code": "en-US", "description": "made by the test",
        "has_reference": True, "removable": True, "default": False, "aliases": [], "model": "voxring-tiny"}
    assert httpx.post(base, data=form, files=files, timeout=WAIT_S).status_code == 409
    assert "http-voice" in [v["name"] for v in httpx.get(base, timeout=WAIT_S).json()["data"]]
    spoken = _client(stack).audio.speech.create(model="tts-1", voice="http-voice", input=TEXT,
                                                response_format="wav", extra_body=SHORT)
    audio, rate = read_to_end(spoken.content)  # the voice is usable at once
    assert rate == RATE and len(audio) > 0
    bad = httpx.post(base, data={**form, "speaker_id": "one"}, files=files, timeout=WAIT_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speaker_id"
    short = httpx.post(base, data={**form, "name": "short"}, files={"file": ("c.wav", clip_wav(0.2))},
                       timeout=WAIT_S)  # the clip's checks name the multipart part
    assert short.status_code == 400 and short.json()["error"]["param"] == "file", short.text
    assert httpx.delete(f"{base}/http-voice", timeout=WAIT_S).status_code == 204
    assert httpx.delete(f"{base}/http-voice", timeout=WAIT_S).status_code == 404
    assert httpx.delete(f"{base}/default", timeout=WAIT_S).status_code == 400  # from the voices file


def test_drain_finishes_streams_and_refuses_new_requests(stack):
    d, stages = stack["dir"], stack["stages"]
    config = _gateway_config(d, "gateway-drain", "") + "http: {listen: '127.0.0.1:0'}\n"
    proc = stages.start("gateway", config, name="gateway-drain", timeout=60)
    base = f"http://{proc.ready()['http']}"
    body = {"model": "tts-1", "voice": "default", "input": TEXT, "response_format": "pcm",
            "stream_format": "sse", **SHORT, "max_audio_seconds": 3.0}
    with httpx.Client(timeout=WAIT_S) as client:
        request = client.build_request("POST", f"{base}/v1/audio/speech", json=body)
        response = client.send(request, stream=True)
        lines = response.iter_lines()
        events = [json.loads(next(line for line in lines if line.startswith("data: "))[6:])]
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: refused_or_closed(base), WAIT_S, "new requests refused during the drain")
        events += [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    # the stream in flight finished whole: its done event, and every frame's audio before it
    assert events[-1]["type"] == "speech.audio.done"
    pcm = sum(len(base64.b64decode(e["audio"])) for e in events[:-1])
    assert pcm == events[-1]["usage"]["output_tokens"] * SPF * 2
    assert proc.proc.wait(timeout=WAIT_S) == 0
    del stages.stages["gateway-drain"]  # stopped: not the module's to stop


