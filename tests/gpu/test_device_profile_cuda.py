"""services/common/device_profile.py with kernels/profiling.py on a CUDA GPU: a graph captured
after ``prepare_for_graphs``
has its replays' kernels in a later profile, counted by kind, with the device's busy share, and
summed under the ``voxring.*`` range they were replayed in.
Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

from kernels.profiling import TorchRecorder, prepare_for_graphs
from services.common.device_profile import DeviceProfile


def test_a_graph_s_replays_are_profiled_when_prepared_before_its_capture(tmp_path):
    device = torch.device("cuda", 0)
    prepare_for_graphs(device)
    a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up on a side stream, as graph capture asks
            a @ a
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = a @ a
    torch.cuda.synchronize()
    profile = DeviceProfile("talker", tmp_path, TorchRecorder())
    profile.toggle()
    for _ in range(20):
        with torch.profiler.record_function("voxring.decode"):
            graph.replay()
    torch.cuda.synchronize()
    summary = json.loads(profile.toggle().read_text())
    assert summary["device"] == "cuda" and 0 < summary["busy_share"] <= 1
    assert not [k for k in summary["kernels"] if k["name"].startswith("voxring.")]  # marks, no kernels
    gemms = [k for k in summary["kernels"] if k["kind"] == "gemm"]
    assert gemms and max(k["calls"] for k in gemms) >= 20, summary["kernels"][:5]
    decode = summary["ranges"]["voxring.decode"]  # the range's kernels: the replays'
    assert decode["calls"] == 20 and decode["ms"] >= 0.9 * sum(k["total_ms"] for k in gemms)
    assert out.shape == (1024, 1024)
