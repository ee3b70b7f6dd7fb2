"""A talker's refusal for capacity held briefly at the gateway (services/gateway/routing.py,
``EnginePair.hold_refusal``; pipeline ``_start``): within its retry hint, at most
``REFUSAL_HOLD_S``, new requests to that pair are refused by the gateway with the same message and
the hint's remainder, without an Open on Code2Wav or a Submit; another pair is picked first
meanwhile; a refusal without a hint is not held. And a request that started keeps its pair's model
facts when readiness learns them anew under it (the fault soak's cancel storm found it reading None)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import ResourceExhausted
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.routing import REFUSAL_HOLD_S, EnginePair, ModelFacts, Router


class _Bytes:
    """A tokenizer as ModelFacts uses one: a token a byte."""

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"ids": list(text.encode())})


def pair(name: str) -> EnginePair:
    p = EnginePair(name, f"unix:/nonexistent/{name}-t.sock", f"unix:/nonexistent/{name}-c.sock", "t-0", "c-0")
    p.facts = ModelFacts("tiny", _Bytes(), "{text}", 512, 8, 12.5, 24000)
    return p


def test_a_refusal_is_held_for_its_hint_at_most_the_hold():
    p = pair("a")
    p.hold_refusal("talker at capacity", 0.01, now=100.0)
    assert p.refused_for(100.0) == pytest.approx(0.01) and p.refused_for(100.02) == 0.0
    p.hold_refusal("talker at capacity", 30.0, now=200.0)
    assert p.refused_for(200.0) == pytest.approx(REFUSAL_HOLD_S)
    p.hold_refusal("queue full", None, now=300.0)  # no hint: nothing to hold
    assert p.refused_for(300.0) == 0.0


def test_a_pair_refusing_is_picked_after_one_that_is_not():
    async def main():
        busy, refusing = pair("busy"), pair("refusing")
        router = Router([refusing, busy])
        busy.in_flight = 5
        assert await router.pick() is refusing  # least loaded
        refusing.hold_refusal("talker at capacity", 1.0, time.monotonic())
        assert await router.pick() is busy
        await router.close()

    asyncio.run(main())


def test_a_held_refusal_answers_without_asking_the_stages():
    async def main():
        p = pair("a")  # its stages' addresses do not exist: any call would fail UNAVAILABLE
        p.hold_refusal("the talker is at capacity (engine pair a): 3 streams", 1.0, time.monotonic())
        pipeline = SynthesisPipeline(config=None, router=Router([p]), voices=None)
        with pytest.raises(ResourceExhausted) as caught:
            await pipeline._start(p, request=None)
        assert caught.value.message == "the talker is at capacity (engine pair a): 3 streams"
        assert 0 < caught.value.retry_after <= REFUSAL_HOLD_S
        assert pipeline.refusals_held == 1 and p._channels == {}  # no channel was opened
        await pipeline.router.close()

    asyncio.run(main())


class _Opened:
    """Code2Wav's Open as the gateway reads it: its first message carries the handle."""

    def __init__(self, log: list) -> None:
        self.log = log

    async def read(self):
        from voxring.v1 import code2wav_pb2
        return code2wav_pb2.OpenResponse(opened=code2wav_pb2.Opened(handle=7))

    def cancel(self) -> None:
        self.log.append("open cancelled")


class _Code2Wav:
    def __init__(self, log: list) -> None:
        self.log = log

    def Open(self, request, timeout=None):
        self.log.append("open")
        return _Opened(self.log)


class _Talker:
    def __init__(self, log: list) -> None:
        self.log = log

    async def Submit(self, request, timeout=None):
        import grpc

        from services.common import rich_status
        self.log.append("submit")
        details = "talker at capacity: 3 streams already use the talker's real-time capacity"
        trailers = rich_status.trailers("RESOURCE_EXHAUSTED", details, retry_after=0.2)
        raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(*trailers), details=details)


def _refusing_pair(log: list):
    """A pair whose talker refuses every Submit for capacity, its pipeline and a request (the
    stages' calls go to ``log``)."""
    from services.gateway.config import GatewayConfig
    from services.gateway.validation import ValidRequest
    from services.gateway.voices import VoiceEntry
    from voxring.v1 import synthesizer_pb2 as pb

    p = pair("a")
    p._stubs.update(code2wav=_Code2Wav(log), talker=_Talker(log))
    pipeline = SynthesisPipeline(config=GatewayConfig(), router=Router([p]), voices=None)
    request = ValidRequest("r1", "Hello there.", VoiceEntry("default", 0), "en-US", 1, 0,
                           pb.SynthesizeSpeechRequest(text="Hello there."))
    return p, pipeline, request


def test_a_talkers_refusal_is_held_and_the_next_request_refused_without_a_round_trip():
    async def main():
        log = []
        p, pipeline, request = _refusing_pair(log)
        with pytest.raises(ResourceExhausted) as first:
            await pipeline._start(p, request)
        assert log == ["open", "submit", "open cancelled"] and first.value.retry_after == pytest.approx(0.2)
        assert first.value.message.startswith("the talker is at capacity (engine pair a): talker at capacity")
        with pytest.raises(ResourceExhausted) as second:
            await pipeline._start(p, request)
        assert log == ["open", "submit", "open cancelled"]  # neither stage asked again
        assert second.value.message == first.value.message and second.value.retry_after <= REFUSAL_HOLD_S
        assert pipeline.refusals_held == 1

    asyncio.run(main())


class _Stream:
    """Code2Wav's Open: the handle, one chunk of a frame, then Finished."""

    def __init__(self, pair: EnginePair) -> None:
        from voxring.v1 import code2wav_pb2, common_pb2
        self.messages = [code2wav_pb2.OpenResponse(opened=code2wav_pb2.Opened(handle=7)),
                         code2wav_pb2.OpenResponse(chunk=code2wav_pb2.AudioChunk(pcm=bytes(3840))),
                         code2wav_pb2.OpenResponse(finished=code2wav_pb2.Finished(
                             frames=1, finish_reason=common_pb2.FINISH_REASON_LENGTH))]
        self.pair = pair

    async def read(self):
        import grpc
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def cancel(self) -> None:
        pass

    def done(self) -> bool:
        return not self.messages

    async def code(self):
        import grpc
        return grpc.StatusCode.OK


def test_a_running_request_keeps_its_pairs_facts_when_readiness_learns_them_anew():
    from services.gateway.config import GatewayConfig
    from services.gateway.validation import ValidRequest
    from services.gateway.voices import VoiceEntry
    from voxring.v1 import synthesizer_pb2 as pb
    from voxring.v1 import talker_pb2

    async def main():
        p = pair("a")

        class Talker:
            async def Submit(self, request, timeout=None):
                p.facts = None  # readiness learns the pair anew (back after a fault) meanwhile
                return talker_pb2.SubmitResponse()

        p._stubs.update(code2wav=type("C2W", (), {"Open": lambda self, r, timeout=None: _Stream(p)})(),
                        talker=Talker())
        pipeline = SynthesisPipeline(config=GatewayConfig(), router=Router([p]), voices=None)
        request = ValidRequest("r1", "Hello there.", VoiceEntry("default", 0), "en-US", 1, 0,
                               pb.SynthesizeSpeechRequest(text="Hello there."))
        messages = [m async for m in pipeline.stream(request)]
        assert p.facts is None  # reset under the request, which went on with the facts it started with
        assert [m.sample_rate_hz for m in messages] == [24000, 24000]
        assert messages[-1].finish_reason != 0
        await pipeline.router.close()

    asyncio.run(main())


def test_each_refusal_is_timed_inside_the_gateway_by_who_answered_it():
    async def main():
        log = []
        p, pipeline, request = _refusing_pair(log)
        for _ in range(3):  # the talker refuses the first; the gateway holds that for the next two
            with pytest.raises(ResourceExhausted):
                [m async for m in pipeline.stream(request)]
        assert log == ["open", "submit", "open cancelled"]
        metrics = pipeline.metrics()
        for name, count in (("refusal_stages_seconds", 1), ("refusal_here_seconds", 2)):
            buckets, seconds = metrics[name][2]
            assert buckets[-1] == ("+Inf", count) and seconds >= 0  # counted where it was answered
        assert p.in_flight == 0  # every refused request released its pair
        await pipeline.router.close()

    asyncio.run(main())
