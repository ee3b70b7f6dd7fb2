"""Where a stage's device time goes, on demand (``metrics.profile_dir``).

SIGUSR2 starts torch's profiler in the stage (every thread's work: on a GPU the CUDA kernels and
copies it runs, CUDA graphs' kernels included; on the CPU its ops), the next SIGUSR2 stops it, and
so does ``MAX_SECONDS`` after the start. Each profile is summarized into
``<profile_dir>/<stage>-<pid>-<n>.json``: the window, how much of it the device was busy with this
process's work (the union of the kernels' spans), the time by kind (GEMM, convolution, attention,
copies, element-wise, the rest) and the kernels that took most. It tells a stage's device time
under load apart by what runs, beside py-spy's view of its threads; a trace is not kept (tens of
MB a second under load). Off unless configured: the profiler costs time while it runs.

A CUDA graph captured before the profiler first ran in the process replays unseen by it (a known
limit of torch's profiler), so an engine that profiles calls ``prepare_for_graphs`` on its device
before it captures any (a profile of nothing, started and stopped).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

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


def prepare_for_graphs(profile_dir: str | None, device) -> None:
    """Where device profiles are configured on a CUDA ``device``: the profiler run once, empty,
    before the stage captures its CUDA graphs, so that their replays are profiled later."""
    if not profile_dir or device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        pass


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


def summarize(spans: list[tuple[str, float, float]], window_s: float, device: str) -> dict:
    """A summary of ``(name, start_us, end_us)`` spans over a window of ``window_s``."""
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
    busy = busy_us([(start, end) for _, start, end in spans]) if device == "cuda" else None
    return {
        "device": device, "window_s": round(window_s, 3), "spans": len(spans),
        "time_ms": round(total_us / 1e3, 3),
        # the union of the spans: on a GPU the device's busy time for this process; not on the CPU,
        # where ops of several threads overlap and their self times are no spans
        "busy_ms": round(busy / 1e3, 3) if busy is not None else None,
        "busy_share": round(busy / 1e6 / window_s, 4) if busy is not None and window_s else None,
        "kinds_ms": {k: round(us / 1e3, 3) for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "kernels": [{"name": name[:NAME_CHARS], "kind": kind_of(name), "calls": calls,
                     "total_ms": round(us / 1e3, 3), "mean_us": round(us / calls, 2),
                     "share": round(us / total_us, 4) if total_us else None}
                    for name, (calls, us) in top],
    }


def _spans(profiler, on_gpu: bool) -> list[tuple[str, float, float]]:
    """The profile's kernels and copies on a GPU; on the CPU its ops by their own (self) time."""
    from torch.autograd import DeviceType

    spans = []
    for event in profiler.events():
        if on_gpu and event.device_type == DeviceType.CUDA:
            spans.append((event.name, event.time_range.start, event.time_range.end))
        elif not on_gpu and event.device_type == DeviceType.CPU and event.self_cpu_time_total > 0:
            start = event.time_range.start
            spans.append((event.name, start, start + event.self_cpu_time_total))
    return spans


class DeviceProfile:
    """Starts and stops torch's profiler in this process on SIGUSR2 (``install``) or ``toggle``;
    writes each profile's summary into ``directory``."""

    def __init__(self, stage: str, directory: Path, max_seconds: float = MAX_SECONDS) -> None:
        self.stage, self.directory, self.max_seconds = stage, Path(directory), max_seconds
        self._lock = threading.Lock()
        self._profiler = None
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
            if self._profiler is None:
                self._start()
                return None
            return self._stop()

    def stop(self) -> Path | None:
        """Stop the running profile, if any (its summary's path)."""
        with self._lock:
            return self._stop() if self._profiler is not None else None

    def _start(self) -> None:
        torch = sys.modules.get("torch")
        if torch is None:
            log.warning("device profile: this stage runs no torch; nothing to profile")
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        try:  # every thread's ops (the engine's), not only this one's; kernels are the process's
            from torch._C._profiler import _ExperimentalConfig
            every_thread = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
        except (ImportError, TypeError):
            every_thread = {}
        self._profiler = profile(activities=activities, record_shapes=False, with_stack=False, **every_thread)
        self._profiler.start()
        self._started = time.monotonic()
        self._timer = threading.Timer(self.max_seconds, self.stop)
        self._timer.daemon = True
        self._timer.start()
        log.info("device profile %d started (%s)", self._count, ", ".join(a.name for a in activities))

    def _stop(self) -> Path:
        profiler, self._profiler = self._profiler, None
        if self._timer is not None:
            self._timer.cancel()
        profiler.stop()
        window = time.monotonic() - self._started
        import torch

        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        summary = {"stage": self.stage, "pid": os.getpid(), "profile": self._count,
                   **summarize(_spans(profiler, on_gpu), window, "cuda" if on_gpu else "cpu")}
        path = self.directory / f"{self.stage}-{os.getpid()}-{self._count}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.rename(path)  # whole or absent for a reader waiting on it
        self._count += 1
        self.written.append(path)
        log.info("device profile %s: %.1f s, busy %.0f%%", path.name, window,
                 100 * (summary["busy_share"] or 0))
        return path
