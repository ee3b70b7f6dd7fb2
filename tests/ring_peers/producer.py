"""A talker-like producer process for the ring tests (started with subprocess).

Creates one edge (shm ring or gRPC stream), optionally sweeps stale rings first, writes
its endpoint to --ready, waits for the consumer to attach, then runs --mode on its one
(engine) thread, storing its heartbeat at least every --heartbeat seconds throughout:

  stream  put --count planned records (blocking), the last with LAST/STOP, write their
          digest to --result; close; exit 0
  idle    publish nothing, tick until killed
  fill    try_put 1 KiB records until the ring is full (event "full"), then put --count
          more, blocking (events "blocked" before and "resumed" after); close
  watch   tick and offer a small record every 10 ms while the consumer lives; event
          "consumer_dead" when its heartbeat goes stale, then exit 0
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import time

import numpy as np

from services.transport import open_producer
from services.transport.grpc_producer import FrameStreamServer, FrameStreamServicer
from services.transport.layout import FinishReason, RecordFlags, RingFull
from services.transport.shm_sweep import sweep_stale
from tests.ring_peers.records import (
    Digest,
    Events,
    add_transport_args,
    endpoint_to_json,
    plan,
    section,
    write_json,
)

HANDLE = 0xC0DE_0000_0007
ATTACH_TIMEOUT_S = 30.0


class Ticker:
    """Stores the heartbeat when due, as the talker's engine thread does."""

    def __init__(self, producer, interval: float) -> None:
        self.producer, self.interval_ns, self.last = producer, int(interval * 1e9), 0

    def __call__(self) -> None:
        now = time.monotonic_ns()
        if now - self.last >= self.interval_ns:
            self.producer.tick()
            self.last = now


def wait_attached(producer, tick: Ticker) -> None:
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while not producer.consumer_attached:
        if time.monotonic() > deadline:
            raise SystemExit("consumer did not attach")
        tick()
        time.sleep(0.005)


def run_stream(producer, tick: Ticker, args) -> None:
    digest, first_frame = Digest(), 0
    for seq, codes in plan(args.seed, args.count):
        last = seq == args.count - 1
        flags = RecordFlags.LAST if last else 0
        tick()
        producer.put(codes, handle=HANDLE, seq=seq, first_frame=first_frame, flags=flags,
                     finish_reason=FinishReason.STOP if last else 0, timeout=30.0)
        digest.add(HANDLE, seq, first_frame, flags, codes)
        first_frame += codes.shape[0]
    write_json(args.result, {"count": digest.count, "digest": digest.hexdigest(), "bytes": digest.nbytes})


def run_fill(producer, tick: Ticker, args, events: Events) -> None:
    codes = np.arange(512, dtype=np.int16).reshape(64, 8)  # 1 KiB
    seq = 0
    while producer.try_put(codes, handle=HANDLE, seq=seq):
        seq += 1
        tick()
    events.emit("full", records=seq)
    try:
        producer.put(codes, handle=HANDLE, seq=seq, timeout=0.05)
        events.emit("put_with_timeout_succeeded")
    except RingFull:
        events.emit("ring_full_raised")
    events.emit("blocked", seq=seq)
    for extra in range(args.count):
        producer.put(codes, handle=HANDLE, seq=seq + extra, timeout=30.0)
        if extra == 0:
            events.emit("resumed", seq=seq)
    events.emit("done", records=seq + args.count)


def run_watch(producer, tick: Ticker, events: Events) -> None:
    codes = np.zeros((1, 8), dtype=np.int16)
    seq = 0
    while producer.consumer_alive():
        tick()
        if producer.try_put(codes, handle=HANDLE, seq=seq):
            seq += 1
        time.sleep(0.01)
    events.emit("consumer_dead", records=seq)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop cleanly: finally blocks close
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck test asks for the stacks
    parser = argparse.ArgumentParser()
    add_transport_args(parser)
    parser.add_argument("--mode", choices=("stream", "idle", "fill", "watch"), required=True)
    parser.add_argument("--token", type=lambda s: int(s, 16), required=True)
    parser.add_argument("--consumer-id", default="c2w-test")
    parser.add_argument("--generation", type=int, default=1)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="sweep stale rings first, as a talker does")
    parser.add_argument("--ready", required=True)
    parser.add_argument("--events")
    parser.add_argument("--result", help="stream: where to write the sent records' digest")
    args = parser.parse_args()
    events = Events(args.events)
    swept = sweep_stale(args.liveness) if args.sweep else []
    servicer = server = None
    if args.kind == "grpc":
        servicer = FrameStreamServicer()
        server = FrameStreamServer(servicer, "127.0.0.1:0")
        server.start()
    producer, endpoint = open_producer(section(args), talker_instance_token=args.token,
                                       consumer_id=args.consumer_id, generation=args.generation,
                                       servicer=servicer)
    tick = Ticker(producer, args.heartbeat)
    try:
        tick()
        write_json(args.ready, {"endpoint": endpoint_to_json(endpoint), "swept": swept})
        wait_attached(producer, tick)
        events.emit("attached")
        if args.mode == "stream":
            run_stream(producer, tick, args)
        elif args.mode == "fill":
            run_fill(producer, tick, args, events)
        elif args.mode == "watch":
            run_watch(producer, tick, events)
        else:
            while True:
                tick()
                time.sleep(args.heartbeat / 2)
    finally:
        producer.close()
        if server is not None:
            server.stop(grace=0.5)


if __name__ == "__main__":
    main()
