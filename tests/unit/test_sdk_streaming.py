"""``stream_text`` (voxring.sessions through voxring.client) against an in-process fake
gateway on a unix socket whose StreamingSynthesize echoes: a sentence (ended by ".") or
a flush is spoken as one segment of a frame per word. Checked: the request
messages (config first, then each piece and marker in order, as the caller's iterable
gives them), the events made of the responses, typed errors, an exception of the pieces,
cancellation, and the grpc.aio client."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

import voxring
from tests.unit.test_sdk import RATE, WAIT_S, FakeSynthesizer, pcm, run_async, streaming_wav_header
from voxring import errors
from voxring.client import AsyncClient, Client
from voxring.sessions import MAX_PIECE_CHARS, SegmentAudio, SegmentDone, SessionDone, build_config
from voxring.v1 import common_pb2, synthesizer_pb2_grpc
from voxring.v1 import synthesizer_pb2 as pb

SPF = 1920  # samples a frame
SESSION_OPTIONALS = ("temperature", "top_k", "top_p", "repetition_penalty", "repetition_window",
                     "seed", "max_audio_seconds", "min_segment_chars", "max_wait_s")


def kinds(messages: list[pb.StreamingSynthesizeRequest]) -> list[tuple[str, str]]:
    """Each message as (kind, text): ("config", ""), ("text", "Hello "), ("flush", "")."""
    return [(m.WhichOneof("kind"), m.text) for m in messages]


@dataclass
class EchoSession:
    """One session's state on the fake: the text not yet spoken, what was spoken."""

    config: pb.StreamingConfig
    frame_delay_s: float = 0.0
    buffer: str = ""
    num_segments: int = 0
    num_chunks: int = 0
    num_samples: int = 0

    def rate(self) -> int:
        return self.config.sample_rate_hz or RATE

    def speak_sentences(self, context) -> Iterator[pb.StreamingSynthesizeResponse]:
        """Each whole sentence buffered (ended by "." and a space, or by the buffer's end)."""
        while (end := self.buffer.find(". ")) >= 0 or self.buffer.rstrip().endswith("."):
            cut = end + 1 if end >= 0 else len(self.buffer)
            sentence, self.buffer = self.buffer[:cut], self.buffer[cut:]
            yield from self.speak(context, sentence)

    def speak(self, context, text: str | None = None) -> Iterator[pb.StreamingSynthesizeResponse]:
        """``text`` (default: all the buffered text) as a segment: a chunk per word (a frame
        each), then its end."""
        if text is None:
            text, self.buffer = self.buffer, ""
        text = text.strip()
        if not text:
            return
        index, num_frames = self.num_segments, max(1, len(text.split()))
        rid = self.config.request_id or "srv-1"
        for _ in range(num_frames):
            if self.frame_delay_s and not FakeSynthesizer._wait(context, self.frame_delay_s):
                return
            audio = pcm(self.num_samples, SPF)
            if self.num_chunks == 0 and self.config.encoding == pb.WAV:
                audio = streaming_wav_header(self.rate()) + audio
            yield pb.StreamingSynthesizeResponse(request_id=rid, audio=pb.StreamingAudio(
                audio=audio, chunk_index=self.num_chunks, sample_offset=self.num_samples,
                sample_rate_hz=self.rate(), encoding=self.config.encoding or pb.LINEAR_PCM,
                segment_index=index, segment_text=text))
            self.num_chunks += 1
            self.num_samples += SPF
        usage = pb.Usage(frames=num_frames, audio_seconds=num_frames * SPF / self.rate(),
                         time_to_first_audio_s=0.01 * (index + 1), real_time_factor=0.5,
                         seed=self.config.seed)
        self.num_segments += 1
        yield pb.StreamingSynthesizeResponse(request_id=rid, segment_done=pb.SegmentDone(
            segment_index=index, text=text, finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage))

    def done(self) -> pb.StreamingSynthesizeResponse:
        frames = self.num_samples // SPF
        usage = pb.Usage(frames=frames, audio_seconds=self.num_samples / self.rate(),
                         time_to_first_audio_s=0.02, real_time_factor=0.25, seed=self.config.seed)
        done = pb.SessionDone(finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage,
                              segments=self.num_segments)
        return pb.StreamingSynthesizeResponse(request_id=self.config.request_id or "srv-1", done=done)


@dataclass
class FakeGateway(synthesizer_pb2_grpc.SynthesizerServicer):
    """StreamingSynthesize, echo-like. The config's voice picks other behaviours:
    "error:<CODE>" refuses the config with that code (INVALID_ARGUMENT names
    "config.voice_name" in "voxring-field"); "slow" sends a frame every 50 ms. A text
    piece holding "error:<CODE>" aborts the session there, after speaking what came
    before it. ``received``: every client message as it arrives; ``ended``: (request_id,
    "ok" | "inactive") as each call's handler ends, "inactive" when it was cut short
    (cancelled, deadline, aborted)."""

    target: str = ""
    sessions: list[list[pb.StreamingSynthesizeRequest]] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    received: queue.Queue = field(default_factory=queue.Queue)
    ended: queue.Queue = field(default_factory=queue.Queue)

    def StreamingSynthesize(self, request_iterator, context):
        messages: list[pb.StreamingSynthesizeRequest] = []
        self.sessions.append(messages)
        self.metadata.append(dict(context.invocation_metadata()))
        session, outcome = None, "inactive"
        try:
            for message in request_iterator:
                messages.append(message)
                self.received.put(message)
                if session is None:
                    session = self._open(message, context)
                else:
                    yield from self._on(session, message, context)
            if session is not None:
                yield from session.speak(context)
                yield session.done()
                outcome = "ok"
        except grpc.RpcError:  # the client went away: the request stream fails
            return
        finally:
            self.ended.put((session.config.request_id if session else "", outcome))

    @staticmethod
    def _open(message: pb.StreamingSynthesizeRequest, context) -> EchoSession:
        config = message.config
        if config.voice_name.startswith("error:"):
            code = config.voice_name.removeprefix("error:")
            if code == "INVALID_ARGUMENT":
                context.set_trailing_metadata((("voxring-field", "config.voice_name"),))
            context.abort(grpc.StatusCode[code], f"config.voice_name: scripted {code}")
        return EchoSession(config, frame_delay_s=0.05 if config.voice_name == "slow" else 0.0)

    @staticmethod
    def _on(session: EchoSession, message: pb.StreamingSynthesizeRequest, context):
        kind = message.WhichOneof("kind")
        if kind == "text":
            text, _, code = message.text.partition("error:")
            session.buffer += text
            yield from session.speak_sentences(context)
            if code:
                context.abort(grpc.StatusCode[code.split()[0]], f"scripted {code.split()[0]}")
        elif kind == "flush":
            yield from session.speak(context)
        elif kind == "clear":
            session.buffer = ""


@contextlib.contextmanager
def serve_fake_gateway(sock_dir: Path) -> Iterator[FakeGateway]:
    servicer = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    synthesizer_pb2_grpc.add_SynthesizerServicer_to_server(servicer, server)
    servicer.target = f"unix:{sock_dir}/gateway.sock"
    server.add_insecure_port(servicer.target)
    server.start()
    try:
        yield servicer
    finally:
        server.stop(grace=None).wait(timeout=WAIT_S)


@pytest.fixture
def fake(sock_dir) -> Iterator[FakeGateway]:
    with serve_fake_gateway(sock_dir) as servicer:
        yield servicer


def expect_end(fake: FakeGateway, request_id: str, outcome: str) -> None:
    assert fake.ended.get(timeout=WAIT_S) == (request_id, outcome)


def wait_received(fake: FakeGateway, text: str) -> None:
    """Until the fake has read a text message ``text`` (and so the config before it)."""
    while fake.received.get(timeout=WAIT_S).text != text:
        pass


# --- requests -----------------------------------------------------------------------------

def test_pieces_and_markers_become_messages_in_order_after_the_config(fake):
    long_piece = "word " * 500  # 2500 characters: sent as several messages
    pieces = ["Hello ", "there. ", "", "Second one", voxring.FLUSH, "dropped", voxring.CLEAR,
              long_piece, "Last bit"]
    with Client(fake.target, timeout=WAIT_S, token="t0ken") as client:
        list(client.stream_text(iter(pieces), request_id="r-1"))
    messages = fake.sessions[-1]
    splits = [("text", long_piece[i:i + MAX_PIECE_CHARS])
              for i in range(0, len(long_piece), MAX_PIECE_CHARS)]
    assert kinds(messages) == [("config", ""), ("text", "Hello "), ("text", "there. "),
                               ("text", "Second one"), ("flush", ""), ("text", "dropped"),
                               ("clear", ""), *splits, ("text", "Last bit")]
    assert len(splits) == 3 and all(len(text) <= MAX_PIECE_CHARS for _, text in splits)
    assert fake.metadata[-1]["authorization"] == "Bearer t0ken"
    expect_end(fake, "r-1", "ok")


def test_only_the_options_passed_are_set_on_the_config(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        list(client.stream_text(["Hi."]))
        list(client.stream_text(["Hi."], voice="clone", encoding="wav", sample_rate_hz=16000,
                                language_code="en-US", temperature=0, top_k=0, seed=0,
                                min_segment_chars=0, max_wait_s=0.5, max_audio_seconds=9.0))
    plain, explicit = (session[0].config for session in fake.sessions)
    assert not any(plain.HasField(name) for name in SESSION_OPTIONALS)
    assert (plain.voice_name, plain.encoding, plain.sample_rate_hz, plain.request_id) == (
        "", pb.LINEAR_PCM, 0, "")
    assert {name for name in SESSION_OPTIONALS if explicit.HasField(name)} == {
        "temperature", "top_k", "seed", "min_segment_chars", "max_wait_s", "max_audio_seconds"}
    assert (explicit.min_segment_chars, explicit.max_wait_s, explicit.max_audio_seconds) == (0, 0.5, 9.0)
    assert (explicit.voice_name, explicit.encoding, explicit.sample_rate_hz) == ("clone", pb.WAV, 16000)


def test_bad_options_and_pieces_are_refused_before_the_call(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        with pytest.raises(errors.InvalidArgument) as info:
            client.stream_text(["Hi."], encoding="m4a")
        assert info.value.field == "encoding"
        with pytest.raises(TypeError, match="not one string"):
            client.stream_text("Hello there.")
        with pytest.raises(TypeError, match="iterable"):
            client.stream_text(42)
        with pytest.raises(TypeError, match="speed"):
            client.stream_text(["Hi."], speed=1.5)
    assert not fake.sessions
    assert build_config(top_p=0.5).HasField("top_p") and not build_config().HasField("top_p")


def test_pieces_are_read_as_the_session_goes(fake):
    """The second sentence is written only once the first one's end has come back: a
    client that read every piece before sending any would never get there."""
    first_spoken = threading.Event()
    waited = []

    def pieces():
        yield "One sentence here. "
        waited.append(first_spoken.wait(WAIT_S))
        yield "And a second."

    with Client(fake.target, timeout=3 * WAIT_S) as client:
        events = []
        for event in client.stream_text(pieces()):
            events.append(event)
            if isinstance(event, SegmentDone) and event.segment_index == 0:
                first_spoken.set()
    assert waited == [True]
    assert [e.text for e in events if isinstance(e, SegmentDone)] == ["One sentence here.", "And a second."]


# --- events -------------------------------------------------------------------------------

def test_responses_become_events_in_order(fake):
    pieces = ["Hello ", "there. ", "Second one", voxring.FLUSH, "dropped", voxring.CLEAR, "Last bit"]
    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream_text(pieces, seed=7, request_id="e-1")
        events = list(stream)
    names = [type(e).__name__ for e in events]
    assert names == ["SegmentAudio", "SegmentAudio", "SegmentDone"] * 3 + ["SessionDone"]
    audio = [e for e in events if isinstance(e, SegmentAudio)]
    assert [a.chunk_index for a in audio] == list(range(6))
    assert [a.sample_offset for a in audio] == [i * SPF for i in range(6)]
    assert [a.segment_index for a in audio] == [0, 0, 1, 1, 2, 2]
    assert [a.segment_text for a in audio[::2]] == ["Hello there.", "Second one", "Last bit"]
    assert b"".join(a.audio for a in audio) == pcm(0, 6 * SPF)
    assert {(a.sample_rate_hz, a.encoding) for a in audio} == {(RATE, "pcm")}
    ends = [e for e in events if isinstance(e, SegmentDone)]
    assert [(e.segment_index, e.text, e.finish_reason) for e in ends] == [
        (0, "Hello there.", "stop"), (1, "Second one", "stop"), (2, "Last bit", "stop")]
    assert [e.usage.frames for e in ends] == [2, 2, 2]
    assert ends[1].usage.time_to_first_audio_s == pytest.approx(0.02)
    assert ends[0].usage.audio_seconds == pytest.approx(2 * SPF / RATE) and ends[0].usage.seed == 7
    done = events[-1]
    assert isinstance(done, SessionDone) and stream.result == done
    assert (done.finish_reason, done.num_segments, done.request_id) == ("stop", 3, "e-1")
    assert (done.usage.frames, done.usage.seed) == (6, 7)
    assert done.usage.real_time_factor == pytest.approx(0.25)
    assert stream.time_to_first_audio_s is not None and stream.time_to_first_audio_s > 0


def test_a_session_with_no_text_ends_with_only_its_done(fake):
    with Client(fake.target, timeout=WAIT_S) as client:
        events = list(client.stream_text([]))
    assert len(events) == 1 and isinstance(events[0], SessionDone) and events[0].num_segments == 0


# --- errors and cancellation --------------------------------------------------------------

def test_a_refused_config_raises_invalid_argument_naming_the_field(fake):
    with Client(fake.target, timeout=WAIT_S) as client, pytest.raises(errors.InvalidArgument) as info:
        list(client.stream_text(["Hello."], voice="error:INVALID_ARGUMENT"))
    assert info.value.field == "config.voice_name"
    assert info.value.message.startswith("config.voice_name:")


@pytest.mark.parametrize(("code", "cls"), [
    ("RESOURCE_EXHAUSTED", errors.ResourceExhausted), ("ALREADY_EXISTS", errors.AlreadyExists),
    ("UNAVAILABLE", errors.Unavailable), ("INTERNAL", errors.InternalError),
])
def test_an_error_mid_session_is_typed_after_the_events_before_it(fake, code, cls):
    events = []
    with Client(fake.target, timeout=WAIT_S) as client, pytest.raises(cls) as info:
        for event in client.stream_text(["First one. ", f"error:{code}", "Never said."]):
            events.append(event)
    assert type(info.value) is cls and info.value.message == f"scripted {code}"
    assert [type(e).__name__ for e in events] == ["SegmentAudio", "SegmentAudio", "SegmentDone"]


def test_the_deadline_bounds_the_whole_session(fake):
    with Client(fake.target) as client, pytest.raises(errors.DeadlineExceeded):
        list(client.stream_text(["A long sentence of many many words here."], voice="slow",
                                request_id="d-1", timeout=0.3))
    expect_end(fake, "d-1", "inactive")


def test_an_exception_of_the_pieces_cancels_the_call_and_is_raised(fake):
    """It is not taken for the end of the text: the server never speaks "half"."""
    class LanguageModelGone(RuntimeError):
        pass

    def pieces():
        yield "Said first. "
        wait_received(fake, "Said first. ")  # the session is open on the fake
        yield "half"
        raise LanguageModelGone("the model's connection dropped")

    with Client(fake.target, timeout=WAIT_S) as client, pytest.raises(LanguageModelGone):
        list(client.stream_text(pieces(), request_id="x-1"))
    expect_end(fake, "x-1", "inactive")  # "ok" had it taken the exception for the end of the text
    sent = [("config", ""), ("text", "Said first. "), ("text", "half")]
    assert kinds(fake.sessions[-1]) in (sent, sent[:2])  # the cancel may overtake "half"
    def bad_pieces():
        yield "Fine. "
        wait_received(fake, "Fine. ")
        yield 3

    with Client(fake.target, timeout=WAIT_S) as client, pytest.raises(TypeError, match="got int"):
        list(client.stream_text(bad_pieces(), request_id="x-2"))
    expect_end(fake, "x-2", "inactive")


def test_breaking_out_cancels_the_session(fake):
    def pieces():  # the text never ends: only the cancel ends the call
        yield "A long sentence of many many words here. "
        time.sleep(WAIT_S)

    with Client(fake.target, timeout=WAIT_S) as client:
        stream = client.stream_text(pieces(), voice="slow", request_id="c-1")
        for event in stream:
            if isinstance(event, SegmentAudio) and event.chunk_index == 1:
                break
        expect_end(fake, "c-1", "inactive")
        assert stream.cancelled and stream.result is None


# --- the grpc.aio client ------------------------------------------------------------------

def test_async_stream_text_takes_async_and_blocking_pieces(fake):
    async def body():
        first_spoken = asyncio.Event()

        async def pieces():
            yield "Async one. "
            await asyncio.wait_for(first_spoken.wait(), WAIT_S)  # read as the session goes
            yield "Then more"
            yield voxring.FLUSH

        def blocking_pieces():
            yield "From a thread. "
            time.sleep(0.05)  # blocks its worker thread, not the event loop
            yield "Done."

        async with AsyncClient(fake.target, timeout=WAIT_S) as client:
            events = []
            async for event in client.stream_text(pieces(), request_id="a-1"):
                events.append(event)
                if isinstance(event, SegmentDone):
                    first_spoken.set()
            threaded = [event async for event in client.stream_text(blocking_pieces())]
        return events, threaded

    events, threaded = run_async(body())
    assert [e.text for e in events if isinstance(e, SegmentDone)] == ["Async one.", "Then more"]
    assert isinstance(events[-1], SessionDone) and events[-1].request_id == "a-1"
    assert kinds(fake.sessions[0]) == [("config", ""), ("text", "Async one. "), ("text", "Then more"),
                                       ("flush", "")]
    assert [e.text for e in threaded if isinstance(e, SegmentDone)] == ["From a thread.", "Done."]


def test_async_errors_are_typed_and_a_pieces_exception_is_raised(fake):
    async def body():
        async def failing():
            yield "Spoken. "
            await asyncio.to_thread(wait_received, fake, "Spoken. ")
            raise ValueError("bad piece source")

        async with AsyncClient(fake.target, timeout=WAIT_S) as client:
            with pytest.raises(errors.InvalidArgument) as info:
                # no piece in flight when the fake refuses: grpc.aio may report a write that
                # fails as the call ends as INTERNAL instead of the server's code (grpc/grpc#36066)
                async for _ in client.stream_text([], voice="error:INVALID_ARGUMENT"):
                    pass
            with pytest.raises(ValueError, match="bad piece source"):
                async for _ in client.stream_text(failing(), request_id="ax-1"):
                    pass
            with pytest.raises(errors.DeadlineExceeded):
                async for _ in client.stream_text(["Many many words to say here."], voice="slow",
                                                  timeout=0.3):
                    pass
        return info.value

    invalid = run_async(body())
    assert invalid.field == "config.voice_name"
    outcomes = {fake.ended.get(timeout=WAIT_S) for _ in range(3)}
    assert ("ax-1", "inactive") in outcomes
