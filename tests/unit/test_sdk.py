"""The Python SDK (voxring.client, voxring.errors) against an in-process fake
Synthesizer on a unix socket: chunks and final usage, unset optional fields, typed
errors, deadlines and cancellation, with the blocking and the grpc.aio client."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import queue
import struct
import threading
import time
import wave
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from voxring import errors
from voxring.client import AsyncClient, Client, build_request
from voxring.v1 import common_pb2, synthesizer_pb2_grpc
from voxring.v1 import synthesizer_pb2 as pb

RATE = 24000
WAIT_S = 5.0  # every wait on the fake server's side is bounded by this
OPTIONAL_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty", "repetition_window",
                   "seed", "max_audio_seconds", "speed")


def pcm(offset: int, num_samples: int) -> bytes:
    """int16 samples that depend on their position, so joined chunks can be checked."""
    return struct.pack(f"<{num_samples}h", *(((offset + i) % 2000) - 1000 for i in range(num_samples)))


def streaming_wav_header(rate: int) -> bytes:
    """A RIFF/WAVE header as a streaming server writes it: sizes unknown (0xFFFFFFFF)."""
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 16, 1, 1,
                       rate, rate * 2, 2, 16, b"data", 0xFFFFFFFF)


def wav_file(rate: int, frames: bytes) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buffer.getvalue()


@dataclass(frozen=True)
class Step:
    delay_s: float    # wait before sending this chunk
    num_samples: int  # samples in this chunk


@dataclass
class FakeSynthesizer(synthesizer_pb2_grpc.SynthesizerServicer):
    """Scripted responses. ``plan``: the chunks of a normal request. The text picks other
    behaviours: "error:<CODE>" aborts with that code (INVALID_ARGUMENT names
    "temperature" in "voxring-field", RESOURCE_EXHAUSTED sends "retry-after-s: 0.25");
    "slow" sends a chunk every 50 ms for 10 s. ``reject_every`` n > 0 refuses every n-th
    request with RESOURCE_EXHAUSTED. Each streaming handler reports how it ended on
    ``ended``: (request_id, "ok" | "inactive"), "inactive" when it was cut short (the
    call was cancelled or its deadline passed)."""

    plan: list[Step] = field(default_factory=lambda: [Step(0, 480), Step(0, 960), Step(0, 1440)])
    final_with_audio: bool = False  # the last chunk's audio rides on the final message
    reject_every: int = 0
    target: str = ""
    requests: list[pb.SynthesizeSpeechRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)  # each request's peer (its connection, over TCP)
    ended: queue.Queue = field(default_factory=queue.Queue)
    _count: Iterator[int] = field(default_factory=itertools.count)

    def _admit(self, request, context) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.peers.append(context.peer())
        n = next(self._count)
        code_name = request.text.removeprefix("error:") if request.text.startswith("error:") else None
        if self.reject_every and n % self.reject_every == self.reject_every - 1:
            code_name = "RESOURCE_EXHAUSTED"
        if code_name == "INVALID_ARGUMENT":
            context.set_trailing_metadata((("voxring-field", "temperature"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be >= 0, got -1")
        if code_name == "RESOURCE_EXHAUSTED":
            context.set_trailing_metadata((("retry-after-s", "0.25"),))
        if code_name is not None:
            context.abort(grpc.StatusCode[code_name], f"scripted {code_name}")

    def _steps(self, request) -> list[Step]:
        return [Step(0.05, 1200)] * 200 if request.text == "slow" else self.plan

    @staticmethod
    def _wait(context, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        return context.is_active()

    def _final(self, request, num_chunks: int, num_samples: int) -> pb.SynthesizeSpeechResponse:
        reason = (common_pb2.FINISH_REASON_LENGTH if request.HasField("max_audio_seconds")
                  else common_pb2.FINISH_REASON_STOP)
        usage = pb.Usage(frames=num_samples // 1920, audio_seconds=num_samples / RATE,
                         time_to_first_audio_s=0.012, real_time_factor=0.5,
                         seed=request.seed if request.HasField("seed") else 4242)
        return pb.SynthesizeSpeechResponse(
            chunk_index=num_chunks, sample_offset=num_samples, sample_rate_hz=self._rate(request),
            encoding=request.encoding or pb.LINEAR_PCM, request_id=request.request_id or "srv-1",
            finish_reason=reason, usage=usage)

    @staticmethod
    def _rate(request) -> int:
        return request.sample_rate_hz or RATE

    def SynthesizeOnline(self, request, context):
        self._admit(request, context)
        steps, offset, outcome = self._steps(request), 0, "inactive"  # until the last yield returns
        try:
            messages = []
            for index, step in enumerate(steps):
                if not self._wait(context, step.delay_s):
                    return
                audio = pcm(offset, step.num_samples)
                if index == 0 and request.encoding == pb.WAV:
                    audio = streaming_wav_header(self._rate(request)) + audio
                messages.append(pb.SynthesizeSpeechResponse(
                    audio=audio, chunk_index=index, sample_offset=offset,
                    sample_rate_hz=self._rate(request), encoding=request.encoding or pb.LINEAR_PCM,
                    request_id=request.request_id or "srv-1"))
                offset += step.num_samples
                if not (self.final_with_audio and index == len(steps) - 1):
                    yield messages.pop()
            final = self._final(request, len(steps), offset)
            if messages:
                final.MergeFrom(messages.pop())
            yield final
            outcome = "ok"
        finally:
            self.ended.put((request.request_id, outcome))

    def Synthesize(self, request, context):
        self._admit(request, context)
        if request.text == "slow" and not self._wait(context, WAIT_S):
            self.ended.put((request.request_id, "inactive"))
            context.abort(grpc.StatusCode.CANCELLED, "gone")
        num_samples = sum(step.num_samples for step in self.plan)
        final = self._final(request, 0, 0)
        final.audio = pcm(0, num_samples)
        if request.encoding == pb.WAV:  # a whole clip's header knows its sizes
            final.audio = wav_file(self._rate(request), final.audio)
        return final

    def ListVoices(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.ListVoicesResponse(voices=[
            pb.Voice(name="narrator", speaker_id=0, language_code="en-US", description="calm",
                     aliases=["alloy", "ash"]),
            pb.Voice(name="clone", speaker_id=1, language_code="en-US", has_reference=True,
                     description="from a clip"),
        ], default_voice="narrator")


@contextlib.contextmanager
def serve_fake(sock_dir: Path | None) -> Iterator[FakeSynthesizer]:
    """A FakeSynthesizer on a unix socket in ``sock_dir`` (``.target``; None: a free loopback TCP
    port, where each connection is a peer of its own), stopped after."""
    servicer = FakeSynthesizer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    synthesizer_pb2_grpc.add_SynthesizerServicer_to_server(servicer, server)
    if sock_dir is None:
        servicer.target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    else:
        servicer.target = f"unix:{sock_dir}/fake.sock"
        server.add_insecure_port(servicer.target)
    server.start()
    try:
        yield servicer
    finally:
        server.stop(grace=None).wait(timeout=WAIT_S)


@pytest.fixture
def fake(sock_dir) -> Iterator[FakeSynthesizer]:
    with serve_fake(sock_dir) as servicer:
        yield servicer


def expect_end(fake: FakeSynthesizer, request_id: str, outcome: str) -> None:
    got = fake.ended.get(timeout=WAIT_S)
    assert got == (request_id, outcome)


# --- requests -----------------------------------------------------------------------------

def test_unset_optional_fields_stay_unset_on_the_server(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        client.synthesize("hi")
        client.synthesize("hi", temperature=0, top_k=0, seed=0, voice="clone", encoding="wav",
                          sample_rate_hz=16000, language_code="en-US", request_id="r-1")
    plain, explicit = fake.requests
    assert not any(plain.HasField(name) for name in OPTIONAL_FIELDS)
    assert (plain.voice_name, plain.language_code, plain.request_id) == ("", "", "")
    assert plain.encoding == pb.LINEAR_PCM
    assert {name for name in OPTIONAL_FIELDS if explicit.HasField(name)} == {"temperature", "top_k",
                                                                           "seed"}
    assert (explicit.temperature, explicit.top_k, explicit.seed) == (0, 0, 0)
    assert (explicit.voice_name, explicit.encoding, explicit.sample_rate_hz) == ("clone", pb.WAV, 16000)
    assert (explicit.language_code, explicit.request_id) == ("en-US", "r-1")


def test_every_optional_field_is_sent_when_passed():
    values = {"temperature": 0.5, "top_k": 7, "top_p": 0.75, "repetition_penalty": 1.25,
              "repetition_window": 16, "seed": 2**40, "max_audio_seconds": 3.5, "speed": 1.5}
    request = build_request("hi", **values)
    assert {name: getattr(request, name) for name in OPTIONAL_FIELDS} == values
    with pytest.raises(errors.InvalidArgument) as info:
        build_request("hi", encoding="m4a")
    assert info.value.field == "encoding"


@pytest.mark.parametrize(("name", "wire"), [
    ("pcm", pb.LINEAR_PCM), ("wav", pb.WAV), ("ogg_opus", pb.OGG_OPUS), ("opus", pb.OGG_OPUS),
    ("mp3", pb.MP3), ("FLAC", pb.FLAC), ("aac", pb.AAC)])
def test_every_encoding_has_a_name(name, wire):
    assert build_request("hi", encoding=name).encoding == wire


def test_client_metadata_is_sent(fake):
    with Client(fake.target, timeout=WAIT_S, metadata=[("x-request-id", "abc")]) as client:
        client.voices()
    assert fake.metadata[-1]["x-request-id"] == "abc"


def test_token_is_sent_as_bearer_metadata_on_every_call(fake):
    with Client(fake.target, timeout=WAIT_S, token="s3cret-t0ken") as client:
        client.voices()
        client.synthesize("hi", request_id="tok-1")
        list(client.stream("hi", request_id="tok-2"))
        assert "s3cret" not in repr(client) and not client.tls
    assert [m["authorization"] for m in fake.metadata[-3:]] == ["Bearer s3cret-t0ken"] * 3

    async def body():
        async with AsyncClient(fake.target, timeout=WAIT_S, token="async-t0ken") as client:
            await client.voices()

    run_async(body())
    assert fake.metadata[-1]["authorization"] == "Bearer async-t0ken"


@pytest.mark.parametrize(("kwargs", "error", "needle"), [
    (dict(token=""), ValueError, "token"),
    (dict(token="two words"), ValueError, "token"),
    (dict(token="line\n"), ValueError, "token"),
    (dict(token="t", metadata=[("authorization", "Bearer x")]), ValueError, "metadata"),
    (dict(tls=False, root_certificates=b"pem"), ValueError, "root_certificates"),
    (dict(tls_server_name="localhost"), ValueError, "tls_server_name"),
    (dict(tls=True, tls_server_name=""), ValueError, "tls_server_name"),
    (dict(root_certificates="pem as str"), TypeError, "root_certificates"),
])
def test_client_refuses_bad_security_arguments(kwargs, error, needle):
    for cls in (Client, AsyncClient):
        with pytest.raises(error, match=needle):
            cls("127.0.0.1:1", **kwargs)


def test_unauthenticated_is_typed():
    error = errors.error_from_status("UNAUTHENTICATED", "invalid bearer token")
    assert isinstance(error, errors.Unauthenticated) and error.code == "UNAUTHENTICATED"


# --- results ------------------------------------------------------------------------------

def test_stream_yields_chunks_then_final_usage(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream("hello", seed=9, request_id="s-1")
        chunks = list(stream)
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    assert [c.sample_offset for c in chunks] == [0, 480, 1440]
    assert b"".join(c.audio for c in chunks) == pcm(0, 2880)
    assert {(c.sample_rate_hz, c.encoding) for c in chunks} == {(RATE, "pcm")}
    result = stream.result
    assert (result.finish_reason, result.request_id, result.audio) == ("stop", "s-1", b"")
    assert result.usage.seed == 9 and result.usage.frames == 1
    assert result.usage.audio_seconds == pytest.approx(2880 / RATE)
    assert result.usage.time_to_first_audio_s == pytest.approx(0.012)
    assert result.usage.real_time_factor == pytest.approx(0.5)
    assert stream.time_to_first_audio_s is not None and stream.time_to_first_audio_s > 0
    expect_end(fake, "s-1", "ok")


def test_audio_on_the_final_message_is_a_chunk(fake):
    fake.final_with_audio = True
    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream("hello")
        chunks = list(stream)
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    assert b"".join(c.audio for c in chunks) == pcm(0, 2880)
    assert stream.result.finish_reason == "stop"


def test_synthesize_returns_the_whole_clip(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        result = client.synthesize("hello", max_audio_seconds=1.0, encoding="wav")
    assert result.audio == wav_file(RATE, pcm(0, 2880))
    assert (result.finish_reason, result.encoding, result.sample_rate_hz) == ("length", "wav", RATE)
    assert result.usage.seed == 4242  # the server picked it


def test_voices_lists_the_default(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        voices = client.voices()
    assert [v.name for v in voices] == ["narrator", "clone"]
    assert voices.default_voice == "narrator"
    assert [v.is_default for v in voices] == [True, False]
    assert voices[1].has_reference and voices[1].speaker_id == 1
    assert voices[0].aliases == ("alloy", "ash") and voices[1].aliases == ()


# --- typed errors -------------------------------------------------------------------------

def test_invalid_argument_carries_the_field(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        with pytest.raises(errors.InvalidArgument) as unary:
            client.synthesize("error:INVALID_ARGUMENT")
        with pytest.raises(errors.InvalidArgument) as streamed:
            list(client.stream("error:INVALID_ARGUMENT"))
    for info in (unary, streamed):
        assert info.value.field == "temperature"
        assert info.value.code == "INVALID_ARGUMENT"
        assert info.value.message.startswith("temperature:")
        assert info.value.status_code == grpc.StatusCode.INVALID_ARGUMENT


def test_resource_exhausted_carries_the_retry_hint(fake):
    with Client(fake.target, timeout=WAIT_S) as client, pytest.raises(errors.ResourceExhausted) as info:
        list(client.stream("error:RESOURCE_EXHAUSTED"))
    assert info.value.retry_after == pytest.approx(0.25)
    assert "retry after 0.25 s" in info.value.describe()


@pytest.mark.parametrize(("code", "cls"), [
    ("ALREADY_EXISTS", errors.AlreadyExists), ("CANCELLED", errors.Cancelled),
    ("DEADLINE_EXCEEDED", errors.DeadlineExceeded), ("UNAVAILABLE", errors.Unavailable),
    ("INTERNAL", errors.InternalError), ("UNIMPLEMENTED", errors.VoxringError),
    ("NOT_FOUND", errors.NotFound), ("FAILED_PRECONDITION", errors.FailedPrecondition),
])
def test_status_codes_map_to_typed_errors(fake, code, cls):
    with Client(fake.target, timeout=WAIT_S) as client:
        with pytest.raises(cls) as unary:
            client.synthesize(f"error:{code}")
        with pytest.raises(cls) as streamed:
            list(client.stream(f"error:{code}"))
    for info in (unary, streamed):
        assert type(info.value) is cls
        assert (info.value.code, info.value.message) == (code, f"scripted {code}")
        assert info.value.field is None and info.value.retry_after is None


def test_unreachable_server_is_unavailable(sock_dir):
    with Client(f"unix:{sock_dir}/nobody.sock", timeout=2) as client, \
            pytest.raises(errors.Unavailable):
        client.voices()


def test_error_mapping_without_metadata():
    """A proxy may drop trailing metadata: the field comes from the message's prefix; a
    malformed retry hint is ignored."""
    err = errors.error_from_status("INVALID_ARGUMENT", "top_p: must be in (0, 1], got 2")
    assert (type(err), err.field) == (errors.InvalidArgument, "top_p")
    err = errors.error_from_status("INVALID_ARGUMENT", "something is wrong")
    assert err.field is None
    err = errors.error_from_status("RESOURCE_EXHAUSTED", "busy", [("retry-after-s", "soon")])
    assert err.retry_after is None
    err = errors.error_from_status("RESOURCE_EXHAUSTED", "busy", [("retry-after-s", b"1.5")])
    assert err.retry_after == 1.5


# --- deadlines and cancellation -------------------------------------------------------------

def test_stream_deadline_gives_deadline_exceeded(fake):
    with Client(fake.target) as client, pytest.raises(errors.DeadlineExceeded):
        for _ in client.stream("slow", request_id="d-1", timeout=0.3):
            pass
    expect_end(fake, "d-1", "inactive")


def test_client_default_timeout_applies_to_unary_calls(fake):
    with Client(fake.target, timeout=0.3) as client, pytest.raises(errors.DeadlineExceeded):
        client.synthesize("slow", request_id="d-2")


def test_cancel_ends_the_stream_quietly_and_stops_the_server(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream("slow", request_id="c-1")
        first = next(stream)
        stream.cancel()
        rest = list(stream)
    assert first.chunk_index == 0 and rest == []
    assert stream.cancelled and stream.result is None
    expect_end(fake, "c-1", "inactive")


def test_cancel_from_another_thread_unblocks_the_reader(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream("slow", request_id="c-2")
        next(stream)
        threading.Timer(0.2, stream.cancel).start()
        assert len(list(stream)) < 20  # it ended: cancelled, not run to the end
    expect_end(fake, "c-2", "inactive")


def test_breaking_out_of_the_loop_cancels(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream("slow", request_id="c-3")
        for chunk in stream:
            if chunk.chunk_index == 1:
                break
        expect_end(fake, "c-3", "inactive")
        assert stream.cancelled


def test_leaving_the_with_block_cancels(fake):
    with Client(fake.target, timeout=WAIT_S) as client, client.stream("slow", request_id="c-4") as stream:
        next(stream)
    expect_end(fake, "c-4", "inactive")


# --- the grpc.aio client --------------------------------------------------------------------

def run_async(coro):
    """Runs an async test body, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout=3 * WAIT_S))


def test_async_client_streams_synthesizes_and_lists(fake):
    async def body():
        async with AsyncClient(fake.target, timeout=WAIT_S) as client:
            stream = client.stream("hello", top_p=0.5, request_id="a-1")
            chunks = [chunk async for chunk in stream]
            result = await client.synthesize("hello")
            voices = await client.voices()
        return chunks, stream.result, result, voices

    chunks, final, result, voices = run_async(body())
    assert [(c.chunk_index, c.sample_offset) for c in chunks] == [(0, 0), (1, 480), (2, 1440)]
    assert b"".join(c.audio for c in chunks) == pcm(0, 2880) == result.audio
    assert (final.finish_reason, final.request_id) == ("stop", "a-1")
    assert voices.default_voice == "narrator"
    streamed, unary = fake.requests
    assert {name for name in OPTIONAL_FIELDS if streamed.HasField(name)} == {"top_p"}
    assert not any(unary.HasField(name) for name in OPTIONAL_FIELDS)


def test_async_client_typed_errors(fake):
    async def body():
        async with AsyncClient(fake.target, timeout=WAIT_S) as client:
            caught = []
            for text in ("error:INVALID_ARGUMENT", "error:RESOURCE_EXHAUSTED", "error:UNAVAILABLE"):
                try:
                    async for _ in client.stream(text):
                        pass
                except errors.VoxringError as exc:
                    caught.append(exc)
            try:
                await client.synthesize("error:ALREADY_EXISTS")
            except errors.VoxringError as exc:
                caught.append(exc)
        return caught

    invalid, exhausted, unavailable, exists = run_async(body())
    assert isinstance(invalid, errors.InvalidArgument) and invalid.field == "temperature"
    assert isinstance(exhausted, errors.ResourceExhausted) and exhausted.retry_after == 0.25
    assert isinstance(unavailable, errors.Unavailable)
    assert isinstance(exists, errors.AlreadyExists)


def test_async_deadline_gives_deadline_exceeded(fake):
    async def body():
        async with AsyncClient(fake.target) as client:
            started = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded):
                async for _ in client.stream("slow", request_id="ad-1", timeout=0.3):
                    pass
            with pytest.raises(errors.DeadlineExceeded):
                await client.synthesize("slow", timeout=0.3)
            return time.monotonic() - started

    assert run_async(body()) < 5
    expect_end(fake, "ad-1", "inactive")


def test_async_break_and_cancel_stop_the_server(fake):
    async def body():
        async with AsyncClient(fake.target, timeout=WAIT_S) as client:
            held = client.stream("slow", request_id="ac-1")  # still referenced after the loop
            async for chunk in held:
                if chunk.chunk_index == 1:
                    break
            await asyncio.to_thread(expect_end, fake, "ac-1", "inactive")
            assert held.cancelled
            stream = client.stream("slow", request_id="ac-2")
            await stream.__anext__()
            stream.cancel()
            rest = [chunk async for chunk in stream]
            await asyncio.to_thread(expect_end, fake, "ac-2", "inactive")
            return stream, rest

    stream, rest = run_async(body())
    assert stream.cancelled and rest == [] and stream.result is None


def test_cancelling_the_reading_task_cancels_the_call(fake):
    async def body():
        async with AsyncClient(fake.target, timeout=WAIT_S) as client:
            stream = client.stream("slow", request_id="ac-3")

            async def consume():
                async for _ in stream:
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(expect_end, fake, "ac-3", "inactive")

    run_async(body())
