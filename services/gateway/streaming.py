"""StreamingSynthesize: text as a language model writes it, spoken a sentence at a time as one
session (docs/architecture.md, A session of segments; docs/protocol.md, Sessions and segments).

One call is one talker session on one engine pair. The first client message configures it
(checked as a SynthesizeSpeechRequest's fields are, each error naming ``config.<field>``), and
Code2Wav's Open stream is opened at once: its handle names the session. Text pieces go through
the segmenter (services/gateway/segmenter.py); each complete sentence is a segment: the first
is the session's Submit, the next ones Appends, so each is spoken with the earlier ones as
context and only its own text is prefilled. ``flush`` speaks what is buffered; ``clear`` drops
it, ends the segment being spoken (Talker.Clear) and mutes the audio still to come of every
segment given so far (barge-in); the end of the client's stream speaks the rest and ends the
session after its last segment (an empty last Append). The audio is one encoded stream (one
encoder for the session), each chunk marked with its segment; a SegmentDone follows each
segment's audio and a SessionDone ends the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common import errors
from services.common.limits import AudioCap, LengthLimit, frames_for, least
from services.common.metrics import CLEAR_TO_SILENCE, SEGMENT_FIRST_AUDIO, TIME_TO_FIRST_AUDIO
from services.gateway.audio import make_encoder
from services.gateway.pipeline import (
    SynthesisPipeline,
    first_audio_budget,
    length_limit,
    prompt_positions,
)
from services.gateway.routing import EnginePair
from services.gateway.segmenter import Segmenter, SegmenterConfig
from services.gateway.stage_errors import stage_error
from services.gateway.streaming_config import SessionSettings
from voxring.v1 import code2wav_pb2, common_pb2, talker_pb2
from voxring.v1 import synthesizer_pb2 as pb

_ENDED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


@dataclass
class SpokenSegment:
    """A segment given to the talker, in the order the session speaks them."""

    text: str
    completed_at: float            # when its text was complete (its last piece, or the flush)
    max_frames: int
    limit: LengthLimit             # the term of its cap (services/common/limits.py)
    first_audio_at: float | None = None
    samples_at_start: int = 0      # the session's samples sent before its first chunk


class StreamingSession:
    def __init__(self, pipeline: SynthesisPipeline, settings: SessionSettings) -> None:
        self.pipeline, self.settings = pipeline, settings
        self.config = pipeline.config
        streaming = self.config.streaming
        self.segmenter = Segmenter(SegmenterConfig(settings.min_segment_chars, streaming.max_segment_chars,
                                                   settings.max_wait_s))
        self.events: asyncio.Queue = asyncio.Queue()
        self.spoken: list[SpokenSegment] = []  # index = the segment's index on Code2Wav's stream
        self.mute_below = 0       # segments below this index were cleared: their audio is not sent
        self.c2w_index = 0        # the segment Code2Wav's chunks belong to now
        self.frames_done = 0      # frames of the segments ended
        self.closing = False      # the end of the session was asked (the client's stream ended)
        self.capped = False       # the session's audio cap was reached: no more segments
        self.chunks = 0
        self.arrival = time.monotonic()
        self.pair: EnginePair | None = None
        self.call = None
        self.handle = 0
        self.submitted = False
        self.cleared_at: float | None = None  # a clear waiting for its segment's end (the metric)

    # --- the call ---------------------------------------------------------------------------------

    async def run(self, requests: AsyncIterator) -> AsyncIterator[pb.StreamingSynthesizeResponse]:
        """The session's responses; ``requests``: the client's messages after the config."""
        async with self._opened():
            reader = asyncio.ensure_future(self._read_client(requests))
            relay = asyncio.ensure_future(self._relay())
            try:
                async for message in self._loop():
                    yield message
            finally:
                for task in (reader, relay):
                    task.cancel()
                await asyncio.gather(reader, relay, return_exceptions=True)

    async def _loop(self) -> AsyncIterator[pb.StreamingSynthesizeResponse]:
        """Client messages and Code2Wav's, in the order they come; text due by max_wait_s spoken."""
        while True:
            due = self.segmenter.due()
            timeout = None if due is None else max(0.0, due - time.monotonic())
            try:
                kind, payload = await asyncio.wait_for(self.events.get(), timeout)
            except TimeoutError:
                await self._speak(self.segmenter.flush())
                continue
            if kind == "client":
                await self._on_client(payload)
            elif kind == "client_end":
                await self._close()
            elif kind == "error":
                raise payload
            elif kind == "c2w_end":
                if not self.submitted:  # the client closed before any text: an empty session
                    empty = pb.SessionDone(finish_reason=common_pb2.FINISH_REASON_STOP,
                                           usage=pb.Usage(seed=self.settings.seed))
                    rid = self.settings.valid.request_id
                    yield pb.StreamingSynthesizeResponse(done=empty, request_id=rid)
                return
            else:  # a message of Code2Wav's stream
                for response in self._on_code2wav(payload):
                    yield response

    # --- the client's side ------------------------------------------------------------------------

    async def _read_client(self, requests: AsyncIterator) -> None:
        try:
            async for message in requests:
                await self.events.put(("client", message))
            await self.events.put(("client_end", None))
        except Exception as exc:  # the client's stream failed: the call ends with it
            await self.events.put(("error", exc))

    async def _on_client(self, message: pb.StreamingSynthesizeRequest) -> None:
        kind = message.WhichOneof("kind")
        if kind == "config":
            raise errors.InvalidArgument("config", "the session is configured by its first message only")
        if self.closing:  # cannot happen on gRPC (the stream ended); the WebSocket's close
            raise errors.InvalidArgument(kind or "kind", "the session's text was closed")
        if kind == "text":
            limit = self.config.streaming.max_piece_chars
            if len(message.text) > limit:
                raise errors.InvalidArgument("text", f"{len(message.text)} characters exceeds the limit "
                                                     f"of {limit}")
            await self._speak(self.segmenter.push(message.text, time.monotonic()))
        elif kind == "flush":
            await self._speak(self.segmenter.flush())  # nothing buffered: nothing to do
        elif kind == "clear":
            await self._clear()
        else:
            raise errors.InvalidArgument("kind", "a message must hold config, text, flush or clear")

    async def _close(self) -> None:
        """The client's text is over: the rest is spoken, then the session ends."""
        rest = self.segmenter.flush()
        await self._speak(rest, last=True)  # its last segment ends the session
        self.closing = True
        if not self.submitted:  # nothing was ever spoken: the session ends at once
            self.call.cancel()
            await self.events.put(("c2w_end", None))
        elif not rest and not self.capped:  # the session ends after the segments already given
            await self._append([], 0, last=True)

    async def _clear(self) -> None:
        self.segmenter.clear()
        if not self.submitted:
            return
        reply = await self._rpc(self.pair.talker.Clear(talker_pb2.ClearRequest(
            consumer_id=self.pair.consumer_id, handle=self.handle), timeout=5.0))
        if reply.dropped:  # queued segments the talker dropped: they will never be spoken
            del self.spoken[len(self.spoken) - reply.dropped:]
        if self.c2w_index < len(self.spoken):  # a segment was being spoken: its end closes the clear
            self.cleared_at = time.monotonic()
        self.mute_below = len(self.spoken)

    # --- segments to the talker -------------------------------------------------------------------

    async def _speak(self, texts: list[str], last: bool = False) -> None:
        for i, text in enumerate(texts):
            if self.capped:
                return
            ids = self.facts.prompt_ids(self.settings.valid.voice.speaker_id, text)
            cap = self._segment_cap(text, room=self.facts.max_len - 1 - len(ids))  # an Append's room
            if cap.frames < 1:  # the session's audio is at its cap: it ends after what was given
                self.capped = True
                if self.submitted:
                    await self._append([], 0, last=True)
                return
            is_last = last and i == len(texts) - 1
            self.spoken.append(SpokenSegment(text, time.monotonic(), cap.frames, cap.limit))
            if self.submitted:
                await self._append(ids, cap.frames, last=is_last)
            else:
                await self._submit(ids, last=is_last)
            self.closing = self.closing or is_last

    def _segment_cap(self, text: str, room: int) -> AudioCap:
        """A new segment's cap: what the session's cap leaves after the segments ended and those
        still to end (at most their own caps), its text's guard and the model's room."""
        pending = sum(s.max_frames for s in self.spoken[self.c2w_index:])
        left = AudioCap(self.session_cap.frames - self.frames_done - pending, self.session_cap.limit)
        if left.frames < 1:
            return left
        if room < 1:
            raise errors.InvalidArgument("text", f"a segment of {len(text)} characters leaves no room for "
                                         f"audio in the model's length {self.facts.max_len}")
        guard = AudioCap(frames_for(self.config.limits.text_guard_s(text), self.facts.frame_rate),
                         LengthLimit.TEXT)
        return least(left, guard, AudioCap(room, LengthLimit.MODEL))

    async def _submit(self, ids: list[int], last: bool) -> None:
        valid, segment = self.settings.valid, self.spoken[-1]
        segments = await self.pipeline.voice_cache.context(valid.voice, self.facts, self.pair)
        segments.append(talker_pb2.PromptSegment(text_token_ids=ids))
        room = self.facts.max_len - prompt_positions(segments)  # the voice's turns count too
        if room < segment.max_frames:
            if room < 1:
                raise errors.InvalidArgument("text", f"the voice's context and the first segment leave "
                                             f"no room for audio in the model's length {self.facts.max_len}")
            segment.max_frames, segment.limit = room, LengthLimit.MODEL
        max_frames = segment.max_frames
        submit = talker_pb2.SubmitRequest(
            request_id=valid.request_id, handle=self.handle, consumer_id=self.pair.consumer_id,
            segments=segments, sampling=self.pipeline.sampling(valid.message, self.settings.seed),
            max_frames=max_frames, session=True,
            first_audio_budget_s=first_audio_budget(self.config.admission.first_audio_budget_s,
                                                    self.spoken[-1].completed_at, time.monotonic()))
        try:
            await self.pipeline.submit(self.pair, submit)
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "talker", self.pair) from None
        self.submitted = True
        if last:
            await self._append([], 0, last=True)

    async def _append(self, ids: list[int], max_frames: int, last: bool) -> None:
        await self._rpc(self.pair.talker.Append(talker_pb2.AppendRequest(
            consumer_id=self.pair.consumer_id, handle=self.handle, text_token_ids=ids, max_frames=max_frames,
            last=last, first_audio_budget_s=self.config.admission.first_audio_budget_s), timeout=5.0))

    async def _rpc(self, call):
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "talker", self.pair) from None

    # --- Code2Wav's side --------------------------------------------------------------------------

    async def _relay(self) -> None:
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                await self.events.put(("c2w", message))
            await self.events.put(("c2w_end", None))
        except grpc.aio.AioRpcError as exc:
            if not self.closing or exc.code() != grpc.StatusCode.CANCELLED:
                await self.events.put(("error", stage_error(exc, "code2wav", self.pair)))
            else:
                await self.events.put(("c2w_end", None))

    def _on_code2wav(self, message: code2wav_pb2.OpenResponse) -> list[pb.StreamingSynthesizeResponse]:
        kind = message.WhichOneof("kind")
        if kind == "chunk":
            return self._audio(message.chunk)
        if kind == "segment_end":
            return [self._segment_done(message.segment_end)]
        if kind == "finished":
            return self._session_done(message.finished)
        return []

    def _audio(self, chunk: code2wav_pb2.AudioChunk) -> list[pb.StreamingSynthesizeResponse]:
        index = self.c2w_index
        if index < self.mute_below or index >= len(self.spoken):
            return []  # a cleared segment's audio still in flight: the client stopped it
        segment = self.spoken[index]
        if segment.first_audio_at is None:
            segment.first_audio_at = time.monotonic()
            segment.samples_at_start = self.encoder.samples_out
            if index == 0:
                TIME_TO_FIRST_AUDIO.observe(segment.first_audio_at - self.arrival)
            SEGMENT_FIRST_AUDIO.observe(segment.first_audio_at - segment.completed_at)
        offset = self.encoder.samples_out
        audio = pb.StreamingAudio(audio=self.encoder.encode(chunk.pcm), chunk_index=self.chunks,
                                  sample_offset=offset, sample_rate_hz=self.out_rate,
                                  encoding=self.settings.valid.encoding, segment_index=index,
                                  segment_text=segment.text)
        self.chunks += 1
        return [pb.StreamingSynthesizeResponse(audio=audio, request_id=self.settings.valid.request_id)]

    def _segment_done(self, end: code2wav_pb2.SegmentEnd) -> pb.StreamingSynthesizeResponse:
        index = self.c2w_index
        self.c2w_index += 1
        self.frames_done += end.frames
        if self.cleared_at is not None and end.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
            CLEAR_TO_SILENCE.observe(time.monotonic() - self.cleared_at)
            self.cleared_at = None
        segment = self.spoken[index] if index < len(self.spoken) else \
            SpokenSegment("", time.monotonic(), 0, self.session_cap.limit)
        now = time.monotonic()
        audio_s = (self.encoder.samples_out - segment.samples_at_start) / self.out_rate \
            if segment.first_audio_at is not None else 0.0
        ttfa = (segment.first_audio_at or now) - segment.completed_at
        usage = pb.Usage(frames=end.frames, audio_seconds=audio_s, time_to_first_audio_s=ttfa,
                         real_time_factor=(now - segment.completed_at) / audio_s if audio_s else 0.0,
                         seed=self.settings.seed, length_limit=length_limit(end.finish_reason, segment.limit))
        done = pb.SegmentDone(segment_index=index, text=segment.text, finish_reason=end.finish_reason,
                              usage=usage)
        return pb.StreamingSynthesizeResponse(segment_done=done, request_id=self.settings.valid.request_id)

    def _session_done(self, finished: code2wav_pb2.Finished) -> list[pb.StreamingSynthesizeResponse]:
        """The last segment's end (it ended with the session: LAST, no SegmentEnd of its own), the
        encoder's last bytes (a container's end), then the session's usage."""
        rid, encoding = self.settings.valid.request_id, self.settings.valid.encoding
        responses = []
        if self.c2w_index < len(self.spoken):
            responses.append(self._segment_done(code2wav_pb2.SegmentEnd(
                segment_index=self.c2w_index, finish_reason=finished.finish_reason,
                frames=finished.frames - self.frames_done, sample_offset=self.encoder.samples_out)))
        offset = self.encoder.samples_out
        tail = self.encoder.finish()
        if tail:
            responses.append(pb.StreamingSynthesizeResponse(request_id=rid, audio=pb.StreamingAudio(
                audio=tail, chunk_index=self.chunks, sample_offset=offset, sample_rate_hz=self.out_rate,
                encoding=encoding, segment_index=max(self.c2w_index - 1, 0))))
        audio_s = self.encoder.samples_out / self.out_rate
        wall = time.monotonic() - self.arrival
        first = next((s.first_audio_at for s in self.spoken if s.first_audio_at is not None), None)
        reason = finished.finish_reason if finished.finish_reason in _ENDED else common_pb2.FINISH_REASON_STOP
        if self.capped:
            reason = common_pb2.FINISH_REASON_LENGTH
        usage = pb.Usage(frames=finished.frames, audio_seconds=audio_s,
                         time_to_first_audio_s=(first or time.monotonic()) - self.arrival,
                         real_time_factor=wall / audio_s if audio_s else 0.0, seed=self.settings.seed,
                         length_limit=length_limit(reason, self._session_limit()))
        self.pipeline.completed += 1
        self.pipeline.frames += finished.frames
        self.pipeline.audio_seconds += audio_s
        self.pipeline.sessions += 1
        self.pipeline.session_segments += self.c2w_index
        done = pb.SessionDone(finish_reason=reason, usage=usage, segments=self.c2w_index)
        responses.append(pb.StreamingSynthesizeResponse(done=done, request_id=rid))
        return responses

    def _session_limit(self) -> LengthLimit:
        """The term that ended a session that ended LENGTH: its own cap, or its last segment's."""
        if self.capped or not self.spoken:
            return self.session_cap.limit
        return self.spoken[-1].limit

    # --- the pair ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _opened(self):
        """A pair and Code2Wav's Open stream for the session; on the way out (the end, an error,
        the client gone) both stages are freed: the Open call cancelled, the session cancelled on
        the talker (idempotent: a finished session is not found)."""
        pipeline, valid = self.pipeline, self.settings.valid
        async with pipeline.admitted(valid.served_by) as pair:
            self.pair = pair
            self.facts = facts = await pair.model_facts()
            self.session_cap = self.settings.cap(self.config.limits, facts.frame_rate)
            self.out_rate = valid.sample_rate_hz or facts.sample_rate
            self.encoder = make_encoder(valid.encoding, facts.sample_rate, self.out_rate, valid.speed)
            call = pair.code2wav.Open(code2wav_pb2.OpenRequest(
                request_id=valid.request_id, talker_id=pair.talker_id, max_frames=self.session_cap.frames,
                speaker_id=valid.voice.speaker_id, seed=self.settings.seed, session=True))
            self.call = call
            try:
                opened = await call.read()
            except grpc.aio.AioRpcError as exc:
                raise stage_error(exc, "code2wav", pair) from None
            self.handle = opened.opened.handle
            try:
                yield
            finally:
                if not call.done():
                    call.cancel()
                if self.submitted:
                    await pipeline.cancel_on_talker(pair, self.handle)
