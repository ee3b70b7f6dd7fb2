"""The WebSocket at /v1/audio/speech/stream against real processes: a talker, a Code2Wav and
gateways whose ``http.listen`` is 127.0.0.1:0, driven by the websockets package's sync client as
a user's program drives it (text a word at a time, flush, clear, close).

One stack for the module: the pair and four gateways routing to it: one whose segments are at
most 1 s (the tiny model seldom stops on its own), one with the default 30 s segments (a
segment long enough to be cleared, or left, while it is spoken), one with a bearer token and
max_in_flight 1, and one whose pair does not exist. PCM is checked by its length against the
frames the segment_done events count; WAV by libsndfile, MP3 by FFmpeg's demuxer (PyAV).
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from models.tiny.talker import ensure_tiny_checkpoint
from tests.conftest import StageGroup
from tests.integration.http_helpers import decode_av, metric, pair_configs, read_to_end, start_stages
from tests.integration.test_http_api import SPF, TOKEN, _gateway_config
from tests.talker_client import wait_for
from voxring.v1 import code2wav_pb2, code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc

PATH = "/v1/audio/speech/stream"
MAX_PIECE_CHARS = 300
WAIT_S = 30.0
SENTENCES = ["The first sentence is short.", "Here comes the second one, a little longer.",
             "A third one ends it."]
OK = ("stop", "length")
HTTP = "http: {listen: '127.0.0.1:0'}\n"


@pytest.fixture(scope="module")
def stack(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")
    d = Path(tempfile.mkdtemp(prefix="vx-ws-", dir="/tmp"))  # short: unix socket paths
    (d / "token").write_text(TOKEN + "\n")
    streaming = f"streaming: {{max_piece_chars: {MAX_PIECE_CHARS}"
    configs = {
        **pair_configs(d),
        "gateway": _gateway_config(d, "gateway", "") + HTTP + streaming + "}\n"
        "limits: {text_guard_min_s: 1.0, text_guard_s_per_char: 0}\n",  # a segment: 1 s at most
        "gateway-long": _gateway_config(d, "gateway-long", "") + HTTP + streaming + "}\n",
        "gateway-token": _gateway_config(d, "gateway-token", "") + HTTP +
        "auth: {token_file: token}\nadmission: {max_in_flight: 1}\n",
        "gateway-dead": _gateway_config(d, "gateway-dead", "", "no-talker", "no-code2wav") + HTTP,
    }
    stages = StageGroup(d)
    try:
        info = start_stages(stages, configs)
        channels = {s: grpc.insecure_channel(f"unix:{d}/{s}.sock") for s in ("talker", "code2wav")}
        yield {"short": info["gateway"]["http"], "long": info["gateway-long"]["http"],
               "token": info["gateway-token"]["http"], "dead": info["gateway-dead"]["http"],
               "metrics": info["gateway"]["metrics"], "long_metrics": info["gateway-long"]["metrics"],
               "token_metrics": info["gateway-token"]["metrics"],
               "talker": talker_pb2_grpc.TalkerStub(channels["talker"]),
               "code2wav": code2wav_pb2_grpc.Code2WavStub(channels["code2wav"])}
        for channel in channels.values():
            channel.close()
    finally:
        codes = stages.close()
        shutil.rmtree(d, ignore_errors=True)
    assert codes == dict.fromkeys(stages.stages, 0), f"not every stage exited 0: {codes}"


def session(address: str, **options) -> ClientConnection:
    """A connection to the stream endpoint (loopback, no proxy, no compression)."""
    return connect(f"ws://{address}{PATH}", proxy=None, compression=None, open_timeout=WAIT_S, **options)


def send(ws: ClientConnection, *messages: dict | str) -> None:
    for message in messages:
        ws.send(message if isinstance(message, str) else json.dumps(message))


def words(paragraph: str) -> list[dict]:
    """The paragraph as text messages, a word (and the space after it) each."""
    pieces = paragraph.split(" ")
    return [{"type": "text", "text": w + (" " if i < len(pieces) - 1 else "")} for i, w in enumerate(pieces)]


@dataclass
class Received:
    audio: list[bytes]     # the binary messages
    events: list[dict]     # the JSON ones
    close_code: int | None  # the server's close frame's

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def receive_all(ws: ClientConnection) -> Received:
    """Every message until the server closes the connection."""
    audio, events = [], []
    try:
        while True:
            message = ws.recv(timeout=WAIT_S)
            if isinstance(message, bytes):
                audio.append(message)
            else:
                events.append(json.loads(message))
    except ConnectionClosed as closed:
        return Received(audio, events, closed.rcvd.code if closed.rcvd else None)


def idle_engines(stack) -> bool:
    talker = stack["talker"].Stats(talker_pb2.TalkerStatsRequest(), timeout=5)
    c2w = stack["code2wav"].Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5)
    return talker.running == 0 and c2w.active_slots == 0


def frames_of(received: Received) -> int:
    return sum(e["usage"]["frames"] for e in received.of("segment_done"))


CONFIG = {"type": "config", "seed": 3, "min_segment_chars": 0, "max_audio_seconds": 60}


def test_a_paragraph_word_by_word_is_three_segments_of_binary_pcm(stack):
    accepted = 'voxring_http_requests_total{route="/v1/audio/speech/stream",status="101"}'
    before = metric(stack["metrics"], accepted)
    with session(stack["short"]) as ws:
        send(ws, CONFIG, *words(" ".join(SENTENCES)), {"type": "close"})
        got = receive_all(ws)
    assert got.close_code == 1000 and [e["type"] for e in got.events][-1] == "done"
    done, segments = got.of("done")[0], got.of("segment_done")
    assert [s["text"] for s in segments] == SENTENCES and [s["segment_index"] for s in segments] == [0, 1, 2]
    assert all(s["finish_reason"] in OK and s["usage"]["frames"] > 0 for s in segments)
    assert done["segments"] == 3 and done["finish_reason"] in OK and done["usage"]["seed"] == 3
    assert done["usage"]["frames"] == frames_of(got)
    assert len(got.audio) > 3 and len(b"".join(got.audio)) == frames_of(got) * SPF * 2  # pcm at 24 kHz
    assert metric(stack["metrics"], accepted) == before + 1


@pytest.mark.parametrize(("fmt", "frame_samples"), [("wav", 0), ("mp3", 1152)])
def test_base64_audio_decodes_to_the_frames_length(stack, fmt, frame_samples):
    with session(stack["short"]) as ws:
        send(ws, {**CONFIG, "response_format": fmt, "audio": "base64"},
             {"type": "text", "text": SENTENCES[0] + " "}, {"type": "text", "text": SENTENCES[2]},
             {"type": "close"})
        got = receive_all(ws)
    assert got.close_code == 1000 and not got.audio and got.of("done")[0]["segments"] == 2
    chunks = got.of("audio")
    assert {(c["format"], c["sample_rate"]) for c in chunks} == {(fmt, 24000)}
    assert [c["chunk_index"] for c in chunks] == sorted(c["chunk_index"] for c in chunks)
    assert [c["sample_offset"] for c in chunks] == sorted(c["sample_offset"] for c in chunks)
    assert {c["segment_text"] for c in chunks if c["segment_index"] == 1} <= {SENTENCES[2], ""}
    data = b"".join(base64.b64decode(c["audio"]) for c in chunks)
    expected = frames_of(got) * SPF
    if fmt == "wav":
        pcm, rate = read_to_end(data)
        assert rate == 24000 and len(pcm) == expected
    else:
        samples, rate, codec = decode_av(data)
        assert codec.startswith("mp3") and rate == 24000
        assert abs(samples - expected) <= 2 * frame_samples, (samples, expected)  # delay, padding


def test_clear_stops_the_segment_and_later_text_is_spoken(stack):
    after = "After the barge-in, this is said."
    with session(stack["long"]) as ws:
        send(ws, {**CONFIG, "seed": 2}, {"type": "text", "text": "A long sentence, cut off soon. "})
        first = ws.recv(timeout=WAIT_S)
        assert isinstance(first, bytes) and first  # the first segment is being spoken
        send(ws, {"type": "clear"}, {"type": "text", "text": after}, {"type": "close"})
        got = receive_all(ws)
    segments = got.of("segment_done")
    assert segments[0]["finish_reason"] == "cancelled" and 0 < segments[0]["usage"]["frames"] < 375
    assert segments[-1]["text"] == after and segments[-1]["finish_reason"] in OK
    assert got.close_code == 1000 and got.of("done")[0]["segments"] == len(segments)
    wait_for(lambda: idle_engines(stack), WAIT_S, "both stages idle")


BAD = [  # (messages, param): an error event naming it, then the close 1008
    ([{"type": "text", "text": "Hello."}], "config"),
    ([CONFIG, CONFIG], "config"),
    ([{"type": "close"}], "config"),
    ([CONFIG, {"type": "shout"}], "type"),
    ([{"kind": "config"}], "type"),
    ([{"type": "config", "voice": "nobody"}], "voice"),
    ([{"type": "config", "voice": {"id": "nobody"}}], "voice"),
    ([{"type": "config", "seed": "x"}], "seed"),
    ([{"type": "config", "temperature": "hot"}], "temperature"),
    ([{"type": "config", "colour": "blue"}], "colour"),
    ([{"type": "config", "response_format": "ogg"}], "response_format"),
    ([{"type": "config", "sample_rate": 12345}], "sample_rate"),
    ([{"type": "config", "max_wait_s": 0}], "max_wait_s"),
    ([{"type": "config", "audio": "hex"}], "audio"),
    ([CONFIG, {"type": "text", "text": "x" * (MAX_PIECE_CHARS + 1)}], "text"),
    ([CONFIG, {"type": "text", "text": 5}], "text"),
    ([CONFIG, {"type": "flush", "now": True}], "now"),
    ([CONFIG, {"type": "text", "text": "Speak this."}, {"type": "close"}, {"type": "flush"}], "type"),
    (["{not json"], None),
    ([CONFIG, "[1, 2]"], None),
]


@pytest.mark.parametrize(("messages", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_messages_are_an_error_naming_the_field_then_1008(stack, messages, param):
    with session(stack["short"]) as ws:
        send(ws, *messages)
        got = receive_all(ws)
    assert got.close_code == 1008 and [e["type"] for e in got.events][-1] == "error", got.events
    error = got.events[-1]["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    code = "invalid_json" if param is None else "unknown_parameter" if param in ("colour", "now") \
        else "invalid_value"  # docs/errors.md's words
    assert error["code"] == code and (param is None or error["message"].startswith(param))
    wait_for(lambda: idle_engines(stack), WAIT_S, "both stages idle")


def test_a_binary_message_is_an_error(stack):
    with session(stack["short"]) as ws:
        send(ws, CONFIG)
        ws.send(b"\x00\x01")
        got = receive_all(ws)
    assert got.close_code == 1008 and got.events[-1]["error"]["param"] is None


def _short_session(ws: ClientConnection) -> Received:
    send(ws, {**CONFIG, "max_audio_seconds": 0.5}, {"type": "text", "text": "Hello."}, {"type": "close"})
    return receive_all(ws)


def test_the_token_as_a_header_or_a_subprotocol(stack):
    refused = 'voxring_http_requests_total{route="/v1/audio/speech/stream",status="401"}'
    before = metric(stack["token_metrics"], refused)
    for options in ({}, {"additional_headers": {"Authorization": f"Bearer {TOKEN}x"}},
                    {"subprotocols": [f"bearer.{TOKEN}x"]}, {"additional_headers": {"Authorization": TOKEN}}):
        with pytest.raises(InvalidStatus) as caught:
            session(stack["token"], **options)
        assert caught.value.response.status_code == 401
        assert json.loads(caught.value.response.body)["error"]["code"] == "invalid_api_key"
    # the gateway counts a request once its handler returns, which may be after the client read the 401
    wait_for(lambda: metric(stack["token_metrics"], refused) == before + 4, what="four 401s counted")
    with session(stack["token"], additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        assert ws.subprotocol is None
        got = _short_session(ws)
    assert got.close_code == 1000 and got.of("done") and got.audio
    with session(stack["token"], subprotocols=[f"bearer.{TOKEN}"]) as ws:
        assert ws.subprotocol == f"bearer.{TOKEN}"  # echoed: a browser requires it
        got = _short_session(ws)
    assert got.close_code == 1000 and got.of("done") and got.audio


def test_a_full_server_and_a_missing_pair_are_1013(stack):
    auth = {"additional_headers": {"Authorization": f"Bearer {TOKEN}"}}
    with session(stack["token"], **auth) as holder:  # max_in_flight 1: this session holds it
        send(holder, CONFIG, {"type": "text", "text": "A session that holds the only place."})
        assert isinstance(holder.recv(timeout=WAIT_S), bytes)
        with session(stack["token"], **auth) as ws:
            send(ws, CONFIG)
            busy = receive_all(ws)
    assert busy.close_code == 1013 and busy.events[-1]["error"]["type"] == "rate_limit_error"
    assert busy.events[-1]["retry_after"] >= 1
    with session(stack["dead"]) as ws:
        send(ws, CONFIG, {"type": "text", "text": "Nobody speaks this."})
        dead = receive_all(ws)
    assert dead.close_code == 1013 and dead.events[-1]["error"]["code"] == "unavailable"
    assert dead.events[-1]["error"]["type"] == "server_error"
    wait_for(lambda: idle_engines(stack), WAIT_S, "both stages idle")


def test_a_duplicate_id_is_refused_and_a_client_gone_frees_both_stages(stack):
    completed = metric(stack["long_metrics"], "voxring_requests_completed_total")
    with session(stack["long"]) as ws:
        send(ws, {**CONFIG, "request_id": "ws-dup-1"},
             {"type": "text", "text": "This one is cut off. It had more to say. "})
        assert isinstance(ws.recv(timeout=WAIT_S), bytes)
        with session(stack["long"]) as again:
            send(again, {**CONFIG, "request_id": "ws-dup-1"})
            dup = receive_all(again)
        assert dup.close_code == 1008 and dup.events[-1]["error"]["code"] == "already_exists"
        assert stack["talker"].Stats(talker_pb2.TalkerStatsRequest(), timeout=5).running >= 1
    # the client closed mid-segment: the session ends at once on both stages
    wait_for(lambda: idle_engines(stack), WAIT_S, "the talker's row and Code2Wav's slot freed")
    assert metric(stack["long_metrics"], "voxring_requests_completed_total") == completed  # cancelled


def test_a_client_gone_while_its_session_waits_for_text_frees_both_stages(stack):
    """No audio flows, so no failed send reveals that the client left: the server must see its close."""
    completed = metric(stack["metrics"], "voxring_requests_completed_total")
    with session(stack["short"]) as ws:
        send(ws, CONFIG, {"type": "text", "text": "One sentence, then nothing."}, {"type": "flush"})
        while not (isinstance(m := ws.recv(timeout=WAIT_S), str) and json.loads(m)["type"] == "segment_done"):
            pass
        c2w = stack["code2wav"].Stats(code2wav_pb2.Code2WavStatsRequest(), timeout=5)
        assert c2w.active_slots >= 1  # the idle session keeps its Code2Wav stream
    wait_for(lambda: idle_engines(stack), WAIT_S, "both stages idle after the client left")
    # cancelled: not ended as a close would end it (the rest spoken, the session completed)
    assert metric(stack["metrics"], "voxring_requests_completed_total") == completed
