"""The gateway's model of each listener (services/common/listener.py, kept per request in
``SynthesisPipeline.stream``): a chunk that reaches the gateway after the audio received before it
has played out counts in ``listener_underruns``, so the bench can tell stalls made before the
gateway from those after it. Playback starts with the first chunk received."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

from services.gateway.pipeline import SynthesisPipeline
from services.gateway.routing import Router
from voxring.v1 import code2wav_pb2
from voxring.v1 import synthesizer_pb2 as pb

RATE = 24_000


def chunk(seconds: float) -> code2wav_pb2.OpenResponse:
    samples = round(seconds * RATE)
    return code2wav_pb2.OpenResponse(chunk=code2wav_pb2.AudioChunk(pcm=bytes(2 * samples), num_frames=1))


def test_a_chunk_after_the_received_audio_played_out_is_a_stall_at_the_gateway():
    async def main():
        pipeline = SynthesisPipeline(config=None, router=Router([]), voices=None)
        started = SimpleNamespace(facts=SimpleNamespace(sample_rate=RATE), arrival=time.monotonic())
        played_out = asyncio.Event()

        @contextlib.asynccontextmanager
        async def running(request):
            yield started

        async def chunks(_started):
            yield chunk(0.01)       # playback starts: 10 ms of audio
            await played_out.wait()
            yield chunk(5.0)        # after the 10 ms played out: a stall
            yield chunk(0.5)        # at once, 5 s still buffered: none
            yield chunk(0.5)

        pipeline._running, pipeline._chunks = running, chunks
        request = SimpleNamespace(encoding=pb.LINEAR_PCM, sample_rate_hz=0, speed=1.0, request_id="r")
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, played_out.set)  # the only wait: 50 ms against 10 ms of audio
        got = [message async for message in pipeline.stream(request)]
        assert len(got) == 4 and pipeline.listener_underruns == 1
        assert pipeline.metrics()["listener_underruns"][2] == 1
        await pipeline.router.close()

    asyncio.run(main())
