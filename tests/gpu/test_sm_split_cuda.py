"""model.sm_split on a CUDA GPU (kernels/green.py, services/common/sm_split.py), in a child process (a process
enters its part once): a part's blocks run only on as many SMs as the part has, on the thread
that entered it and on an engine thread after it binds; stack_step's grid is capped to the part;
a matmul in the part matches one outside it (to rounding: fewer SMs may pick another
algorithm); the two parts of one split add up to the device.
Skipped without CUDA or without NVIDIA's cuda-bindings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)
pytest.importorskip("cuda.bindings.driver", reason="needs NVIDIA's cuda-bindings (the driver's binding)")

from tests.conftest import REPO

CHILD = r'''
import json, sys, threading
import torch, triton, triton.language as tl
from kernels import green
from kernels.sms import usable_sms
from services.common import sm_split

@triton.jit
def _smid(out):
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out + tl.program_id(0), sm)

def seen():
    out = torch.full((1024,), -1, dtype=torch.int32, device="cuda")
    _smid[(1024,)](out)
    return sorted(set(out.tolist()))

device = torch.device("cuda", 0)
a = torch.randn(512, 512, device=device)
want = (a @ a).cpu()
part = sm_split.enter_configured(sys.argv[1], device, green.enter)
main = seen()
got = (a @ a).cpu()
other = []
def engine():
    sm_split.bind_this_thread()
    other.extend(seen())
thread = threading.Thread(target=engine)
thread.start(); thread.join()
print(json.dumps({"sms": part.sms, "device_sms": part.device_sms, "main": main, "engine": other,
                  "grid": usable_sms(device),
                  "same_matmul": bool(torch.allclose(want, got, rtol=1e-4, atol=1e-3))}), flush=True)
import os
os._exit(0)
'''


def child(script, spec: str) -> dict:
    """The child in a file of its own (Triton reads a kernel's source from its file)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), spec], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_part_runs_on_its_own_sms_and_the_parts_add_up_to_the_device(tmp_path):
    script = tmp_path / "sm_split_child.py"
    script.write_text(CHILD)
    group, rest = child(script, "group:64"), child(script, "rest:64")
    assert group["sms"] >= 64 and group["sms"] + rest["sms"] == group["device_sms"]
    assert not set(group["main"]) & set(rest["main"])  # the same split in two processes: disjoint SMs
    for part in (group, rest):
        assert 0 < len(part["main"]) <= part["sms"]  # the blocks ran on the part's SMs only
        assert 0 < len(part["engine"]) <= part["sms"]  # and on a thread that bound the part
        assert part["grid"] == part["sms"]  # stack_step's grid is the part's
        assert part["same_matmul"]
