"""The server bench's MPS daemons (bench/server/gpu.py ``MpsDaemons``, procs.Server's stage
environments), with ``nvidia-cuda-mps-control`` faked: a layout on one GPU keeps one daemon whose
clients pick their GPU; on two GPUs each GPU gets its own daemon (own folders, started with that GPU
alone visible), its stages its pipe and no CUDA_VISIBLE_DEVICES (the daemon maps its GPU to their
device 0), the gateway neither; the status is active only when every daemon serves."""

from __future__ import annotations

import pytest

from bench.server import gpu as gpu_module
from bench.server.gpu import MpsDaemons
from bench.server.procs import Server
from bench.server.settings import layout_stages


@pytest.fixture
def control(monkeypatch, tmp_path):
    """A fake control program: records each call's command and the daemon's GPU; lists a server."""
    calls = []

    def run_cmd(args, timeout=10.0, env=None, stdin=None):
        calls.append((args[-1] if len(args) > 1 else (stdin or "").strip(), env.get("CUDA_VISIBLE_DEVICES"),
                      env["CUDA_MPS_PIPE_DIRECTORY"]))
        return 0, "4242" if stdin == "get_server_list\n" else ""

    monkeypatch.setattr(gpu_module, "MPS_DIR", tmp_path / "mps")
    monkeypatch.setattr(gpu_module, "run_cmd", run_cmd)
    monkeypatch.setattr(gpu_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(gpu_module.time, "sleep", lambda s: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return calls


def test_one_gpu_keeps_one_daemon_and_its_clients_pick_their_gpu(control, tmp_path):
    daemons = MpsDaemons(["3"])
    extra = daemons.start()
    assert not daemons.per_gpu and extra["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
    assert ("-d", None, str(tmp_path / "mps" / "pipe")) in control  # every GPU visible to it
    server = Server(tmp_path, layout_stages("one"), {}, {"BASE": "1", **extra}, ["3"])
    talker = next(spec for spec in layout_stages("one") if spec.kind == "talker")
    assert server._env(talker)["CUDA_VISIBLE_DEVICES"] == "3"


def test_two_gpus_get_a_daemon_each_and_their_stages_its_pipe(control, tmp_path):
    daemons = MpsDaemons(["0", "1"])
    assert daemons.start() == {} and daemons.per_gpu
    started = [(gpu, pipe) for command, gpu, pipe in control if command == "-d"]
    assert started == [("0", str(tmp_path / "mps" / "gpu-0" / "pipe")),
                       ("1", str(tmp_path / "mps" / "gpu-1" / "pipe"))]
    specs = layout_stages("two-pairs")
    server = Server(tmp_path, specs, {}, {"BASE": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, ["0", "1"],
                    daemons.client_env)
    for spec in specs:
        env = server._env(spec)
        if spec.gpu is None:  # the gateway: no GPU, no daemon
            assert "CUDA_MPS_PIPE_DIRECTORY" not in env
            continue
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / f"gpu-{spec.gpu}" / "pipe")
        assert "CUDA_VISIBLE_DEVICES" not in env and env["BASE"] == "1"
    daemons.check_clients()
    assert daemons.status["active"] and len(daemons.status["per_gpu"]) == 2
    daemons.daemons[1].status["active"] = False
    assert not daemons.status["active"]
    daemons.stop()
    assert [gpu for command, gpu, _ in control if command == "quit"] == [None, None]  # control calls


def test_a_gpu_whose_daemon_did_not_start_runs_its_stages_without_it(control, tmp_path, monkeypatch):
    daemons = MpsDaemons(["0", "1"])
    daemons.daemons[1].started = False
    daemons.daemons[0].started = True
    assert daemons.client_env(1) == {}
    specs = layout_stages("two-pairs")
    server = Server(tmp_path, specs, {}, {}, ["0", "1"], daemons.client_env)
    on_second = next(spec for spec in specs if spec.gpu == 1)
    assert server._env(on_second)["CUDA_VISIBLE_DEVICES"] == "1"  # not an MPS client: picks its GPU


@pytest.mark.parametrize("layout", ["one", "two-pairs", "split"])
def test_a_pairs_stages_sharing_a_gpu_get_the_sm_limits_voxring_up_gives_them(control, tmp_path, layout):
    # the default deployment's limits (voxring/mps_daemon.sm_percent): none by default, the
    # launcher's VOXRING_<STAGE>_SM_PERCENT where set (empty: none); a stage alone on its GPU (the
    # split layout) or without MPS has none
    specs = layout_stages(layout)
    gpus = ["0"] if layout == "one" else ["0", "1"]
    daemons = MpsDaemons(gpus)
    extra = daemons.start()
    client_env = daemons.client_env if daemons.per_gpu else None
    assert Server(tmp_path, specs, {}, extra, gpus, client_env).sm_limits() == {}
    chosen = {**extra, "VOXRING_TALKER_SM_PERCENT": "", "VOXRING_CODE2WAV_SM_PERCENT": "30"}
    server = Server(tmp_path, specs, {}, chosen, gpus, client_env)
    assert server.sm_limits() == ({} if layout == "split" else
                                  {spec.name: "30" for spec in specs if spec.kind == "code2wav"})
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in server._env(specs[-1])  # the gateway
    assert Server(tmp_path, specs, {}, {}, gpus).sm_limits() == {}  # no MPS: no limit
