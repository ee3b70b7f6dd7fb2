"""The engine thread: commands run off the event loop, results come back on it,
heartbeat ticks continue while idle, stop is bounded, failures are not silent."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common.engine_thread import EngineStopped, EngineThread


class Doubler:
    """Doubles each command's number on the engine thread and answers on the loop."""

    def __init__(self, loop):
        self.loop = loop
        self.pending = []
        self.threads = set()
        self.ticks = 0
        self.fail_on = None

    def handle(self, command):
        self.threads.add(threading.get_ident())
        self.pending.append(command)

    def step(self):
        if not self.pending:
            return False
        value, future = self.pending.pop(0)
        if value == self.fail_on:
            raise RuntimeError("engine broke")
        EngineThread.resolve(self.loop, future, value * 2)
        return True

    def tick(self):
        self.ticks += 1


def test_work_runs_on_the_engine_thread_and_results_return_to_the_loop():
    async def main():
        loop = asyncio.get_running_loop()
        engine = Doubler(loop)
        thread = EngineThread("test-engine", engine, tick_interval=0.02)
        thread.start()
        try:
            futures = [loop.create_future() for _ in range(50)]
            for i, future in enumerate(futures):
                thread.post((i, future))
            results = await asyncio.wait_for(asyncio.gather(*futures), 5)
            assert results == [2 * i for i in range(50)]
            assert threading.get_ident() not in engine.threads
            ticks = engine.ticks
            async with asyncio.timeout(30):  # idle: the thread still ticks (heartbeats)
                while engine.ticks < ticks + 3:
                    await asyncio.sleep(0.01)
        finally:
            thread.stop(timeout=2)
        assert not thread.alive
        with pytest.raises(EngineStopped):
            thread.post((1, loop.create_future()))

    asyncio.run(main())


def test_a_failing_engine_stops_accepting_work():
    async def main():
        loop = asyncio.get_running_loop()
        engine = Doubler(loop)
        engine.fail_on = 3
        thread = EngineThread("failing-engine", engine, tick_interval=0.02)
        thread.start()
        thread.post((3, loop.create_future()))
        deadline = time.monotonic() + 5
        while thread.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not thread.alive
        assert isinstance(thread.error, RuntimeError)
        with pytest.raises(EngineStopped) as info:
            thread.post((1, loop.create_future()))
        assert info.value.__cause__ is thread.error
        thread.stop(timeout=1)

    asyncio.run(main())


class Echo:
    def handle(self, command):
        command(self)

    def step(self):
        return False

    def tick(self):
        pass


def test_call_returns_the_result_or_raises_on_the_loop():
    async def main():
        thread = EngineThread("echo", Echo(), tick_interval=0.02)
        thread.start()
        try:
            ident = await thread.call(lambda engine: threading.get_ident())
            assert ident != threading.get_ident()
            with pytest.raises(KeyError, match="missing"):
                await thread.call(lambda engine: {}["missing"])
        finally:
            thread.stop(timeout=2)
        with pytest.raises(EngineStopped):
            await thread.call(lambda engine: 1)

    asyncio.run(main())


class BlockedOnRing:
    """An engine that is always busy and whose step blocks on something other than the inbox (as
    Code2Wav waits on its rings), until woken or an hour passes."""

    def __init__(self) -> None:
        self.woken = threading.Event()
        self.handled = []

    def handle(self, command):
        self.handled.append(command)
        command(self)

    def step(self):
        self.woken.wait(3600)  # only a wake ends it in time
        self.woken.clear()
        return True

    def tick(self):
        pass


def test_a_post_wakes_an_engine_blocked_in_its_step():
    async def main():
        engine = BlockedOnRing()
        thread = EngineThread("blocked", engine, tick_interval=0.02)
        thread.wake = engine.woken.set
        thread.start()
        try:
            # bounded by its own timeout: without the wake the step blocks for an hour
            assert await asyncio.wait_for(thread.call(lambda e: "taken"), 10) == "taken"
            assert await asyncio.wait_for(thread.call(lambda e: len(e.handled)), 10) == 2
        finally:
            engine.woken.set()
            thread.stop(timeout=2)
            engine.woken.set()

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_engine_thread_is_named_for_the_operating_system_too():
    """top -H, py-spy and the server bench's per-thread CPU tell the engine thread by its name."""
    seen = threading.Event()
    names = []

    class Namer:
        def handle(self, command):
            pass

        def step(self):
            if not seen.is_set():
                names.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
                seen.set()
            return False

        def tick(self):
            pass

    thread = EngineThread("talker-engine", Namer(), tick_interval=0.01)
    thread.start()
    try:
        assert seen.wait(5.0)
    finally:
        thread.stop(5.0)
    assert names == ["talker-engine"]


class Stepper:
    """Notes, on the engine thread, how many answers had been sent (``sent``) when each step began;
    its step waits until the test lets it end."""

    def __init__(self, defer: bool) -> None:
        self.defer_replies = defer
        self.sent: list = []
        self.steps: list[int] = []
        self.release = threading.Event()

    def handle(self, command):
        command(self)

    def step(self):
        self.steps.append(len(self.sent))
        if not self.release.wait(30):
            raise TimeoutError("the test never released the step")
        return False

    def tick(self):
        pass


def _counting(thread: EngineThread, engine: Stepper) -> None:
    """The thread's answers counted in ``engine.sent`` as they are sent to the loop."""
    for name in ("resolve", "fail"):
        send = getattr(EngineThread, name)
        setattr(thread, name, lambda loop, future, value, send=send: (engine.sent.append(value),
                                                                      send(loop, future, value)))


@pytest.mark.parametrize("defer", [True, False])
def test_answers_wait_for_the_step_after_their_command_only_where_the_engine_asks(defer):
    async def main():
        engine = Stepper(defer)
        thread = EngineThread("stepper", engine, tick_interval=0.02)
        _counting(thread, engine)
        thread.start()
        try:
            answer = asyncio.ensure_future(thread.call(lambda e: 7))
            async with asyncio.timeout(30):
                while not engine.steps:  # the command ran; its step now waits
                    await asyncio.sleep(0.005)
                assert engine.steps == [0 if defer else 1]  # the answer was held, or already sent
                engine.release.set()
                assert await answer == 7
                with pytest.raises(KeyError):  # a failing command's error travels the same way
                    await thread.call(lambda e: {}["x"])
        finally:
            engine.release.set()
            thread.stop(timeout=2)

    asyncio.run(main())


def test_answers_held_for_a_step_that_fails_still_reach_their_callers():
    """The commands were applied before the step broke: their callers get their answers, and the
    thread stops as for any failure."""
    async def main():
        engine = Stepper(True)
        engine.release.set()
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("engine broke"))
        thread = EngineThread("stepper", engine, tick_interval=0.02)
        thread.start()
        try:
            assert await asyncio.wait_for(thread.call(lambda e: 5), 30) == 5
            async with asyncio.timeout(30):
                while thread.alive:
                    await asyncio.sleep(0.005)
            assert isinstance(thread.error, RuntimeError)
        finally:
            thread.stop(timeout=2)

    asyncio.run(main())
