"""The host side of the cost model, from the host probe (``host_probe.py``) run on the GPU
machine's host (three runs, ``bench/results/sim/host_gpu_{1,2,3}.json``, probe code of
a7f6f7b) and on this CPU machine (``host_this_cpu.json``):

- gRPC's CPU per message on the GPU host, used as is (medians of the three runs; the
  64-stream and 64-concurrent figures, the loaded case): a server-stream message's send and
  receive cost as a fixed part plus a part per byte (fitted through the 2- and 16-frame
  chunks), a unary call's on each side;
- the host factor: how much longer the GPU host's CPU takes for the same Python than this
  one, the median over the probe's three talker-engine workloads (64, 256, 1,024 rows) of
  (GPU host's median / this machine's). The simulator multiplies every lane's measured CPU
  time by it. The probe's runs vary by about ±25% on either machine (CPU steal on this VM).
"""

from __future__ import annotations

import json
import statistics
from functools import cache
from pathlib import Path

from bench.sim.engines import HostCosts

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "sim"
GPU_HOST_RUNS = tuple(RESULTS / f"host_gpu_{i}.json" for i in (1, 2, 3))
THIS_CPU = RESULTS / "host_this_cpu.json"
CHUNK_BYTES = {"2_frames": 2 * 1920 * 2, "16_frames": 16 * 1920 * 2}
ENGINE_ROWS = ("rows_64", "rows_256", "rows_1024")


class HostFileError(ValueError):
    """A host probe file lacks a number the simulator needs (named)."""


def _get(data: dict, path: str, source: Path) -> float:
    value = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise HostFileError(f"{source.name}: no {path}")
        value = value[key]
    if not isinstance(value, (int, float)) or not value > 0:
        raise HostFileError(f"{source.name}: {path} must be a positive number, got {value!r}")
    return float(value)


def _median(paths, key: str) -> float:
    return statistics.median(_get(json.loads(p.read_text()), key, p) for p in paths)


def _linear(paths, kind: str) -> tuple[float, float]:
    small = _median(paths, f"grpc.{kind}.2_frames.streams_64") / 1e3
    large = _median(paths, f"grpc.{kind}.16_frames.streams_64") / 1e3
    per_byte = max(0.0, (large - small) / (CHUNK_BYTES["16_frames"] - CHUNK_BYTES["2_frames"]))
    return small - per_byte * CHUNK_BYTES["2_frames"], per_byte


@cache
def load_host_costs() -> HostCosts:
    runs = GPU_HOST_RUNS
    return HostCosts(unary_server_s=_median(runs, "grpc.unary_server_ms.concurrent_64") / 1e3,
                     unary_client_s=_median(runs, "grpc.unary_client_ms.concurrent_64") / 1e3,
                     stream_send_s=_linear(runs, "stream_send_ms"),
                     stream_recv_s=_linear(runs, "stream_recv_ms"))


@cache
def host_factor() -> float:
    here = json.loads(THIS_CPU.read_text())
    ratios = [_median(GPU_HOST_RUNS, f"engine.talker_step_cpu_ms.{rows}")
              / _get(here, f"engine.talker_step_cpu_ms.{rows}", THIS_CPU) for rows in ENGINE_ROWS]
    return round(statistics.median(ratios), 3)
