"""``POST /v1/audio/speech`` without engines: the JSON body to the protobuf request, and the
streamed response (status from the first message, disconnects cancel the stream, errors
after the first byte) over a pipeline stand-in that the test steers."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import ResourceExhausted, Unavailable
from services.gateway.config import GatewayConfig
from services.gateway.http.speech import FORMATS, SpeechBody, SpeechStream
from services.gateway.inflight import InFlightRequests
from services.gateway.validation import validate
from services.gateway.voices import VoiceCatalog
from voxring.v1 import common_pb2
from voxring.v1 import synthesizer_pb2 as pb

BASE = {"model": "tts-1", "input": "Hello.", "voice": "default"}


def test_body_maps_to_the_grpc_request():
    body = SpeechBody.model_validate({**BASE, "voice": {"id": "default"}, "response_format": "opus",
                                      "speed": 1.5, "seed": 3, "temperature": 0, "top_k": 5, "top_p": 0.5,
                                      "repetition_penalty": 1.1, "repetition_window": 16,
                                      "max_audio_seconds": 2, "sample_rate": 16000, "request_id": "r-1",
                                      "instructions": "whisper"})
    msg = body.to_request()
    assert (msg.text, msg.voice_name, msg.encoding, msg.sample_rate_hz, msg.request_id) == (
        "Hello.", "default", pb.OGG_OPUS, 16000, "r-1")
    assert (msg.seed, msg.temperature, msg.top_k, msg.repetition_window, msg.max_audio_seconds) == (
        3, 0.0, 5, 16, 2.0)
    assert msg.HasField("temperature") and msg.speed == pytest.approx(1.5)


def test_unset_options_stay_unset_and_mp3_is_the_default():
    msg = SpeechBody.model_validate(BASE).to_request()
    assert msg.encoding == pb.MP3 and msg.sample_rate_hz == 0 and msg.request_id == ""
    assert not any(msg.HasField(f) for f in ("seed", "temperature", "top_k", "top_p", "speed",
                                             "repetition_penalty", "repetition_window", "max_audio_seconds"))


@pytest.mark.parametrize(("fmt", "media"), [
    ("mp3", "audio/mpeg"), ("opus", "audio/ogg"), ("aac", "audio/aac"), ("flac", "audio/flac"),
    ("wav", "audio/wav"), ("pcm", "audio/pcm")])
def test_each_format_has_its_content_type(fmt, media):
    assert SpeechBody.model_validate({**BASE, "response_format": fmt}).media_type == media
    assert FORMATS[fmt][1] == media
    assert SpeechBody.model_validate({**BASE, "response_format": fmt, "stream_format": "sse"}).media_type \
        == "text/event-stream"


class Pipeline:
    """Yields the messages the test puts in ``messages`` (an exception is raised instead),
    then waits on ``hold``; records whether its stream was closed."""

    def __init__(self, messages, hold: bool = False) -> None:
        self.messages = messages
        self.hold = hold
        self.entered = asyncio.Event()
        self.closed = asyncio.Event()
        self.yielded = asyncio.Event()

    async def stream(self, valid):
        self.entered.set()
        try:
            for item in self.messages:
                if isinstance(item, BaseException):
                    raise item
                yield item
                self.yielded.set()
            if self.hold:
                await asyncio.Event().wait()
        finally:
            self.closed.set()


def _chunk(audio: bytes) -> pb.SynthesizeSpeechResponse:
    return pb.SynthesizeSpeechResponse(audio=audio, sample_rate_hz=24000)


def _final(audio: bytes, frames: int) -> pb.SynthesizeSpeechResponse:
    usage = pb.Usage(frames=frames, audio_seconds=frames / 12.5, time_to_first_audio_s=0.05,
                     real_time_factor=0.5, seed=9, length_limit=pb.LENGTH_LIMIT_TEXT)
    return pb.SynthesizeSpeechResponse(audio=audio, sample_rate_hz=24000, usage=usage, request_id="r-9",
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)


class Client:
    """The ASGI side of one request: what was sent, and a disconnect on demand."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)

    @property
    def status(self):
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def complete(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body") for m in self.sent)


def _stream(pipeline, in_flight=None, **fields) -> SpeechStream:
    body = SpeechBody.model_validate({**BASE, "response_format": "pcm", **fields})
    valid = validate(body.to_request(), GatewayConfig(), VoiceCatalog.builtin())
    usage = lambda v, frames: {"input_tokens": 2, "output_tokens": frames, "total_tokens": 2 + frames}  # noqa: E731
    return SpeechStream(valid, body, in_flight=in_flight or InFlightRequests(), pipeline=pipeline,
                        usage_tokens=usage, model_name=lambda: "voxring-tiny")


def _run(stream, client, timeout=5.0):
    return asyncio.wait_for(stream({"type": "http"}, client.receive, client.send), timeout)


def test_audio_streams_the_messages_then_completes():
    async def main():
        client = Client()
        await _run(_stream(Pipeline([_chunk(b"ab"), _chunk(b"cd"), _final(b"ef", 3)])), client)
        headers = dict(next(m for m in client.sent if m["type"] == "http.response.start")["headers"])
        assert client.status == 200 and client.body == b"abcdef" and client.complete
        assert headers[b"content-type"] == b"audio/pcm" and headers[b"x-sample-rate"] == b"24000"
        assert headers[b"x-model"] == b"voxring-tiny"
    asyncio.run(main())


def test_sse_sends_deltas_and_done_with_usage():
    async def main():
        client = Client()
        await _run(_stream(Pipeline([_chunk(b"ab"), _final(b"", 4)]), stream_format="sse"), client)
        events = [json.loads(line[6:]) for line in client.body.decode().splitlines() if line]
        assert events == [{"type": "speech.audio.delta", "audio": "YWI="},
                          {"type": "speech.audio.done",
                           "usage": {"input_tokens": 2, "output_tokens": 4, "total_tokens": 6},
                           "voxring": {"finish_reason": "length", "length_limit": "text", "frames": 4,
                                       "audio_seconds": 0.32,
                                       "time_to_first_audio_s": 0.05, "real_time_factor": 0.5,
                                       "seed": 9, "request_id": "r-9"}}]
    asyncio.run(main())


@pytest.mark.parametrize(("error", "status"), [(ResourceExhausted("busy", retry_after=1.5), 429),
                                               (Unavailable("down"), 503)])
def test_an_error_before_the_first_message_is_its_status(error, status):
    async def main():
        client = Client()
        await _run(_stream(Pipeline([error])), client)
        assert client.status == status and json.loads(client.body)["error"]["message"] == error.message
        if status == 429:
            headers = dict(next(m for m in client.sent if m["type"] == "http.response.start")["headers"])
            assert headers[b"retry-after"] == b"2"
    asyncio.run(main())


def test_a_duplicate_id_in_flight_is_409():
    async def main():
        in_flight = InFlightRequests()
        with in_flight.reserve("same"):
            client = Client()
            await _run(_stream(Pipeline([_final(b"", 1)]), in_flight, request_id="same"), client)
        assert client.status == 409
    asyncio.run(main())


def test_an_error_after_the_first_byte_cuts_audio_and_ends_sse_with_an_error_event():
    async def main():
        audio = Client()
        await _run(_stream(Pipeline([_chunk(b"ab"), Unavailable("code2wav: gone")])), audio)
        assert audio.status == 200 and audio.body == b"ab" and not audio.complete
        sse = Client()
        failing = Pipeline([_chunk(b"ab"), Unavailable("code2wav: gone")])
        await _run(_stream(failing, stream_format="sse"), sse)
        last = json.loads(sse.body.decode().strip().splitlines()[-1][6:])
        assert sse.complete and last["type"] == "error" and last["error"]["code"] == "unavailable"
    asyncio.run(main())


@pytest.mark.parametrize("before_audio", [True, False])
def test_a_disconnect_closes_the_pipelines_stream_and_frees_the_id(before_audio):
    async def main():
        pipeline = Pipeline([] if before_audio else [_chunk(b"ab")], hold=True)
        in_flight, client = InFlightRequests(), Client()
        task = asyncio.ensure_future(_run(_stream(pipeline, in_flight, request_id="gone"), client))
        started = pipeline.entered if before_audio else pipeline.yielded
        await asyncio.wait_for(started.wait(), 5)
        client.gone.set()
        await task
        assert pipeline.closed.is_set() and "gone" not in in_flight
    asyncio.run(main())
