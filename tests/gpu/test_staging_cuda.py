"""Prefill's staging on a CUDA GPU: many calls while the device is busy never wait for it (a step's
prefill makes one call per bucket, queued behind the decode step in flight), and every call's
device views hold what its host views held. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import numpy as np

from services.talker.staging import Staging


def test_calls_behind_a_busy_stream_neither_wait_nor_mix_their_contents():
    staging = Staging(torch.device("cuda"))
    fields = [("x", np.int64, (700,)), ("y", np.float32, (3, 5))]
    held = []  # its views keep each call's block: eight blocks of this size, all cached and free below
    for _ in range(8):
        held.append(staging.begin(fields))
        staging.upload()
    torch.cuda.synchronize()
    held.clear()
    busy = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued ahead of every copy below
    busy.record()
    outputs = []
    for call in range(8):
        host = staging.begin(fields)
        host["x"][:] = np.arange(700) + call
        host["y"][:] = call / 2
        dev = staging.upload()
        outputs.append((dev["x"].clone(), dev["y"].clone()))  # queued: read before the next copy
    assert not busy.query(), "a staging call waited for the device"
    torch.cuda.synchronize()
    for call, (x, y) in enumerate(outputs):
        assert torch.equal(x.cpu(), torch.arange(700) + call)
        assert torch.equal(y.cpu(), torch.full((3, 5), call / 2))
