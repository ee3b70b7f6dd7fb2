"""The talker's and Code2Wav's processes on virtual time: the real engines (``TalkerCore``
over ``Scheduler`` + ``TalkerEngine``; ``Code2WavEngine``) on an engine-thread lane each,
their servicers' request handling on an event-loop lane each, and a ring between them.

The engine-thread loop repeats ``EngineThread._run``'s order (commands, tick, step; block
on the inbox for a tick interval only when idle); the servicers' handlers call the same
functions as the real ones (``build_request``, ``requested_pacing``, ``OpenStream``).
gRPC's own work per message is host time from the probe (``HostCosts``), not run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.sim.compat import PACING_KEYS, build_request, overloaded, requested_pacing, supported
from bench.sim.devices import FRAME_RATE
from bench.sim.kernel import Lane, Mailbox, Sim
from services.code2wav.engine import Code2WavEngine
from services.code2wav.streams import OpenStream
from services.common.errors import ServiceError
from services.talker.core import TalkerCore
from services.talker.engine import TalkerEngine
from services.talker.scheduler import Scheduler
from services.talker.servicer import ModelFacts
from services.transport.layout import FrameRecord, record_bytes

TICK_S = 0.05  # heartbeat_interval / 2, as both stages' __main__ set it


@dataclass(frozen=True)
class HostCosts:
    """CPU seconds of gRPC's own work per message on the GPU host (``host_probe.py``)."""

    unary_server_s: float
    unary_client_s: float
    stream_send_s: tuple[float, float]   # (fixed, per byte) on the sender
    stream_recv_s: tuple[float, float]   # (fixed, per byte) on the receiver
    call_overhead_s: float = 0.0   # fitted (bench/sim/fit.py): a served call's servicer code

    def scaled(self, factor: float, call_overhead_s: float) -> HostCosts:
        """These costs times the fitted ``grpc_factor``, with the fitted call overhead."""
        return HostCosts(self.unary_server_s * factor, self.unary_client_s * factor,
                         (self.stream_send_s[0] * factor, self.stream_send_s[1] * factor),
                         (self.stream_recv_s[0] * factor, self.stream_recv_s[1] * factor), call_overhead_s)

    def served_call(self) -> float:
        return self.unary_server_s + self.call_overhead_s

    def send(self, nbytes: int) -> float:
        return self.stream_send_s[0] + self.stream_send_s[1] * nbytes

    def recv(self, nbytes: int) -> float:
        return self.stream_recv_s[0] + self.stream_recv_s[1] * nbytes


def engine_loop(lane: Lane, engine, inbox: Mailbox, tick_s: float = TICK_S) -> None:
    """``EngineThread._run`` on a lane: the device work in flight collected, commands, a tick
    when due, one step."""
    last_tick, busy = -math.inf, False
    collect = getattr(engine, "collect", None)
    while True:
        if busy and collect is not None:
            collect()
        commands = lane.take(inbox)
        if not commands and not busy:
            lane.wait([inbox], tick_s)
            commands = lane.take(inbox)
        for command in commands:
            engine.handle(command)
        if lane.now() - last_tick >= tick_s:
            engine.tick()
            last_tick = lane.now()
        busy = engine.step()


class SimRing:
    """The talker → Code2Wav ring: the talker's ``RecordSink`` and Code2Wav's consumer, with
    the ring's byte capacity (a full ring makes ``try_put`` return False, as the real one)."""

    def __init__(self, sim: Sim, capacity_bytes: int) -> None:
        self.sim, self.capacity = sim, capacity_bytes
        self.box = Mailbox(sim, "ring")
        self.used = 0
        self._taken = 0
        self.records = self.frames_in = 0

    def try_put(self, codes, *, handle: int, seq: int, first_frame: int = 0, flags: int = 0,
                finish_reason: int = 0) -> bool:
        frames = 0 if codes is None else len(codes)
        size = record_bytes(0 if codes is None else codes.nbytes)
        if self.used + size > self.capacity:
            return False
        self.used += size
        record = FrameRecord(handle, seq, first_frame, frames, 0 if codes is None else codes.shape[1],
                             flags, finish_reason)
        empty = np.zeros((0, 32), np.int16)
        self.box.put((record, empty if codes is None else codes, size), self.sim.current.now())
        self.records += 1
        self.frames_in += frames
        self.sim.current.maybe_switch()
        return True

    def get_batch(self, max_records: int, timeout: float = 0.0) -> list:
        items = self.sim.current.take(self.box, max_records)
        self._taken += sum(size for _, _, size in items)
        return [(record, codes) for record, codes, _ in items]

    def get(self, timeout: float):
        lane = self.sim.current
        lane.wait([self.box], timeout)
        items = self.get_batch(1)
        return items[0] if items else None

    def release(self) -> None:
        self.used -= self._taken
        self._taken = 0

    def tick(self) -> None:
        pass


@dataclass
class SimConsumers:
    """The talker's attached consumers: one, on the ring (``Consumers``' interface)."""

    consumer_id: str
    ring: SimRing

    def sink_for(self, consumer_id: str):
        return self.ring if consumer_id == self.consumer_id else None

    def tick(self) -> list[str]:
        return []

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class SimLink:
    """Code2Wav's ``TalkerLink`` to the one talker, always attached."""

    talker_id: str
    consumer: SimRing
    connected: bool = True

    def alive(self) -> bool:
        return True

    def ensure(self, now: float) -> None:
        pass

    def keepalive(self) -> None:
        pass

    def drop(self) -> None:
        raise RuntimeError("the simulated talker is never lost")

    def close(self) -> None:
        pass


@dataclass
class Peer:
    """Where a process's event loop sends: another lane's mailbox."""

    box: Mailbox


class TalkerProcess:
    def __init__(self, sim: Sim, gil, runner, engine_cfg, host: HostCosts, ring: SimRing, consumer_id: str,
                 facts: ModelFacts, default_schedule=None) -> None:
        self.sim, self.host, self.facts, self.default_schedule = sim, host, facts, default_schedule
        self.budget_args = (getattr(engine_cfg, "first_audio_budget_s", 0.0),) if hasattr(
            engine_cfg, "first_audio_budget_s") else ()
        pacing = {key: getattr(engine_cfg, key) for key in PACING_KEYS if hasattr(engine_cfg, key)}
        scheduler = supported(Scheduler, num_slots=engine_cfg.max_num_seqs,
                              max_num_seqs=engine_cfg.max_num_seqs,
                              k_max=engine_cfg.k_max, prefill_token_budget=engine_cfg.prefill_token_budget,
                              max_waiting=engine_cfg.max_waiting, stall_timeout=engine_cfg.stall_timeout,
                              frame_rate=FRAME_RATE, bucket_for=runner.bucket_for, **pacing)
        clock = sim.clock
        self.engine = TalkerEngine(runner, scheduler, SimConsumers(consumer_id, ring).sink_for,
                                   max_pending_frames=engine_cfg.max_pending_frames, clock=clock)
        self.core = TalkerCore(self.engine, SimConsumers(consumer_id, ring))
        self.inbox = Mailbox(sim, "talker-engine")
        self.loop_box = Mailbox(sim, "talker-loop")
        self.engine_lane = sim.lane("talker-engine", gil,
                                    lambda lane: engine_loop(lane, self.core, self.inbox))
        self.loop_lane = sim.lane("talker-loop", gil, self._loop)

    def _loop(self, lane: Lane) -> None:
        while True:
            lane.wait([self.loop_box], None)
            for kind, *rest in lane.take(self.loop_box):
                if kind == "submit":
                    self._submit(lane, *rest)
                else:  # the engine's answer: the response goes back
                    reply_to, token, result = rest
                    reply_to.box.put(("submitted", token, result), lane.now())
                lane.maybe_switch()

    def _submit(self, lane: Lane, submit, token, reply_to: Peer) -> None:
        lane.spend(self.host.served_call())
        try:
            request = build_request(submit, self.facts, self.default_schedule, lane.now(), *self.budget_args)
        except ServiceError as exc:
            reply_to.box.put(("submitted", token, exc), lane.now())
            return
        admission = getattr(self.core, "admission", None)  # absent before the serving loop's issue
        refusing = admission.take() if admission is not None else None  # the servicer's early refusal
        if refusing is not None:
            self.core.refused_early += 1
            reply_to.box.put(("submitted", token, overloaded(refusing)), lane.now())
            return

        def command(core: TalkerCore) -> None:
            try:
                result = core.submit(request, checked=True) if admission is not None else core.submit(request)
            except ServiceError as exc:
                result = exc
            self.loop_box.put(("answer", reply_to, token, result), self.sim.current.now())

        self.inbox.put(command, lane.now())


class _StreamQueue:
    """An Open stream's message queue: its messages are handled on the loop as they come."""

    def __init__(self, process: Code2WavProcess, token, handle: int, reply_to: Peer) -> None:
        self.process, self.token, self.handle, self.reply_to = process, token, handle, reply_to

    def put_nowait(self, message) -> None:
        self.process._stream_message(self, message)


class _LoopHandle:
    """``loop.call_soon_threadsafe`` for the engine's streams: a stamped message to the loop lane."""

    def __init__(self, sim: Sim, box: Mailbox) -> None:
        self.sim, self.box = sim, box

    def call_soon_threadsafe(self, callback: Callable, *args) -> None:
        self.box.put(("call", callback, args), self.sim.current.now())
        self.sim.current.maybe_switch()


@dataclass
class Code2WavCounters:
    opened: int = 0
    chunks_sent: int = 0
    frames_out: int = 0
    open_errors: dict = field(default_factory=dict)


class Code2WavProcess:
    def __init__(self, sim: Sim, gil, decoder, engine_cfg, host: HostCosts, ring: SimRing, talker_id: str,
                 default_pacing) -> None:
        self.sim, self.host, self.talker_id, self.default_pacing = sim, host, talker_id, default_pacing
        clock = sim.clock
        self.clock = clock
        self.engine = Code2WavEngine(decoder, {talker_id: SimLink(talker_id, ring)},
                                     max_slots=engine_cfg.max_slots,
                                     max_undelivered_seconds=engine_cfg.max_undelivered_seconds,
                                     max_records_per_step=engine_cfg.max_records_per_step, clock=clock)
        self.inbox = Mailbox(sim, "code2wav-engine")
        self.loop_box = Mailbox(sim, "code2wav-loop")
        self.loop_handle = _LoopHandle(sim, self.loop_box)
        self.frame_seconds = 1.0 / decoder.codec.config.frame_rate
        self.counters = Code2WavCounters()
        self._handles = 0
        self.engine_lane = sim.lane("code2wav-engine", gil,
                                    lambda lane: engine_loop(lane, self.engine, self.inbox))
        self.loop_lane = sim.lane("code2wav-loop", gil, self._loop)

    def _loop(self, lane: Lane) -> None:
        while True:
            lane.wait([self.loop_box], None)
            for kind, *rest in lane.take(self.loop_box):
                if kind == "open":
                    self._open(lane, *rest)
                elif kind == "call":
                    callback, args = rest
                    callback(*args)
                elif kind == "opened":
                    reply_to, token, result = rest
                    lane.spend(self.host.send(16))
                    reply_to.box.put(("opened", token, result), lane.now())
                lane.maybe_switch()

    def _open(self, lane: Lane, request, token, reply_to: Peer) -> None:
        lane.spend(self.host.served_call())
        pacing = requested_pacing(request, self.default_pacing)
        self._handles += 1
        handle = self._handles
        queue = _StreamQueue(self, token, handle, reply_to)

        def make(slot: int) -> OpenStream:
            return supported(OpenStream, handle=handle, request_id=request.request_id,
                             talker_id=request.talker_id, slot=slot, pacing=pacing, schedule=pacing,
                             max_frames=request.max_frames, loop=self.loop_handle, queue=queue,
                             clock=self.clock, frame_s=self.frame_seconds)

        def command(engine: Code2WavEngine) -> None:
            try:
                engine.open(make)
                result = handle
            except ServiceError as exc:
                result = exc
            self.loop_box.put(("opened", reply_to, token, result), self.sim.current.now())

        self.inbox.put(command, lane.now())

    def _stream_message(self, queue: _StreamQueue, message) -> None:
        lane, (kind, *payload) = self.sim.current, message
        if kind == "chunk":
            chunk = payload[0]
            lane.spend(self.host.send(len(chunk.pcm)))
            queue.reply_to.box.put(("chunk", queue.token, chunk), lane.now())
            self.counters.chunks_sent += 1
            self.counters.frames_out += chunk.num_frames
            seconds = chunk.num_frames * self.frame_seconds
            self.inbox.put(lambda engine, h=queue.handle, s=seconds: engine.delivered(h, s), lane.now())
            return
        lane.spend(self.host.send(64))
        queue.reply_to.box.put((kind, queue.token, *payload), lane.now())
        self.inbox.put(lambda engine, h=queue.handle: engine.close(h), lane.now())
