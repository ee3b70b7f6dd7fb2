"""torch's profiler, read for a stage's device profile (services/common/device_profile.py holds
the signal, the window and the summary; this module the torch side): the kernels and copies a
process ran on a GPU, CUDA graphs' replays included (on the CPU its ops by their own time), and
the time under each ``voxring.*`` ``record_function`` range the engines open around their work
(the talker's prefill and decode launches, Code2Wav's decode calls). On a GPU the profiler marks
those ranges on the device's timeline too; the marks are no kernels, so they are kept apart from
the spans and place the kernels (graph replays' included) by time.

A CUDA graph captured before the profiler first ran in the process replays unseen by it (a known
limit of torch's profiler), so an engine that profiles calls ``prepare_for_graphs`` before it
captures any: a profile of nothing, started and stopped."""

from __future__ import annotations

import bisect

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

RANGE_PREFIX = "voxring."  # the ranges whose kernels a profile sums


def prepare_for_graphs(device: torch.device) -> None:
    """On a CUDA ``device``: the profiler run once, empty, before any graph is captured."""
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            pass


def _every_thread() -> dict:
    """The profiler's option to record every thread's ops (the engine thread's, not only the
    caller's), where this torch has it; a GPU's kernels are the process's either way."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


class TorchRecorder:
    """One profile at a time: ``start`` it, ``stop`` it for its spans and ranges."""

    def __init__(self) -> None:
        self._profile = None
        self.device = "cpu"

    def start(self) -> str:
        """Starts recording; the device it records ("cuda" where this process runs CUDA, else "cpu")."""
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.device = "cuda" if on_gpu else "cpu"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
        self._profile = profile(activities=activities, record_shapes=False, with_stack=False,
                                **_every_thread())
        self._profile.start()
        return self.device

    def stop(self) -> tuple[list[tuple[str, float, float]], dict[str, tuple[int, float]]]:
        """Stops recording: ``(name, start_us, end_us)`` of each kernel and copy on a GPU (each op
        by its own time on the CPU), and each ``voxring.*`` range's (calls, us)."""
        prof, self._profile = self._profile, None
        prof.stop()
        events = prof.events()
        on_gpu = self.device == "cuda"
        spans, marks = _spans(events, on_gpu)
        return spans, (ranges_on_device(spans, marks) if marks else _ranges(events, on_gpu))


def _spans(events, on_gpu: bool) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """The kernels' and copies' spans, and apart from them the ``voxring.*`` ranges as the GPU's
    timeline marks them (from a range's first kernel to its last: no kernel time of their own)."""
    spans, marks = [], []
    for event in events:
        if on_gpu and event.device_type == DeviceType.CUDA:
            span = (event.name, event.time_range.start, event.time_range.end)
            (marks if event.name.startswith(RANGE_PREFIX) else spans).append(span)
        elif not on_gpu and event.device_type == DeviceType.CPU and event.self_cpu_time_total > 0:
            start = event.time_range.start
            spans.append((event.name, start, start + event.self_cpu_time_total))
    return spans, marks


def ranges_on_device(spans: list[tuple[str, float, float]],
                     marks: list[tuple[str, float, float]]) -> dict[str, tuple[int, float]]:
    """Each marked range's calls and the kernel time inside its marks on the GPU's timeline (a
    kernel counted for the part of it between a mark's start and end): a CUDA graph's replayed
    kernels have no launch of their own on the CPU to follow, so the timeline is what places them."""
    ordered = sorted((start, end) for _, start, end in spans)
    starts = [start for start, _ in ordered]
    longest = max((end - start for start, end in ordered), default=0.0)
    out: dict[str, tuple[int, float]] = {}
    for name, mark_start, mark_end in marks:
        us = 0.0
        for start, end in ordered[bisect.bisect_left(starts, mark_start - longest):
                                  bisect.bisect_left(starts, mark_end)]:
            us += max(0.0, min(end, mark_end) - max(start, mark_start))
        calls, total = out.get(name, (0, 0.0))
        out[name] = (calls + 1, total + us)
    return out


def _ranges(events, on_gpu: bool) -> dict[str, tuple[int, float]]:
    """Each ``voxring.*`` range's calls and us where the GPU's timeline has no marks: on a GPU the
    kernels launched inside it (its own and its ops'), on the CPU its wall time."""

    def kernels_us(event) -> float:
        return sum(k.duration for k in event.kernels) + sum(kernels_us(c) for c in event.cpu_children)

    out: dict[str, tuple[int, float]] = {}
    for event in events:
        if event.device_type == DeviceType.CPU and event.name.startswith(RANGE_PREFIX):
            calls, us = out.get(event.name, (0, 0.0))
            out[event.name] = (calls + 1, us + (kernels_us(event) if on_gpu else event.cpu_time_total))
    return out
