"""One synthesis request through an engine pair (docs/protocol.md, One request, in order; a text of several
sentences is spoken as a session instead: services/gateway/long_text.py):

admission -> route to a pair -> build the prompt (the voice's speaker, its reference
clip as an audio-context turn) -> choose the chunk schedule from load -> Code2Wav.Open
(its first message is the handle) -> Talker.Submit with that handle -> relay the PCM
chunks, encoded (PCM, WAV, Ogg/Opus, MP3, AAC, FLAC) at the client's rate and speed, ending
with the finish reason and usage. A client cancel or deadline cancels the Open stream and the talker's
row; a stage's error status reaches the client as docs/protocol.md's endings table (How a request ends) says.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common import errors
from services.common.histogram import EdgeHistogram
from services.common.limits import LengthLimit, new_seed
from services.common.listener import Listener
from services.common.metrics import TIME_TO_FIRST_AUDIO
from services.gateway.audio import make_encoder, whole_file
from services.gateway.config import GatewayConfig
from services.gateway.pipeline_metrics import pipeline_metrics
from services.gateway.routing import REQUEST_DOWN_S, EnginePair, ModelFacts, Router
from services.gateway.stage_errors import stage_error, stage_message
from services.gateway.validation import ValidRequest
from services.gateway.voice_cache import VoiceCache
from services.gateway.voices import VoiceCatalog
from voxring.v1 import code2wav_pb2, common_pb2, talker_pb2
from voxring.v1 import synthesizer_pb2 as pb

ATTACH_WAIT_S, ATTACH_WAIT_STEPS = 0.1, 20  # up to 2 s for a Code2Wav to attach
REFUSAL_EDGES = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
RELAY_EDGES = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1)


class RefusedHere(errors.ResourceExhausted):
    """A refusal for capacity this gateway answers itself, without a stage: its in-flight limit,
    a talker's watched verdict, or that talker's refusal of a moment ago."""

@dataclass
class Started:
    """A request whose stages are running."""

    pair: EnginePair
    call: grpc.aio.UnaryStreamCall
    handle: int
    seed: int
    arrival: float
    limit: LengthLimit = LengthLimit.DEFAULT  # the term of the audio cap (services/common/limits.py)
    facts: ModelFacts | None = None  # its pair's model, as it started (readiness may learn it anew)


log = logging.getLogger(__name__)

def _remaining(request: ValidRequest) -> float | None:
    """Seconds left of the client's deadline (None: no deadline), for the stages' calls."""
    return None if request.deadline is None else max(request.deadline - time.monotonic(), 0.001)


async def _opened(call: grpc.aio.UnaryStreamCall, pair: EnginePair) -> int:
    """The handle of Code2Wav's Open (its first message)."""
    try:
        return (await call.read()).opened.handle
    except grpc.aio.AioRpcError as exc:
        raise stage_error(exc, "code2wav", pair) from None


def prompt_positions(segments: list[talker_pb2.PromptSegment]) -> int:
    """The talker's positions for a Submit's prompt: each turn's text, and an audio turn's frames
    and its end frame (docs/architecture.md, Model families)."""
    return sum(len(s.text_token_ids) + (s.frames.num_frames + 1 if s.frames.num_frames else 0)
               for s in segments)


def first_audio_budget(target: float, arrival: float, now: float) -> float:
    """What is left of the time-to-first-audio ``target`` after the gateway's own work since
    ``arrival`` (docs/protocol.md, Pacing); at least a millisecond (0 means the talker's default)."""
    return max(1e-3, target - (now - arrival)) if target else 0.0


class SynthesisPipeline:
    def __init__(self, config: GatewayConfig, router: Router, voices: VoiceCatalog) -> None:
        self.config = config
        self.router = router
        self.voice_cache = VoiceCache(voices)
        self.completed = 0          # requests that ended with their final message
        self.frames = 0
        self.audio_seconds = 0.0
        self.sessions = 0           # streaming sessions (and long texts) that ended with their SessionDone
        self.session_segments = 0   # ... and the segments they spoke
        self._admitting = 0         # admitted, still waiting in router.acquire()
        self.refusals_held = 0      # refused here: a pair's talker's verdict, or its refusal of a moment ago
        # chunks that reached this gateway after the listener it models (playback from the first
        # chunk received) ran dry: stalls made before the gateway, to set beside Code2Wav's own count
        self.listener_underruns = 0
        # a request's start, apart: Code2Wav's Open (to its handle) and the talker's Submit (to its
        # answer, admitted or refused): how many, and their seconds
        self.start_counts = {"opens": 0, "open_s": 0.0, "submits": 0, "submit_s": 0.0}
        # a one-segment request's refusal for capacity, from its start here to the refusal: answered
        # here, or by a stage (after an Open and a Submit); how much of a client's wait is this gateway's
        self.refusal_time = {"here": EdgeHistogram(REFUSAL_EDGES), "stages": EdgeHistogram(REFUSAL_EDGES)}
        # a one-segment request's first chunk: from Code2Wav's send (its Finished.first_chunk_s
        # after its Open) to its receipt here, the Open's way to Code2Wav included; each side's
        # own clock, so no two clocks are compared
        self.first_chunk_relay = EdgeHistogram(RELAY_EDGES)
        self._cancels: set[asyncio.Task] = set()  # Talker.Cancel calls in flight

    def metrics(self) -> dict:
        """Its /metrics (services/gateway/pipeline_metrics.py)."""
        return pipeline_metrics(self)

    # --- the public shapes -----------------------------------------------------------------------

    async def stream(self, request: ValidRequest) -> AsyncIterator[pb.SynthesizeSpeechResponse]:
        """The request as one segment; services/gateway/synthesis.py sends a text of several
        sentences down the session path instead."""
        async with self._running(request) as started:
            facts = started.facts
            out_rate = request.sample_rate_hz or facts.sample_rate
            encoder = make_encoder(request.encoding, facts.sample_rate, out_rate, request.speed)
            first_audio = None
            listener = Listener(0.0)  # seconds per frame unused: chunks are counted by their samples
            async for message in self._chunks(started):
                if message.HasField("chunk"):
                    now = time.monotonic()
                    if first_audio is None:
                        first_audio = now
                        TIME_TO_FIRST_AUDIO.observe(first_audio - started.arrival)
                    chunk = message.chunk
                    seconds = len(chunk.pcm) / 2 / facts.sample_rate / request.speed  # as the client plays it
                    if listener.sent_audio(now, seconds) < 0:
                        self.listener_underruns += 1
                    # Output samples before this chunk's (after speed and resampling), so that
                    # offset + this chunk's samples is the next offset at any speed and rate.
                    sample_offset = encoder.samples_out
                    yield pb.SynthesizeSpeechResponse(
                        audio=encoder.encode(chunk.pcm), chunk_index=chunk.chunk_index,
                        sample_offset=sample_offset,
                        sample_rate_hz=out_rate, encoding=request.encoding, request_id=request.request_id)
                else:
                    if first_audio is not None and message.finished.first_chunk_s > 0:
                        self.first_chunk_relay.observe_one(max(
                            0.0, first_audio - started.arrival - message.finished.first_chunk_s))
                    tail = encoder.finish()  # counted in samples_out: the audio sent, after speed
                    yield self._final(request, started, message.finished, tail, out_rate,
                                      first_audio, encoder.samples_out / out_rate)

    async def whole(self, request: ValidRequest) -> pb.SynthesizeSpeechResponse:
        """The whole clip in one message: a complete file (WAV's sizes, FLAC's length and MD5,
        MP3's gapless header) or, for the other encodings, the stream's bytes."""
        as_pcm = request.encoding in (pb.WAV, pb.FLAC, pb.MP3)  # files with headers a stream leaves open
        inner = dataclasses.replace(request, encoding=pb.LINEAR_PCM) if as_pcm else request
        audio, final = [], None
        async for message in self.stream(inner):
            audio.append(message.audio)
            final = message
        data = b"".join(audio)
        if as_pcm:
            data = whole_file(request.encoding, data, final.sample_rate_hz)
        return pb.SynthesizeSpeechResponse(audio=data, sample_rate_hz=final.sample_rate_hz,
                                           encoding=request.encoding, request_id=request.request_id,
                                           finish_reason=final.finish_reason, usage=final.usage)

    # --- the steps -------------------------------------------------------------------------------

    def _check_in_flight(self) -> None:
        limit = self.config.admission.max_in_flight
        if self.router.in_flight + self._admitting >= limit:
            raise RefusedHere(f"{limit} requests in flight; retry shortly",
                              retry_after=self.config.admission.retry_after_s)

    @contextlib.asynccontextmanager
    async def admitted(self, model: str | None = None):
        """A pair serving ``model`` (None: the default) for a streaming session (admission as a
        request's; released on the way out)."""
        self._check_in_flight()
        self._admitting += 1
        try:
            pair = await self.router.acquire(model=model)
        finally:
            self._admitting -= 1
        try:
            yield pair
        finally:
            self.router.release(pair)

    async def cancel_on_talker(self, pair: EnginePair, handle: int) -> None:
        """Ends a request (or session) on the talker; idempotent, errors ignored (it is cleanup)."""
        await self._cancel_on_talker(Started(pair, None, handle, 0, 0.0))

    @contextlib.asynccontextmanager
    async def _running(self, request: ValidRequest):
        begun = time.monotonic()
        try:
            self._check_in_flight()
            pair, started = await self._start_on_some_pair(request)
        except errors.ResourceExhausted as exc:
            where = "here" if isinstance(exc, RefusedHere) else "stages"
            self.refusal_time[where].observe_one(time.monotonic() - begun)
            raise
        try:
            yield started
        finally:
            try:
                if started is not None and not started.call.done():
                    started.call.cancel()  # client cancel or deadline: end it on both stages
                    await self._cancel_on_talker(started)
                elif started is not None and await started.call.code() != grpc.StatusCode.OK:
                    if await started.call.code() == grpc.StatusCode.UNAVAILABLE:
                        pair.mark_down(REQUEST_DOWN_S)  # a stage died: new requests go elsewhere first
                    # Code2Wav failed or died: free the talker's row now (docs/protocol.md), not at
                    # its liveness timeout; in the background, the client's status goes first.
                    task = asyncio.ensure_future(self._cancel_on_talker(started))
                    self._cancels.add(task)
                    task.add_done_callback(self._cancels.discard)
            finally:
                self.router.release(pair)  # after the Cancel: a retired pair's channels close then

    async def _start_on_some_pair(self, request: ValidRequest) -> tuple[EnginePair, Started]:
        """Starts the request on the best pair; a pair that cannot start it (a stage
        unreachable or restarting: UNAVAILABLE) is marked down and the next pair is tried,
        each pair once. Nothing has reached the client yet, so a retry is invisible to it."""
        tried: frozenset[str] = frozenset()
        while True:
            # Admission counts the request in _admitting while no pair holds it (acquire()
            # may wait for discovery or a pair's first ModelInfo), then in the pair's count.
            self._admitting += 1
            try:
                pair = await self.router.acquire(tried, request.served_by)
            finally:
                self._admitting -= 1
            try:
                started = await self._start(pair, request)
            except errors.Unavailable:
                self.router.release(pair)
                pair.mark_down(REQUEST_DOWN_S)
                tried |= {pair.name}
                if not any(p.name not in tried and not p.retired and p.serves(request.served_by,
                                                                             self.router.default_model)
                           for p in self.router.pairs):
                    raise
                log.warning("engine pair %s could not start request %s; trying another pair",
                            pair.name, request.request_id)
                continue
            except BaseException:
                self.router.release(pair)
                raise
            pair.mark_up()
            return pair, started

    async def _start(self, pair: EnginePair, request: ValidRequest) -> Started:
        now = time.monotonic()
        held = pair.refused_for(now)
        if held:  # its talker refused a moment ago: so is this, without asking it again
            self.refusals_held += 1
            raise RefusedHere(pair.refusal, retry_after=held)
        refusing = pair.talker_refusing(now)
        if refusing is not None:  # its talker's verdict after its last step: so would its Submit
            self.refusals_held += 1
            details, retry_after = refusing
            message = stage_message("talker", grpc.StatusCode.RESOURCE_EXHAUSTED, pair, details)
            raise RefusedHere(message, retry_after=retry_after or None)
        facts = await pair.model_facts()
        msg = request.message
        seed = msg.seed if msg.HasField("seed") else new_seed()
        segments = await self.voice_cache.context(request.voice, facts, pair)
        segments.append(talker_pb2.PromptSegment(
            text_token_ids=facts.prompt_ids(request.voice.speaker_id, request.text)))
        prompt_len = prompt_positions(segments)
        cap = self.config.limits.cap(
            facts.frame_rate, asked=msg.max_audio_seconds if msg.HasField("max_audio_seconds") else None,
            text=request.text, room_frames=facts.max_len - prompt_len)
        if cap.frames < 1:
            raise errors.InvalidArgument("text", f"the prompt ({prompt_len} positions) leaves no room for "
                                         f"audio in the model's length of {facts.max_len}")
        max_frames = cap.frames
        call = pair.code2wav.Open(code2wav_pb2.OpenRequest(
            request_id=request.request_id, talker_id=pair.talker_id, max_frames=max_frames,
            speaker_id=request.voice.speaker_id, seed=seed), timeout=_remaining(request))
        started = Started(pair, call, 0, seed, time.monotonic(), cap.limit, facts)
        counts = self.start_counts
        try:
            started.handle = await _opened(call, pair)
            opened = time.monotonic()
            counts["opens"] += 1
            counts["open_s"] += opened - started.arrival
            submit = talker_pb2.SubmitRequest(
                request_id=request.request_id, handle=started.handle, consumer_id=pair.consumer_id,
                segments=segments, sampling=self.sampling(msg, seed), max_frames=max_frames,
                timeout_s=_remaining(request) or 0.0,
                first_audio_budget_s=self._first_audio_budget(started.arrival))
            pair.submitting()
            try:
                await self.submit(pair, submit)
            except grpc.aio.AioRpcError as exc:
                error = stage_error(exc, "talker", pair)
                if isinstance(error, errors.ResourceExhausted):
                    pair.hold_refusal(error.message, error.retry_after, time.monotonic())
                raise error from None
            finally:
                counts["submits"] += 1
                counts["submit_s"] += time.monotonic() - opened
        except BaseException:  # a stage refused it, or the client left while it was starting
            call.cancel()  # Code2Wav then cancels it on the talker too
            raise
        return started

    def _first_audio_budget(self, arrival: float) -> float:
        return first_audio_budget(self.config.admission.first_audio_budget_s, arrival, time.monotonic())

    @staticmethod
    async def submit(pair: EnginePair, submit: talker_pb2.SubmitRequest) -> None:
        """Submit, waiting briefly while the pair's Code2Wav (re-)attaches to its talker
        (a pair that just started, or whose Code2Wav restarted)."""
        for _ in range(ATTACH_WAIT_STEPS):
            try:
                await pair.talker.Submit(submit, timeout=5.0)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
            await asyncio.sleep(ATTACH_WAIT_S)
        raise errors.Unavailable(f"Code2Wav is not attached to its talker ({pair.label})")

    async def _chunks(self, started: Started):
        """The Open stream's messages after the first (read() throughout: grpc.aio does
        not allow mixing it with async iteration)."""
        try:
            while (message := await started.call.read()) is not grpc.aio.EOF:
                yield message
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "code2wav", started.pair) from None

    async def _cancel_on_talker(self, started: Started) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await started.pair.talker.Cancel(talker_pb2.CancelRequest(
                consumer_id=started.pair.consumer_id, handle=started.handle), timeout=2.0)

    def sampling(self, msg, seed: int) -> common_pb2.SamplingParams:
        d = self.config.sampling

        def pick(name):
            return getattr(msg, name) if msg.HasField(name) else getattr(d, name)

        return common_pb2.SamplingParams(
            temperature=pick("temperature"), top_k=pick("top_k"), top_p=pick("top_p"),
            repetition_penalty=pick("repetition_penalty"), repetition_window=pick("repetition_window"),
            seed=seed)

    def _final(self, request: ValidRequest, started: Started, finished, tail: bytes, out_rate: int,
               first_audio: float | None, audio_s: float) -> pb.SynthesizeSpeechResponse:
        """``audio_s``: the seconds of audio sent, which ``speed`` makes differ from the frames'."""
        self.completed += 1
        self.frames += finished.frames
        self.audio_seconds += audio_s
        wall = time.monotonic() - started.arrival
        reason = finished.finish_reason
        if reason not in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
            reason = common_pb2.FINISH_REASON_STOP
        usage = pb.Usage(frames=finished.frames, audio_seconds=audio_s,
                         time_to_first_audio_s=(first_audio or time.monotonic()) - started.arrival,
                         real_time_factor=wall / audio_s if audio_s else 0.0, seed=started.seed,
                         length_limit=length_limit(reason, started.limit))
        return pb.SynthesizeSpeechResponse(
            audio=tail, sample_rate_hz=out_rate, encoding=request.encoding, request_id=request.request_id,
            finish_reason=reason, usage=usage)


def length_limit(reason: int, limit: LengthLimit) -> int:
    """Usage.length_limit: the cap's term when the request ended on its cap, else unspecified."""
    if reason != common_pb2.FINISH_REASON_LENGTH:
        return pb.LENGTH_LIMIT_UNSPECIFIED
    return pb.LengthLimit.Value(f"LENGTH_LIMIT_{limit.name}")
