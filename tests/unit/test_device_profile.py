"""services/common/device_profile.py and kernels/profiling.py off the GPU: the summary's
arithmetic (the busy union, kernels by kind and by name, the ranges), a profile of another
thread's ops and ranges on the CPU, stopped by a toggle or by its time limit, its start marked."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from kernels.profiling import TorchRecorder, prepare_for_graphs, ranges_on_device
from services.common import device_profile
from services.common.device_profile import DeviceProfile, busy_us, kind_of, summarize


def test_busy_time_is_the_union_of_the_spans():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel", "convolution"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16", "convolution"),
    ("flash_fwd_kernel", "attention"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
    ("_stack_step_kernel", "other"),
])
def test_a_kernel_s_kind_is_read_from_its_name(name, kind):
    assert kind_of(name) == kind


def test_the_summary_counts_each_kernel_and_kind_and_the_device_s_busy_share():
    spans = [("nvjet_a", 0, 400), ("nvjet_a", 500, 900), ("conv_b", 300, 600), ("Memcpy HtoD", 950, 1000)]
    s = summarize(spans, window_s=0.002, device="cuda", ranges={"voxring.decode": (2, 800.0)})
    assert s["busy_ms"] == 0.95 and s["busy_share"] == 0.475 and s["time_ms"] == 1.15
    assert s["kinds_ms"] == {"gemm": 0.8, "convolution": 0.3, "copy": 0.05}
    first = s["kernels"][0]
    assert (first["name"], first["calls"], first["total_ms"], first["mean_us"]) == ("nvjet_a", 2, 0.8, 400)
    assert s["ranges"] == {"voxring.decode": {"calls": 2, "ms": 0.8}}
    assert summarize(spans, 0.002, "cpu")["busy_share"] is None  # ops of threads overlap on the CPU


class Worker:
    """A thread of matrix products, counting them; ``wait_for(n)`` returns once it made n more."""

    def __init__(self) -> None:
        self.done, self.stop = 0, threading.Event()
        self.progress = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        a = torch.randn(128, 128)
        while not self.stop.is_set():
            with torch.profiler.record_function("voxring.decode"):  # as the engines name their work
                a @ a
            with self.progress:
                self.done += 1
                self.progress.notify_all()

    def wait_for(self, more: int) -> bool:
        with self.progress:
            target = self.done + more
            return self.progress.wait_for(lambda: self.done >= target, timeout=30)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_a_toggle_profiles_another_thread_s_ops_into_the_folder(tmp_path):
    worker = Worker()
    try:
        profile = DeviceProfile("talker", tmp_path, TorchRecorder())
        assert profile.toggle() is None  # started
        assert (tmp_path / f"talker-{device_profile.os.getpid()}-0.started").is_file()
        assert worker.wait_for(20)  # the worker's products inside the window
        path = profile.toggle()
    finally:
        worker.close()
    summary = json.loads(path.read_text())
    assert path.name.startswith("talker-") and summary["device"] == "cpu" and summary["profile"] == 0
    assert any(k["name"] == "aten::mm" for k in summary["kernels"])  # the worker's, not this thread's
    ranges = summary["ranges"]  # the worker's ranges, each timed (on the CPU: their wall time); the
    assert list(ranges) == ["voxring.decode"]  # first of the 20 may have begun before the start
    assert ranges["voxring.decode"]["calls"] >= 19
    assert ranges["voxring.decode"]["ms"] > 0
    assert profile.stop() is None  # nothing running: nothing written


class FakeRecorder:
    def __init__(self) -> None:
        self.started = self.stopped = 0

    def start(self) -> str:
        self.started += 1
        return "cuda"

    def stop(self):
        self.stopped += 1
        return [("nvjet", 0.0, 100.0)], {"voxring.prefill": (1, 100.0)}


def test_a_profile_nobody_stops_ends_at_its_limit(tmp_path):
    recorder = FakeRecorder()
    profile = DeviceProfile("code2wav", tmp_path, recorder, max_seconds=0.2)
    profile.toggle()
    profile._timer.join(timeout=30)
    assert [p.name for p in profile.written] == [f"code2wav-{device_profile.os.getpid()}-0.json"]
    summary = json.loads(profile.written[0].read_text())
    assert summary["ranges"] == {"voxring.prefill": {"calls": 1, "ms": 0.1}} and summary["busy_ms"] == 0.1
    assert (recorder.started, recorder.stopped) == (1, 1)
    assert profile.stop() is None and recorder.stopped == 1  # the limit stopped it: nothing more


def test_profiles_install_only_where_a_folder_is_configured_and_stop_with_the_stage(tmp_path, monkeypatch):
    import signal

    handlers = {}
    monkeypatch.setattr(signal, "signal", lambda signum, handler: handlers.setdefault(signum, handler))
    monkeypatch.setattr(device_profile, "_installed", [])
    assert device_profile.install("talker", None, FakeRecorder()) is None and not handlers
    recorder = FakeRecorder()
    made = device_profile.install("talker", str(tmp_path / "p"), recorder)
    assert signal.SIGUSR2 in handlers and (tmp_path / "p").is_dir()
    made.toggle()
    device_profile.stop_installed()  # the stage stops: the running profile is written
    assert recorder.stopped == 1 and len(made.written) == 1


def test_preparing_for_graphs_is_nothing_on_the_cpu(monkeypatch):
    def no_profiler(*args, **kwargs):
        raise AssertionError("the profiler ran")

    monkeypatch.setattr("kernels.profiling.profile", no_profiler)
    prepare_for_graphs(torch.device("cpu"))


def test_a_range_s_kernel_time_is_read_from_its_marks_on_the_device_s_timeline():
    kernels = [("gemm", 0.0, 10.0), ("norm", 12.0, 15.0), ("gemm", 18.0, 30.0), ("copy", 40.0, 41.0),
               ("long", 50.0, 90.0)]
    marks = [("voxring.prefill", 0.0, 15.0), ("voxring.decode", 18.0, 30.0), ("voxring.decode", 60.0, 70.0)]
    ranges = ranges_on_device(kernels, marks)
    assert ranges["voxring.prefill"] == (1, 13.0)  # its two kernels, not the gap between them
    assert ranges["voxring.decode"] == (2, 22.0)   # 12 us, and the part of the long kernel in its mark
    assert ranges_on_device([], marks)["voxring.decode"] == (2, 0.0)
