"""A request whose text holds several sentences (Synthesize, SynthesizeOnline, POST
/v1/audio/speech), spoken as a session: each sentence a segment with the ones before it as
context (services/gateway/streaming.py), so a long input is one continuous utterance whose first
audio waits for its first sentence only, and no prompt is longer than a sentence and its context.
A text of one segment takes the plain request path (services/gateway/pipeline.py).

The answer keeps the request's shape: audio chunks numbered across the whole text, then the
final message with the finish reason and the usage of all segments.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.gateway.config import GatewayConfig
from services.gateway.segmenter import Segmenter, SegmenterConfig
from services.gateway.streaming import StreamingSession
from services.gateway.streaming_config import SessionSettings
from services.gateway.validation import ValidRequest
from voxring.v1 import synthesizer_pb2 as pb


def segment_count(text: str, config: GatewayConfig) -> int:
    """How many segments the session path would speak ``text`` as."""
    s = config.streaming
    segmenter = Segmenter(SegmenterConfig(s.min_segment_chars, s.max_segment_chars, s.max_wait_s))
    return len(segmenter.push(text, 0.0)) + len(segmenter.flush())


def settings_for(request: ValidRequest, config: GatewayConfig, seed: int) -> SessionSettings:
    """A request's session: the whole capped by what it asked (or the default) and the server's
    maximum, each sentence by its own text's guard, so the text's guard is the sum of its
    sentences' guards."""
    message = request.message
    asked = message.max_audio_seconds if message.HasField("max_audio_seconds") else None
    return SessionSettings(request, seed, asked, config.streaming.min_segment_chars,
                           config.streaming.max_wait_s)


async def stream_segmented(pipeline, request: ValidRequest,
                           seed: int) -> AsyncIterator[pb.SynthesizeSpeechResponse]:
    """The request spoken as a session, answered as SynthesizeOnline answers."""

    async def text():
        yield pb.StreamingSynthesizeRequest(text=request.text)

    session = StreamingSession(pipeline, settings_for(request, pipeline.config, seed))
    async for response in session.run(text()):
        kind = response.WhichOneof("kind")
        if kind == "audio":
            a = response.audio
            yield pb.SynthesizeSpeechResponse(audio=a.audio, chunk_index=a.chunk_index,
                                              sample_offset=a.sample_offset, sample_rate_hz=a.sample_rate_hz,
                                              encoding=a.encoding, request_id=request.request_id)
        elif kind == "done":
            done = response.done
            rate = request.sample_rate_hz or session.out_rate
            yield pb.SynthesizeSpeechResponse(sample_rate_hz=rate, encoding=request.encoding,
                                              request_id=request.request_id, finish_reason=done.finish_reason,
                                              usage=done.usage)
