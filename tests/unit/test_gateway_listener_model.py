"""The gateway's model of each listener (services/common/listener.py, kept per request in
``SynthesisPipeline.stream``): a chunk that reaches the gateway after the audio received before it
has played out counts in ``listener_underruns``, so the bench can tell stalls made before the
gateway from those after it. Playback starts with the first chunk received. Beside it, the first
chunk's relay: the gateway's time to it less Code2Wav's own (its Finished.first_chunk_s)."""

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


def finished(first_chunk_s: float) -> code2wav_pb2.OpenResponse:
    return code2wav_pb2.OpenResponse(finished=code2wav_pb2.Finished(first_chunk_s=first_chunk_s))


def test_the_first_chunks_relay_is_the_gateways_first_audio_less_code2wavs_own_time_to_it():
    async def main():
        pipeline = SynthesisPipeline(config=None, router=Router([]), voices=None)
        arrival = time.monotonic() - 0.01  # the request started here 10 ms ago
        started = SimpleNamespace(facts=SimpleNamespace(sample_rate=RATE), arrival=arrival)
        c2w_first_chunk_s = []  # what Code2Wav reports: its Open to its first chunk sent

        @contextlib.asynccontextmanager
        async def running(request):
            yield started

        async def chunks(_started):
            yield chunk(0.5)
            yield chunk(0.5)
            yield finished(c2w_first_chunk_s.pop())  # Code2Wav's Open to its first chunk sent

        pipeline._running, pipeline._chunks = running, chunks
        pipeline._final = lambda *args: pb.SynthesizeSpeechResponse()
        request = SimpleNamespace(encoding=pb.LINEAR_PCM, sample_rate_hz=0, speed=1.0, request_id="r")
        c2w_first_chunk_s.append(1e-6)
        [_ async for _ in pipeline.stream(request)]
        relay = pipeline.first_chunk_relay
        assert relay.n == 1 and 0.01 - 1e-6 <= relay.total < time.monotonic() - arrival  # its wait less 1 us
        total = relay.total
        c2w_first_chunk_s.append(60.0)
        [_ async for _ in pipeline.stream(request)]
        assert relay.n == 2 and relay.total == total  # clamped to 0
        c2w_first_chunk_s.append(0.0)  # an older Code2Wav without the time: not observed
        [_ async for _ in pipeline.stream(request)]
        assert relay.n == 2
        buckets, _ = pipeline.metrics()["first_chunk_relay_seconds"][2]
        assert buckets[-1] == ("+Inf", 2)
        await pipeline.router.close()

    asyncio.run(main())
