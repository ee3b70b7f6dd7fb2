"""What the ring test peers share: a seeded plan of records (sizes 16 B .. 64 KiB,
log-uniform), a running digest of what was sent or received, endpoints as JSON files,
and event lines stamped with CLOCK_MONOTONIC (comparable across processes on a host)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from services.transport import Endpoint, TransportSection

CODEBOOK_CHOICES = (1, 2, 4, 8, 16, 32)
_HEADER = struct.Struct("<QIIIII")  # handle, seq, first_frame, frames, codebooks, flags


def plan(seed: int, count: int, min_bytes: int = 16,
         max_bytes: int = 65536) -> Iterator[tuple[int, np.ndarray]]:
    """(seq, codes [frames, codebooks] int16) for seq 0..count-1; payload sizes between
    min_bytes and max_bytes, log-uniform, so small and large records both occur often."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-32768, 32768, size=1 << 16, dtype=np.int16)
    for seq in range(count):
        num_codebooks = int(rng.choice(CODEBOOK_CHOICES))
        target = math.exp(rng.uniform(math.log(min_bytes), math.log(max_bytes)))
        num_frames = int(min(max(math.ceil(min_bytes / (2 * num_codebooks)), target // (2 * num_codebooks)),
                             max_bytes // (2 * num_codebooks)))
        start = int(rng.integers(0, pool.size - num_frames * num_codebooks + 1))
        yield seq, pool[start:start + num_frames * num_codebooks].reshape(num_frames, num_codebooks)


class Digest:
    """sha256 over every record's header fields and codes bytes, in order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.count = 0
        self.nbytes = 0

    def add(self, handle: int, seq: int, first_frame: int, flags: int, codes: np.ndarray) -> None:
        self._hash.update(_HEADER.pack(handle, seq, first_frame, codes.shape[0], codes.shape[1], flags))
        self._hash.update(codes.tobytes())
        self.count += 1
        self.nbytes += codes.nbytes

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def section(args) -> TransportSection:
    return TransportSection(kind=args.kind, capacity_bytes=args.capacity, spin_us=args.spin_us,
                            liveness_timeout=args.liveness, heartbeat_interval=args.heartbeat)


def add_transport_args(parser) -> None:
    parser.add_argument("--kind", choices=("shm", "grpc"), default="shm")
    parser.add_argument("--capacity", type=int, default=786432)
    parser.add_argument("--spin-us", type=int, default=50)
    parser.add_argument("--liveness", type=float, default=0.3)
    parser.add_argument("--heartbeat", type=float, default=0.05)


def write_json(path: str | os.PathLike[str], data: dict) -> None:
    """Atomically (readers never see half a file)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def endpoint_to_json(endpoint: Endpoint) -> dict:
    return dataclasses.asdict(endpoint)


def endpoint_from_json(data: dict) -> Endpoint:
    return Endpoint(**data)


class Events:
    """Appends one JSON line per event: {"event": ..., "t_ns": monotonic ns, ...}."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def emit(self, event: str, **fields) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "t_ns": time.monotonic_ns(), **fields})
        with open(self.path, "a") as f:
            f.write(line + "\n")
