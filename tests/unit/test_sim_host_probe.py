"""bench.sim.host_probe --quick on the CPU: the JSON has every section and key, every
number is positive and finite, and the run leaves no socket folder and no process behind.
No timing is asserted: the numbers are what this machine measured, not targets."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO

SIDES = {"one_stream", "streams_64"}
SIZES = {"2_frames", "16_frames"}
UNARY = {"sequential", "concurrent_64"}
ROWS = {"rows_64", "rows_256", "rows_1024"}
MACHINE = {"cpu_model", "cpu_count", "python", "grpcio", "protobuf", "numpy", "platform"}


def _numbers(value, where=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield where, value


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment carries ``marker`` (the probe's children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_quick_probe_writes_every_key_and_leaves_nothing(tmp_path):
    out = tmp_path / "x.json"
    scratch = Path(tempfile.mkdtemp(prefix="vxp-", dir="/tmp"))  # short: a socket path has 107 bytes
    token = secrets.token_hex(8)
    marker = f"VOXRING_PROBE_TEST={token}"
    env = {**os.environ, "TMPDIR": str(scratch), "VOXRING_PROBE_TEST": token}
    try:
        done = subprocess.run([sys.executable, "-m", "bench.sim.host_probe", "--quick", "--out", str(out)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-4000:]
        assert not list(scratch.iterdir()), "the probe left its socket folder behind"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert not _processes_with(marker), "the probe left a process behind"

    result = json.loads(out.read_text())
    assert set(result["machine"]) >= MACHINE
    grpc = result["grpc"]
    for key in ("stream_send_ms", "stream_recv_ms", "wall_ms_per_stream_message"):
        assert set(grpc[key]) == SIZES and all(set(grpc[key][s]) == SIDES for s in SIZES), key
    for key in ("unary_server_ms", "unary_client_ms", "wall_ms_per_unary_call"):
        assert set(grpc[key]) == UNARY, key
    assert set(result["engine"]["talker_step_cpu_ms"]) == ROWS
    assert set(result["engine"]["per_row_frame_us"]) == ROWS
    assert "reference_loop_ms" in result and "seconds" in result
    numbers = list(_numbers(result))
    assert len(numbers) > 30
    bad = [(where, value) for where, value in numbers if not (math.isfinite(value) and value > 0)]
    assert not bad, bad
