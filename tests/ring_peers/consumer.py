"""A Code2Wav-like consumer process for the ring tests (started with subprocess).

Reads the producer's endpoint from --endpoint (the producer's ready file), attaches or
subscribes, and runs --mode on its one (engine) thread, storing its heartbeat at least
every --heartbeat seconds:

  drain   read until the producer closes, checking every record against the seeded plan;
          write --result: count, digest, bytes, wraps, first mismatch
  paused  attach and tick, but read nothing until --go-file exists; then drain
  watch   read and tick until the producer is dead or closed; event "producer_dead" /
          "producer_closed", then exit 0
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import secrets
import signal
import sys
import time

import numpy as np

from services.transport import open_consumer
from services.transport.layout import PeerDead, RingClosed
from tests.ring_peers.records import (
    Digest,
    Events,
    add_transport_args,
    endpoint_from_json,
    plan,
    section,
    write_json,
)


def wait_for_file(path: str, consumer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear")
        consumer.tick()
        time.sleep(0.01)


def drain(consumer, args) -> dict:
    expected = plan(args.seed, args.count)
    digest, mismatch, first_frame = Digest(), None, 0
    last_tick, interval_ns = 0, int(args.heartbeat * 1e9)
    while True:
        now = time.monotonic_ns()
        if now - last_tick >= interval_ns:
            consumer.tick()
            last_tick = now
        try:
            views = consumer.get_batch(64, timeout=args.heartbeat)
        except RingClosed:
            break
        for view in views:
            record = view.record
            digest.add(record.handle, record.seq, record.first_frame, record.flags, view.codes)
            if mismatch is None and record.seq != digest.count - 1:
                mismatch = f"record seq {record.seq} arrived as record {digest.count - 1}"
            if mismatch is None and args.count:
                mismatch = _check(record, view.codes, next(expected, None), first_frame)
            first_frame += record.num_frames
        consumer.release()
    position = getattr(consumer, "position", 0)
    capacity = getattr(consumer, "capacity", 1)
    return {"count": digest.count, "digest": digest.hexdigest(), "bytes": digest.nbytes,
            "wraps": position // capacity, "mismatch": mismatch}


def _check(record, codes: np.ndarray, planned, first_frame: int) -> str | None:
    if planned is None:
        return f"unexpected record seq {record.seq}"
    seq, want = planned
    if record.seq != seq or record.first_frame != first_frame:
        return f"record seq {record.seq} first_frame {record.first_frame}, expected {seq} {first_frame}"
    if codes.shape != want.shape or not np.array_equal(codes, want):
        return f"record seq {seq}: codes differ (shape {codes.shape}, expected {want.shape})"
    return None


def watch(consumer, args, events: Events) -> None:
    while True:
        consumer.tick()
        try:
            while consumer.get(timeout=args.heartbeat) is not None:
                consumer.release()
        except PeerDead:
            events.emit("producer_dead")
            return
        except RingClosed:
            events.emit("producer_closed")
            return


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop cleanly: finally blocks close
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck test asks for the stacks
    parser = argparse.ArgumentParser()
    add_transport_args(parser)
    parser.add_argument("--mode", choices=("drain", "paused", "watch"), required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--go-file")
    parser.add_argument("--result")
    parser.add_argument("--events")
    args = parser.parse_args()
    events = Events(args.events)
    with open(args.endpoint) as f:
        endpoint = endpoint_from_json(json.load(f)["endpoint"])
    consumer = open_consumer(section(args), endpoint, secrets.randbits(64))
    try:
        consumer.tick()
        events.emit("attached")
        if args.mode == "watch":
            watch(consumer, args, events)
            return
        if args.mode == "paused":
            wait_for_file(args.go_file, consumer)
        write_json(args.result, drain(consumer, args))
    finally:
        consumer.close()


if __name__ == "__main__":
    main()
