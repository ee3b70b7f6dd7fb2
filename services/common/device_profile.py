"""Where a stage's device time goes, on demand (``metrics.profile_dir``, the talker and Code2Wav).

SIGUSR2 starts a profile in the stage (kernels/profiling.py: torch's profiler, every thread's
work; on a GPU the kernels and copies the process runs, CUDA graphs' kernels included; on the CPU
its ops), the next SIGUSR2 stops it, and so does ``MAX_SECONDS`` after the start. A started profile
leaves ``<stage>-<pid>-<n>.started`` in the folder (a reader waits for it before its load), and a
stopped one its summary, ``<stage>-<pid>-<n>.json``: the window, how much of it the device was busy
with this process's work (the union of the kernels' spans), the time by kind (GEMM, convolution,
attention, copies, element-wise, the rest), the kernels that took most, and the kernels' time under
the stage's own ranges (``voxring.*``: the talker's prefill and decode launches, Code2Wav's decode
calls; on the CPU their wall time). It tells a stage's device time under load apart by what runs,
beside py-spy's view of its threads; no trace is kept (tens of MB a second under load). Off unless
configured: the profiler costs time while it runs. This module holds no torch (the gateway's
rules): the engine passes its recorder in.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

MAX_SECONDS = 60.0  # a profile nobody stops ends here (its events grow with every kernel)
TOP = 40            # kernels listed by name
NAME_CHARS = 160    # a kernel's name as listed (C++ templates run to thousands of characters)
KINDS = (  # the first that matches a kernel's name
    ("copy", re.compile(r"memcpy|memset", re.I)),
    ("convolution", re.compile(r"conv|winograd|implicit_gemm|cudnn", re.I)),
    ("attention", re.compile(r"attn|attention|flash|fmha|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|_mm_|splitk", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce|softmax|norm|index|cat", re.I)),
)


class Recorder(Protocol):
    def start(self) -> str: ...  # the device it records: "cuda" or "cpu"

    # (name, start_us, end_us) spans; {range: (calls, us)}
    def stop(self) -> tuple[list[tuple[str, float, float]], dict[str, tuple[int, float]]]: ...


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(spans: list[tuple[str, float, float]], window_s: float, device: str,
              ranges: dict[str, tuple[int, float]] | None = None) -> dict:
    """A summary of ``(name, start_us, end_us)`` spans over a window of ``window_s``, with the
    ranges' (calls, us)."""
    by_name: dict[str, list[float]] = {}
    for name, start, end in spans:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    total_us = sum(us for _, us in by_name.values())
    kinds: dict[str, float] = {}
    for name, (_, us) in by_name.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP]
    # the union of the spans: on a GPU the device's busy time for this process; not on the CPU,
    # where ops of several threads overlap and their self times are no spans
    busy = busy_us([(start, end) for _, start, end in spans]) if device == "cuda" else None
    return {
        "device": device, "window_s": round(window_s, 3), "spans": len(spans),
        "time_ms": round(total_us / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3) if busy is not None else None,
        "busy_share": round(busy / 1e6 / window_s, 4) if busy is not None and window_s else None,
        "kinds_ms": {k: round(us / 1e3, 3) for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels": [{"name": name[:NAME_CHARS], "kind": kind_of(name), "calls": calls,
                     "total_ms": round(us / 1e3, 3), "mean_us": round(us / calls, 2),
                     "share": round(us / total_us, 4) if total_us else None}
                    for name, (calls, us) in top],
        "ranges": {name: {"calls": calls, "ms": round(us / 1e3, 3)}
                   for name, (calls, us) in sorted((ranges or {}).items())},
    }


class DeviceProfile:
    """Starts and stops ``recorder`` on SIGUSR2 (``install``) or ``toggle``; writes each profile's
    summary into ``directory``."""

    def __init__(self, stage: str, directory: Path, recorder: Recorder,
                 max_seconds: float = MAX_SECONDS) -> None:
        self.stage, self.directory, self.recorder = stage, Path(directory), recorder
        self.max_seconds = max_seconds
        self._lock = threading.Lock()
        self._running = False
        self._device = "cpu"
        self._started = 0.0
        self._count = 0
        self._timer: threading.Timer | None = None
        self.written: list[Path] = []

    def install(self) -> DeviceProfile:
        """SIGUSR2 toggles a profile (from the main thread; the work runs on a thread of its own)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGUSR2, lambda signum, frame: threading.Thread(
            target=self.toggle, name="device-profile", daemon=True).start())
        log.info("device profiles on SIGUSR2 into %s", self.directory)
        return self

    def toggle(self) -> Path | None:
        """Start a profile, or stop the running one and return its summary's path."""
        with self._lock:
            if not self._running:
                self._start()
                return None
            return self._stop()

    def stop(self) -> Path | None:
        """Stop the running profile, if any (its summary's path)."""
        with self._lock:
            return self._stop() if self._running else None

    def _path(self, suffix: str) -> Path:
        return self.directory / f"{self.stage}-{os.getpid()}-{self._count}{suffix}"

    def _start(self) -> None:
        self._device = self.recorder.start()
        self._running, self._started = True, time.monotonic()
        self._timer = threading.Timer(self.max_seconds, self.stop)
        self._timer.daemon = True
        self._timer.start()
        self._path(".started").touch()
        log.info("device profile %d started (%s)", self._count, self._device)

    def _stop(self) -> Path:
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
        spans, ranges = self.recorder.stop()
        window = time.monotonic() - self._started
        summary = {"stage": self.stage, "pid": os.getpid(), "profile": self._count,
                   **summarize(spans, window, self._device, ranges)}
        path = self._path(".json")
        tmp = self._path(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.rename(path)  # whole or absent for a reader waiting on it
        self._count += 1
        self.written.append(path)
        log.info("device profile %s: %.1f s, busy %.0f%%", path.name, window,
                 100 * (summary["busy_share"] or 0))
        return path


_installed: list[DeviceProfile] = []


def install(stage: str, profile_dir: str | None, recorder: Recorder) -> DeviceProfile | None:
    """The stage's device profiles on SIGUSR2 where ``metrics.profile_dir`` is set (from the main
    thread); None where it is not."""
    if not profile_dir:
        return None
    made = DeviceProfile(stage, Path(profile_dir), recorder).install()
    _installed.append(made)
    return made


def stop_installed() -> None:
    """A profile still running when the stage stops is written, not lost."""
    for profile in _installed:
        profile.stop()
