"""The talker's admission verdicts and the gateway's watch of them (docs/protocol.md, Admission): the
talker's engine publishes each verdict that differs from the last, with the message and hint a
Submit would be refused with, and while it steps the room a verdict has before Submits are
refused; a watch stream gets the current verdict at once, then the newest (a reader that fell
behind skips to it); the gateway refuses a request at once while the pair's talker's verdict is a
fresh refusal or it has sent that verdict's room, asks the talker as before when it is stale,
admitting or unknown, and reopens a watch that ended."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from services.common.errors import ResourceExhausted
from services.gateway import verdicts as gateway_verdicts
from services.gateway.pipeline import SynthesisPipeline
from services.gateway.routing import EnginePair, ModelFacts, Router
from services.gateway.verdicts import STALE_S, AdmissionWatch
from services.talker.core import TalkerCore
from services.talker.scheduler import Overloaded, Scheduler
from services.talker.verdicts import VerdictFeed
from voxring.v1 import talker_pb2, talker_pb2_grpc

# --------------------------------------------------------------------------- the talker's side


def test_a_watch_gets_the_current_verdict_at_once_then_the_newest():
    async def main():
        feed = VerdictFeed()
        feed.publish("talker at capacity: 3 streams", 0.05)
        watch = feed.watch()
        assert (await anext(watch)).refusal == "talker at capacity: 3 streams"
        for n in range(5):  # the reader fell behind: it gets the newest only
            feed.publish(f"talker at capacity: {n} streams", 0.05)
        await asyncio.sleep(0)  # the hand-offs run
        assert (await anext(watch)).refusal == "talker at capacity: 4 streams"
        thread = threading.Thread(target=feed.publish, args=("", 0.0))  # the engine thread's
        thread.start()
        thread.join()
        assert (await asyncio.wait_for(anext(watch), 5)).refusal == ""
        await watch.aclose()
        assert feed._queues == set()

    asyncio.run(main())


def test_the_core_publishes_each_verdict_that_differs_with_a_submits_message():
    s = Scheduler(num_slots=4, max_num_seqs=4, k_max=8, prefill_token_budget=512, max_waiting=8,
                  stall_timeout=5.0, frame_rate=12.5, path_s=0.02)
    verdicts = []
    feed = SimpleNamespace(publish=lambda refusal, retry, room=0, past_room=None: verdicts.append(
        (refusal, retry, room, past_room and (past_room.message, past_room.retry_after))))
    engine = SimpleNamespace(scheduler=s, step=lambda: False, clock=lambda: 0.0, busy=False)
    core = TalkerCore(engine, consumers=SimpleNamespace(tick_s=lambda: 0.0, first_audio_s=lambda: 0.0),
                      verdicts=feed)
    refusal = None
    s.refusal = lambda now, prompt_len: refusal
    s.admissible = lambda now, prompt_len: 3
    core.step()
    core.step()
    assert verdicts == []  # admitting with no bound (the engine idle), as the feed starts: nothing new
    refusal = Overloaded("9 streams already use the talker's real-time capacity", 0.08)
    core.step()
    core.step()  # the same verdict again: not published again
    refusal, engine.busy, s.period_s = None, True, 0.07
    core.step()  # admitting while the engine steps: 3 more on this verdict, then refused at once
    core.step()  # the same room renewed: published again (the gateway's count starts over)
    assert len(verdicts) == 3 and verdicts[1] == verdicts[2]
    del verdicts[2]
    assert verdicts == [
        ("talker at capacity: 9 streams already use the talker's real-time capacity", 0.08, 0, None),
        ("", 0.0, 3, ("talker at capacity: the 3 request(s) the talker's last step had room for are taken; "
                      "the next step renews it", 0.07))]


# --------------------------------------------------------------------------- the gateway's side


class _Bytes:
    @staticmethod
    def encode(text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"ids": list(text.encode())})


def pair(name: str, verdict: talker_pb2.AdmissionVerdict | None, at: float) -> EnginePair:
    p = EnginePair(name, f"unix:/nonexistent/{name}-t.sock", f"unix:/nonexistent/{name}-c.sock", "t-0", "c-0")
    p.facts = ModelFacts("tiny", _Bytes(), "{text}", 512, 8, 12.5, 24000)
    p.admission = AdmissionWatch(talker=None, name=name)
    p.admission.verdict, p.admission.verdict_at = verdict, at
    return p


def refusal(text: str = "talker at capacity: 9 streams", retry: float = 0.08) -> talker_pb2.AdmissionVerdict:
    return talker_pb2.AdmissionVerdict(refusal=text, retry_after_s=retry)


def test_a_fresh_refusal_refuses_and_a_stale_admitting_or_unknown_verdict_does_not():
    watch = AdmissionWatch(talker=None, name="a")
    assert watch.refusing(10.0) is None  # unknown
    watch.verdict, watch.verdict_at = refusal(), 10.0
    assert watch.refusing(10.0 + STALE_S / 2) == ("talker at capacity: 9 streams", pytest.approx(0.08))
    assert watch.refusing(10.0 + STALE_S * 1.5) is None  # the talker published nothing since
    watch.verdict = talker_pb2.AdmissionVerdict()
    watch.submitted()
    assert watch.refusing(10.0) is None  # admitting with no bound


def test_past_a_verdicts_room_this_gateway_refuses_until_the_next_verdict():
    watch = AdmissionWatch(talker=None, name="a")
    watch.verdict, watch.verdict_at = talker_pb2.AdmissionVerdict(
        room=2, room_refusal="talker at capacity: the 2 request(s) ...", room_retry_after_s=0.07), 10.0
    watch.submitted()
    assert watch.refusing(10.0) is None
    watch.submitted()
    assert watch.refusing(10.0) == ("talker at capacity: the 2 request(s) ...", pytest.approx(0.07))


def test_a_refusing_verdict_refuses_without_asking_the_stages():
    async def main():
        import time

        p = pair("a", refusal(), time.monotonic())  # its stages do not exist: a call would fail
        pipeline = SynthesisPipeline(config=None, router=Router([p]), voices=None)
        with pytest.raises(ResourceExhausted) as caught:
            await pipeline._start(p, request=None)
        assert caught.value.message == ("the talker is at capacity (engine pair a): talker at capacity: "
                                        "9 streams")
        assert caught.value.retry_after == pytest.approx(0.08)
        assert pipeline.refusals_held == 1 and p._channels == {}  # no channel opened
        await pipeline.router.close()

    asyncio.run(main())


def test_a_pair_whose_talker_refuses_is_picked_after_one_that_does_not():
    async def main():
        import time

        refusing, busy = pair("refusing", refusal(), time.monotonic()), pair("busy", None, 0.0)
        busy.in_flight = 5
        router = Router([refusing, busy])
        assert await router.pick() is busy
        refusing.admission.verdict = talker_pb2.AdmissionVerdict()
        assert await router.pick() is refusing  # least loaded once it admits
        await router.close()

    asyncio.run(main())


class _Talker(talker_pb2_grpc.TalkerServicer):
    """A talker whose WatchAdmission streams what the test puts in ``verdicts``."""

    def __init__(self) -> None:
        self.verdicts: asyncio.Queue = asyncio.Queue()
        self.watches = 0

    async def WatchAdmission(self, request, context):
        self.watches += 1
        while (verdict := await self.verdicts.get()) is not None:
            yield verdict


async def _serve(servicer, address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    talker_pb2_grpc.add_TalkerServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


async def _until(predicate, what: str) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(poll(), 10)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def test_the_gateways_watch_follows_the_talker_and_reopens_after_it_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_verdicts, "RETRY_S", 0.05)

    async def main():
        address = f"unix:{tmp_path}/talker.sock"
        talker = _Talker()
        server = await _serve(talker, address)
        channel = grpc.aio.insecure_channel(address)
        watch = AdmissionWatch(talker_pb2_grpc.TalkerStub(channel), "a")
        watch.start()
        talker.verdicts.put_nowait(refusal())
        await _until(lambda: watch.verdict is not None and watch.verdict.refusal, "the refusal")
        talker.verdicts.put_nowait(talker_pb2.AdmissionVerdict())
        await _until(lambda: watch.verdict is not None and not watch.verdict.refusal, "admitting")
        talker.verdicts.put_nowait(None)  # the talker ends the stream (it stopped)
        await _until(lambda: talker.watches == 2, "the watch reopened")
        talker.verdicts.put_nowait(refusal("talker at capacity: again"))
        await _until(lambda: watch.verdict is not None and watch.verdict.refusal.endswith("again"), "it")
        await watch.close()
        await channel.close()
        await server.stop(None)

    asyncio.run(main())
