"""The inputs of docs/errors.md's tables, each as a function of the running stack that sends it
and returns what the server answered (:class:`Seen`); keyed by the tables' "input" cells, so
test_error_table.py finds a row without its check, or a check without its row.

The stack (test_error_table.stack): "main", a gateway with a bearer token, max_in_flight 1,
max_body_mb 1 and a voice folder; "noc2w", a gateway whose pair's talker runs and whose Code2Wav
does not; "dead", a gateway whose pair does not exist. ``held`` keeps main's one place taken by
a stream of request_id "table-held" while a row runs, and on leaving waits until the talker
has ended that stream.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx2 as httpx
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from services.common.rich_status import error_info
from tests.integration.http_helpers import clip_wav, metric
from tests.talker_client import wait_for
from voxring.v1 import synthesizer_pb2 as pb
from voxring.v1 import synthesizer_pb2_grpc

TOKEN = "vx-table-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 30.0
HELD = "table-held"
SPEECH = "/v1/audio/speech"
VOICES = "/v1/audio/voices"
BODY = {"model": "tts-1", "voice": "default", "input": "Hello there."}
CONFIG = {"type": "config", "max_audio_seconds": 5}


@dataclass
class Seen:
    """An error as the client got it: ``status`` as the table writes it (415,
    INVALID_ARGUMENT, 1008, handshake 401), ``wire`` everything the client received."""

    status: str
    code: str | None
    param: str | None
    message: str
    wire: str
    extra: dict = field(default_factory=dict)


# --- HTTP ---------------------------------------------------------------------------------------

def http(stack, method: str, path: str, gateway: str = "main", token: bool = True, **options) -> Seen:
    headers = {**(AUTH if token else {}), **options.pop("headers", {})}
    response = httpx.request(method, f"http://{stack[gateway]['http']}{path}", headers=headers,
                             timeout=WAIT_S, **options)
    error = response.json()["error"]
    return Seen(str(response.status_code), error["code"], error["param"], error["message"], response.text,
                {"retry-after": response.headers.get("retry-after"), "type": error["type"]})


def speech(stack, gateway: str = "main", token: bool = True, **fields) -> Seen:
    return http(stack, "POST", SPEECH, gateway, token, json={**BODY, **fields})


def raw_speech(stack, body: bytes, content_type: str) -> Seen:
    return http(stack, "POST", SPEECH, content=body, headers={"Content-Type": content_type})


def without(field_name: str) -> dict:
    return {k: v for k, v in BODY.items() if k != field_name}


def over_the_body_limit(stack) -> Seen:
    """Content-Length over the limit, the body never sent: the answer comes from the header."""
    host, port = stack["main"]["http"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(f"POST {SPEECH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 2000000\r\n\r\n{".encode())
        data = b""
        while chunk := sock.recv(65536):  # the server closes after its answer (Connection: close)
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    return Seen(head.split()[1].decode(), error["code"], error["param"], error["message"], body.decode(),
                {"retry-after": None, "type": error["type"]})


def create_voice(stack, name: str) -> Seen:
    form = {"name": name, "transcript": "A steady tone.", "speaker_id": "0"}
    return http(stack, "POST", VOICES, data=form, files={"file": ("clip.wav", clip_wav(), "audio/wav")})


@contextlib.contextmanager
def held(stack):
    """Main's one place taken by a long PCM stream of id HELD whose first audio arrived."""
    wait_for(lambda: metric(stack["main"]["metrics"], "voxring_active_streams") == 0, WAIT_S,
             "the gateway's earlier streams ended")
    body = {**BODY, "response_format": "pcm", "max_audio_seconds": 30, "request_id": HELD}
    with httpx.Client(timeout=WAIT_S, headers=AUTH) as client:
        request = client.build_request("POST", f"http://{stack['main']['http']}{SPEECH}", json=body)
        response = client.send(request, stream=True)
        try:
            assert response.status_code == 200, response.read()
            chunks = response.iter_bytes()
            assert next(chunks)
            yield
        finally:
            response.close()
            # its cancel reaches the talker through Code2Wav: until it has, the talker's verdict may
            # still count the stream (on a slow machine, refusing the next request for capacity)
            wait_for(lambda: metric(stack["talker"]["metrics"], "voxring_running") == 0, WAIT_S,
                     "the held stream ended on the talker")


def while_held(check: Callable) -> Callable:
    def run(stack) -> Seen:
        with held(stack):
            return check(stack)
    return run


HTTP_CASES: dict[str, Callable] = {
    "a JSON body sent as `curl -d` sends it (`Content-Type: application/x-www-form-urlencoded`)":
        lambda s: raw_speech(s, json.dumps(BODY).encode(), "application/x-www-form-urlencoded"),
    'a body that is not JSON: `{"model": "tts-1",}`':
        lambda s: raw_speech(s, b'{"model": "tts-1",}', "application/json"),
    "a JSON body that is not an object: `[]`": lambda s: raw_speech(s, b"[]", "application/json"),
    "no body": lambda s: raw_speech(s, b"", "application/json"),
    "no `input`": lambda s: http(s, "POST", SPEECH, json=without("input")),
    'a field of no API: `"colour": "blue"`': lambda s: speech(s, colour="blue"),
    'a value of the wrong JSON type: `"speed": "1.5"`': lambda s: speech(s, speed="1.5"),
    'a value out of range: `"speed": 9`': lambda s: speech(s, speed=9),
    'an unknown voice: `"voice": "nobody"`': lambda s: speech(s, voice="nobody"),
    'an unknown model: `"model": "whisper-1"`': lambda s: speech(s, model="whisper-1"),
    "a `request_id` already in flight": while_held(lambda s: speech(s, request_id=HELD)),
    "every place taken (`admission.max_in_flight`)": while_held(lambda s: speech(s, request_id="other")),
    "no bearer token": lambda s: speech(s, token=False),
    "a body over `http.max_body_mb`": over_the_body_limit,
    "Code2Wav down (its talker up)": lambda s: speech(s, "noc2w"),
    "no stage running": lambda s: speech(s, "dead"),
    "`POST /v1/audio/voices` as JSON": lambda s: http(s, "POST", VOICES, json={"name": "x"}),
    "`POST /v1/audio/voices` with a name taken: `default`": lambda s: create_voice(s, "default"),
    "`DELETE /v1/audio/voices/nobody`": lambda s: http(s, "DELETE", f"{VOICES}/nobody"),
    "`DELETE /v1/audio/voices/default` (not an added voice)":
        lambda s: http(s, "DELETE", f"{VOICES}/default"),
    "`GET /v1/nothing`": lambda s: http(s, "GET", "/v1/nothing"),
    "`GET /v1/audio/speech`": lambda s: http(s, "GET", SPEECH),
}


# --- gRPC ---------------------------------------------------------------------------------------

def rpc(stack, method: str, request, gateway: str = "main", token: bool = True) -> Seen:
    metadata = (("authorization", f"Bearer {TOKEN}"),) if token else ()
    with grpc.insecure_channel(stack[gateway]["grpc"]) as channel:
        call = getattr(synthesizer_pb2_grpc.SynthesizerStub(channel), method)
        try:
            result = call(request, timeout=WAIT_S, metadata=metadata)
            if method == "SynthesizeOnline":
                list(result)
        except grpc.RpcError as exc:
            trailers = tuple(exc.trailing_metadata() or ())
            info = error_info(trailers)
            text = [(k, v) for k, v in trailers if not k.endswith("-bin")]
            return Seen(exc.code().name, info.reason if info else None,
                        info.metadata.get("field") if info else None, exc.details(),
                        f"{exc.details()} {text!r} {info}",
                        {"domain": info.domain if info else None, **dict(text)})
    raise AssertionError(f"{method} succeeded")


def synth(stack, gateway: str = "main", token: bool = True, **fields) -> Seen:
    request = pb.SynthesizeSpeechRequest(**{"text": "Hello there.", **fields})
    return rpc(stack, "SynthesizeOnline", request, gateway, token)


GRPC_CASES: dict[str, Callable] = {
    "`text` empty": lambda s: synth(s, text=""),
    "an unknown `voice_name`: `nobody`": lambda s: synth(s, voice_name="nobody"),
    "a `request_id` already in flight": while_held(lambda s: synth(s, request_id=HELD)),
    "every place taken (`admission.max_in_flight`)": while_held(lambda s: synth(s, request_id="other")),
    "no bearer token": lambda s: synth(s, token=False),
    "Code2Wav down (its talker up)": lambda s: synth(s, "noc2w"),
    "no stage running": lambda s: synth(s, "dead"),
    "`CreateVoice` with a name taken: `default`": lambda s: rpc(s, "CreateVoice", pb.CreateVoiceRequest(
        name="default", audio=clip_wav(), transcript="A steady tone.")),
    "`DeleteVoice` of `nobody`": lambda s: rpc(s, "DeleteVoice", pb.DeleteVoiceRequest(name="nobody")),
    "`DeleteVoice` of `default` (not an added voice)":
        lambda s: rpc(s, "DeleteVoice", pb.DeleteVoiceRequest(name="default")),
}


# --- WebSocket ----------------------------------------------------------------------------------

def ws(stack, *messages: dict | str | bytes, gateway: str = "main", token: bool = True) -> Seen:
    url = f"ws://{stack[gateway]['http']}/v1/audio/speech/stream"
    try:
        with connect(url, proxy=None, compression=None, open_timeout=WAIT_S,
                     additional_headers=AUTH if token else None) as conn:
            try:
                for message in messages:
                    conn.send(message if isinstance(message, str | bytes) else json.dumps(message))
            except ConnectionClosed:
                pass  # the server answered before the last message went: its error and close are read below
            events = []
            try:
                while True:
                    if isinstance(got := conn.recv(timeout=WAIT_S), str):
                        events.append(json.loads(got))
            except ConnectionClosed as closed:
                close = closed.rcvd
    except InvalidStatus as refused:
        error = json.loads(refused.response.body)["error"]
        return Seen(f"handshake {refused.response.status_code}", error["code"], error["param"],
                    error["message"], refused.response.body.decode())
    assert events and events[-1]["type"] == "error" and close is not None, (events, close)
    error = events[-1]["error"]
    return Seen(str(close.code), error["code"], error["param"], error["message"], json.dumps(events[-1]),
                {"reason": close.reason, "retry_after": events[-1].get("retry_after")})


WS_CASES: dict[str, Callable] = {
    "a message that is not JSON: `{not json`": lambda s: ws(s, "{not json"),
    "a binary message": lambda s: ws(s, CONFIG, b"\x00\x01"),
    "text before the config": lambda s: ws(s, {"type": "text", "text": "Hello."}),
    'a field of no message: `{"type": "config", "speed": 1}`': lambda s: ws(s, {**CONFIG, "speed": 1}),
    'config, then `{"type": "text"}`': lambda s: ws(s, CONFIG, {"type": "text"}),
    'an unknown voice: `{"type": "config", "voice": "nobody"}`':
        lambda s: ws(s, {**CONFIG, "voice": "nobody"}),
    "a `request_id` already in flight": while_held(lambda s: ws(s, {**CONFIG, "request_id": HELD})),
    "every place taken (`admission.max_in_flight`)": while_held(lambda s: ws(s, CONFIG)),
    "no bearer token": lambda s: ws(s, CONFIG, token=False),
    "Code2Wav down (its talker up)": lambda s: ws(s, CONFIG, {"type": "text", "text": "Nobody hears this."},
                                                  {"type": "close"}, gateway="noc2w"),
}
