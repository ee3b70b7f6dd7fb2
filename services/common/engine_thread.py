"""The engine thread: where a stage's device work, ring I/O and blocking waits run.

The threading rule (docs/protocol.md, Threads): the grpc.aio event loop only validates, enqueues and
relays. An :class:`EngineThread` owns one thread that runs an :class:`Engine`:

- the loop ``post``s commands (a new request, a cancel) into a thread-safe inbox;
- the thread takes every waiting command at a step boundary, hands them to the engine,
  then runs one ``step()``; while the engine has nothing to do it blocks on the inbox
  for at most ``tick_interval`` seconds, so it uses no CPU when idle yet still calls
  ``tick()`` (heartbeats) at least that often;
- results travel back with :meth:`EngineThread.resolve`/:meth:`fail`/:meth:`reply`, which use
  ``loop.call_soon_threadsafe`` so that futures are only touched on their loop. An engine whose
  device waits for the host between steps (``defer_replies`` true: the talker on CUDA) gets the
  answers of :meth:`call` sent after its ``step()``: each one wakes the event loop, whose
  Python then competes for the GIL with the work before the next launch;
- one step, or a burst of commands before it, can outlast the peers' liveness timeout (a
  kernel compiled on first use, a large batch, a thousand requests opened at once): while
  the thread works, a keeper thread calls the engine's ``keepalive()`` (store this side's
  own heartbeats, nothing else) every ``tick_interval``, for at most ``keepalive_limit``
  seconds of that step. A step stuck longer stops its heartbeats, so the peers still find
  a hung engine dead (docs/protocol.md, Rings).

An engine that raises stops the thread; the error is kept and logged, and ``post``
then fails, so the stage stops accepting work instead of hanging.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)
PR_SET_NAME = 15  # prctl's option: the calling thread's name


class Engine(Protocol):
    def handle(self, command: Any) -> None:
        """Applies one command from the event loop (runs on the engine thread)."""

    def step(self) -> bool:
        """Does one unit of work; returns False when there was nothing to do."""

    def tick(self) -> None:
        """Periodic housekeeping (heartbeats); called at least every tick_interval."""

    # Optional: ``collect()`` waits for device work the last step left in flight and applies it;
    # the thread calls it before taking the commands of the next step, so a request that came
    # while the device ran is planned into the very next step.
    # Optional: ``defer_replies`` (true) has the answers of ``call`` sent after the step that
    # follows the commands, not as each command ends (see the module's docstring).
    # Optional: ``keepalive()`` stores this side's own heartbeats and nothing else. The
    # keeper thread calls it while a step runs, concurrently with that step, so it must be
    # safe against the engine thread (the transports' tick() is).


def name_os_thread(name: str) -> None:
    """Gives the calling thread ``name`` (its first 15 bytes) in the operating system too, so
    that top -H, py-spy and /proc/<pid>/task/*/comm tell a stage's threads apart. Linux only;
    elsewhere nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the name stays Python's only
        pass


class EngineStopped(RuntimeError):
    """The engine thread is not running (stopped, or failed: see __cause__)."""


_STOP = object()


class EngineThread:
    def __init__(self, name: str, engine: Engine, tick_interval: float = 0.05,
                 keepalive_limit: float = 0.0, slow_step: float = 1.0) -> None:
        """``keepalive_limit``: seconds of one step during which the keeper keeps the
        heartbeats (0, or an engine without ``keepalive``: no keeper). A step longer than
        ``slow_step`` seconds is logged."""
        if keepalive_limit < 0:
            raise ValueError(f"keepalive_limit must be >= 0, got {keepalive_limit}")
        self.name = name
        self.engine = engine
        self.tick_interval = tick_interval
        self.keepalive_limit = keepalive_limit
        self.slow_step = slow_step
        self.error: BaseException | None = None
        # called once, on the engine thread, when the engine raises (ServiceHost: the stage exits)
        self.on_failure: Callable[[str], None] | None = None
        # called after each post, on the poster's thread: an engine whose steps block on something
        # other than the inbox (Code2Wav waits on its rings while idle) ends that wait, so a command
        # is taken at once rather than when the wait times out
        self.wake: Callable[[], None] | None = None
        self.keepalives = 0          # keeper calls so far (a count for tests and logs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # call()'s answers waiting for the step after their commands (None: each sent at once)
        self._replies: list | None = [] if getattr(engine, "defer_replies", False) else None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._running = False
        self._step_started: float | None = None  # monotonic start of the step running now
        self._stopped = threading.Event()
        self._keeper = None
        if keepalive_limit > 0 and callable(getattr(engine, "keepalive", None)):
            self._keeper = threading.Thread(target=self._keep, name=f"{name}-keepalive", daemon=True)

    # --- event-loop side ------------------------------------------------------------

    def start(self) -> None:
        self._running = True
        self._thread.start()
        if self._keeper is not None:
            self._keeper.start()

    def post(self, command: Any) -> None:
        """Queues ``command`` for the engine; never blocks."""
        if not self._running:
            raise EngineStopped(f"{self.name} is not running") from self.error
        self._inbox.put(command)
        if self.wake is not None:
            self.wake()

    async def call(self, command: Callable[[Any], Any]) -> Any:
        """Runs ``command(engine)`` on the engine thread and returns its result (or raises
        its exception) on the calling event loop. EngineStopped when not running."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run(engine: Any) -> None:
            try:
                answer = (self.resolve, loop, future, command(engine))
            except Exception as exc:  # travels back to the caller (an RPC: the interceptor maps it)
                answer = (self.fail, loop, future, exc)
            if self._replies is None:
                answer[0](*answer[1:])
            else:
                self._replies.append(answer)

        self.post(run)
        return await future

    def stop(self, timeout: float) -> None:
        """Asks the thread to finish its step and exit; waits up to ``timeout`` s."""
        if not self._thread.is_alive():
            self._running = False
            self._stop_keeper()
            return
        self._running = False
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("%s did not stop within %.1f s", self.name, timeout)
        self._stop_keeper()

    def _stop_keeper(self) -> None:
        self._stopped.set()
        if self._keeper is not None and self._keeper.is_alive():
            self._keeper.join(max(1.0, 4 * self.tick_interval))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- engine-thread side -----------------------------------------------------------

    @staticmethod
    def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
        """Sets ``future``'s result on its own loop (callable from any thread)."""
        loop.call_soon_threadsafe(_set_result, future, value)

    @staticmethod
    def fail(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException) -> None:
        """Sets ``future``'s exception on its own loop (callable from any thread)."""
        loop.call_soon_threadsafe(_set_exception, future, error)

    @staticmethod
    def reply(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
        """Runs ``callback(*args)`` on ``loop`` (callable from any thread)."""
        loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        name_os_thread(self.name)
        last_tick = 0.0
        busy = False
        collect = getattr(self.engine, "collect", None)
        try:
            while True:
                timeout = 0.0 if busy else self.tick_interval
                try:
                    if busy and collect is not None:
                        self._step_started = time.monotonic()
                        collect()
                    if not self._take_commands(timeout):  # marks the thread busy once a command came
                        return
                    now = time.monotonic()
                    if self._step_started is None:
                        self._step_started = now
                    if now - last_tick >= self.tick_interval:
                        self.engine.tick()
                        last_tick = now
                    busy = self.engine.step()
                    self._send_replies()
                    took = time.monotonic() - self._step_started
                finally:
                    self._step_started = None
                if took > self.slow_step:
                    log.warning("%s: one step (with the commands before it) took %.2f s; heartbeats are kept "
                                "by the keeper for up to %.0f s", self.name, took, self.keepalive_limit)
        except BaseException as exc:  # the stage must see the failure, not a silent hang
            self.error = exc
            self._running = False
            log.exception("%s failed; it accepts no more work", self.name)
            if self.on_failure is not None:
                self.on_failure(f"{self.name} failed: {exc!r}")
        finally:
            self._send_replies()  # the commands were applied: their callers get the answers
            self._stopped.set()

    def _send_replies(self) -> None:
        if self._replies:
            replies, self._replies = self._replies, []
            for send, *args in replies:
                send(*args)

    def _keep(self) -> None:
        """The keeper: during a step (and the commands handled before it) longer than one
        tick interval, the engine's own heartbeats, until it ends or has run
        ``keepalive_limit`` seconds."""
        name_os_thread("keepalive")  # 15 bytes: "<engine>-keep..." would read as the engine
        warned_for = None
        while not self._stopped.wait(self.tick_interval):
            started = self._step_started
            if started is None:
                continue
            running = time.monotonic() - started
            if running < self.tick_interval:
                continue
            if running > self.keepalive_limit:
                if warned_for != started:
                    warned_for = started
                    log.error("%s: one step has run %.1f s, past keepalive_limit %.1f s: heartbeats stop, "
                              "so peers will find this stage dead", self.name, running, self.keepalive_limit)
                continue
            try:
                self.engine.keepalive()
                self.keepalives += 1
            except Exception:  # never fatal: the engine thread's own tick() follows the step
                log.exception("%s: keepalive failed", self.name)

    def _take_commands(self, timeout: float) -> bool:
        """Hands every queued command to the engine; False when asked to stop."""
        try:
            command = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        self._step_started = time.monotonic()  # a burst of commands is work the keeper covers
        while True:
            if command is _STOP:
                return False
            self.engine.handle(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True


class EngineComponent:
    """The ServiceHost component of a stage's engine thread: started before serving; during
    the drain ``idle`` (when given) says whether accepted work is done; after the drain the
    thread stops, then ``close`` releases what the engine owned (rings, links)."""

    def __init__(self, thread: EngineThread, close: Callable[[], None],
                 idle: Callable[[], bool] | None = None) -> None:
        self.thread, self._close, self._idle = thread, close, idle

    def start(self) -> None:
        self.thread.start()

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """``on_failure(why)`` is called from the engine thread if the engine fails."""
        self.thread.on_failure = on_failure

    def idle(self) -> bool:
        return self._idle is None or self._idle() or not self.thread.alive

    def stop(self, timeout: float) -> None:
        self.thread.stop(timeout)
        self._close()


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
