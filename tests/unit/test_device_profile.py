"""services/common/device_profile.py off the GPU: the summary's arithmetic (the busy union,
kernels by kind and by name) and a profile of another thread's ops on the CPU, stopped by a
toggle or by its time limit."""

from __future__ import annotations

import json
import threading

import pytest
import torch

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
    s = summarize(spans, window_s=0.002, device="cuda")
    assert s["busy_ms"] == 0.95 and s["busy_share"] == 0.475 and s["time_ms"] == 1.15
    assert s["kinds_ms"] == {"gemm": 0.8, "convolution": 0.3, "copy": 0.05}
    first = s["kernels"][0]
    assert (first["name"], first["calls"], first["total_ms"], first["mean_us"]) == ("nvjet_a", 2, 0.8, 400)
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
        profile = DeviceProfile("talker", tmp_path)
        assert profile.toggle() is None  # started
        assert worker.wait_for(20)  # the worker's products inside the window
        path = profile.toggle()
    finally:
        worker.close()
    summary = json.loads(path.read_text())
    assert path.name.startswith("talker-") and summary["device"] == "cpu" and summary["profile"] == 0
    assert any(k["name"] == "aten::mm" for k in summary["kernels"])  # the worker's, not this thread's
    assert profile.stop() is None  # nothing running: nothing written


def test_a_profile_nobody_stops_ends_at_its_limit(tmp_path):
    profile = DeviceProfile("code2wav", tmp_path, max_seconds=0.2)
    profile.toggle()
    profile._timer.join(timeout=30)
    assert [p.name for p in profile.written] == [f"code2wav-{device_profile.os.getpid()}-0.json"]
    assert (tmp_path / profile.written[0].name).is_file()


def test_preparing_for_graphs_is_nothing_on_the_cpu_or_without_a_folder(monkeypatch):
    def no_profiler(*args, **kwargs):
        raise AssertionError("the profiler ran")

    monkeypatch.setattr("torch.profiler.profile", no_profiler)
    device_profile.prepare_for_graphs("/tmp/profiles", torch.device("cpu"))
    device_profile.prepare_for_graphs(None, torch.device("cuda", 0))
