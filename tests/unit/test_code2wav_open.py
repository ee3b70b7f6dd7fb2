"""Code2Wav's Open answers with its handle at once (services/code2wav/servicer.py): the engine
thread sets the stream up at its next command, however long its step, and the records its talker
writes meanwhile wait for it (tests/unit/test_code2wav_engine.py); past the engine's slots an Open
is refused at once, RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from services.code2wav.engine import Code2WavEngine
from services.code2wav.pacing import Pacing
from services.code2wav.servicer import Code2WavServicer
from services.common.engine_thread import EngineThread
from services.common.errors import ResourceExhausted
from tests.unit.test_code2wav_engine import Clock, Decoder, ScriptedConsumer
from voxring.v1 import code2wav_pb2


class CheckedDecoder(Decoder):
    def check_open(self, speaker_id: int, seed: int) -> None:
        pass


class WaitingConsumer(ScriptedConsumer):
    """No records; a get waits its timeout unless woken (as a ring's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.woken = threading.Event()

    def get(self, timeout: float | None = 0.0):
        if timeout:
            self.woken.wait(timeout)
            self.woken.clear()
        return None

    def wake(self) -> None:
        self.woken.set()


class LiveLink:
    talker_id = "t0"
    connected = True

    def __init__(self) -> None:
        self.consumer = WaitingConsumer()

    def alive(self) -> bool:
        return True

    def ensure(self, now: float) -> None:
        pass


def _started() -> tuple[Code2WavEngine, EngineThread, Code2WavServicer]:
    """An engine of one slot on its running thread, and the servicer in front of it."""
    engine = Code2WavEngine(CheckedDecoder(), {"t0": LiveLink()}, max_slots=1,
                            max_undelivered_seconds=100.0, max_records_per_step=64, clock=Clock())
    thread = EngineThread("c2w-test", engine, tick_interval=0.02)
    thread.wake = engine.wake
    servicer = Code2WavServicer(thread, {"t0": "unix:/nonexistent"}, "c2w", Pacing(), CheckedDecoder())
    thread.start()
    return engine, thread, servicer


def test_open_answers_at_once_while_the_engine_thread_is_busy_and_refuses_past_its_slots():
    async def main():
        engine, thread, servicer = _started()
        busy, release = threading.Event(), threading.Event()
        thread.post(lambda e: (busy.set(), release.wait(30)))  # a long step: no command is taken
        try:
            assert await asyncio.to_thread(busy.wait, 10)
            request = code2wav_pb2.OpenRequest(request_id="r1", talker_id="t0", max_frames=10)
            stream = servicer.Open(request, None)
            first = await asyncio.wait_for(stream.__anext__(), 10)  # not after the engine's step
            handle = first.opened.handle
            assert handle and handle in engine.announced and handle not in engine.streams
            with pytest.raises(ResourceExhausted, match="all 1 decoder slots"):
                await servicer.Open(code2wav_pb2.OpenRequest(request_id="r2", talker_id="t0",
                                                             max_frames=10), None).__anext__()
            release.set()
            opened = await asyncio.wait_for(thread.call(lambda e: handle in e.streams), 10)
            assert opened and handle not in engine.announced
            await stream.aclose()  # the client left: its slot is freed on the engine thread
            slots = await asyncio.wait_for(thread.call(lambda e: (len(e.streams), len(e.free_slots))), 10)
            assert slots == (0, 1)
        finally:
            release.set()
            thread.stop(timeout=5)

    asyncio.run(main())


def test_a_first_chunks_wait_on_the_event_loop_and_its_write_are_counted_once_a_request():
    async def main():
        engine, thread, servicer = _started()
        try:
            stream = servicer.Open(code2wav_pb2.OpenRequest(request_id="r1", talker_id="t0", max_frames=10),
                                   None)
            handle = (await asyncio.wait_for(stream.__anext__(), 10)).opened.handle
            assert await asyncio.wait_for(thread.call(lambda e: handle in e.streams), 10)

            def send(e: Code2WavEngine) -> None:
                e.streams[handle].send_chunk(np.zeros(1920, np.int16), 1, 0.08, e.clock(), 0.0)

            loop, write = engine.counters.first_chunk_loop, engine.counters.first_chunk_write
            for index in range(3):
                await asyncio.wait_for(thread.call(send), 10)
                got = await asyncio.wait_for(stream.__anext__(), 10)
                assert got.chunk.chunk_index == index
                # the write is counted once gRPC took the first chunk: when the handler goes on
                assert (loop.n, write.n) == (1, 0 if index == 0 else 1)
            metrics = engine.counters.snapshot(1, 0)
            assert metrics["first_chunk_loop_seconds"][2][0][-1] == ("+Inf", 1)
            assert metrics["first_chunk_write_seconds"][2][0][-1] == ("+Inf", 1)
            await stream.aclose()
        finally:
            thread.stop(timeout=5)

    asyncio.run(main())
