"""torch's CPU threads per stage: the ``model.threads`` key, and the launcher's split of the
host's cores between the two torch stages (their pools contend when each takes every core)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from models.checkpoint import set_threads
from services.code2wav.config import Code2WavConfig
from services.common.config import ConfigError, load_config
from services.talker.config import TalkerConfig
from voxring.stage_process import TORCH_STAGES, StageProcess, torch_threads


@pytest.mark.parametrize(("stage", "cls"), [("talker", TalkerConfig), ("code2wav", Code2WavConfig)])
def test_threads_key_is_checked_by_name(tmp_path, stage, cls):
    path = tmp_path / f"{stage}.yaml"
    path.write_text("model: {threads: 3}")
    assert load_config(cls, path, stage, environ={}).model.threads == 3
    assert cls().model.threads == 0  # torch's default (OMP_NUM_THREADS)
    for text, needle in (("model: {threads: -1}", ">= 0"), ("model: {threads: 1.5}", "integer")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"model\.threads.*{needle}"):
            load_config(cls, path, stage, environ={})


def test_set_threads_sets_the_pool_every_thread_uses_and_0_leaves_it():
    before = torch.get_num_threads()
    try:
        assert set_threads(0) == before
        assert set_threads(1) == 1
        seen = []
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start()
        worker.join()
        assert seen == [1]  # the engine's thread computes with the same pool
    finally:
        torch.set_num_threads(before)


def test_the_launcher_splits_the_cores_between_the_torch_stages_unless_told(tmp_path):
    cores = len(os.sched_getaffinity(0))
    assert torch_threads() == max(1, cores // len(TORCH_STAGES))

    def started_with(stage: str, env: dict[str, str]) -> dict[str, str]:
        return StageProcess(stage, ready_file=tmp_path / "r", log_file=tmp_path / "l", env=env).environment()

    for stage in TORCH_STAGES:
        assert started_with(stage, {})["OMP_NUM_THREADS"] == str(torch_threads())
        assert started_with(stage, {"OMP_NUM_THREADS": "5"})["OMP_NUM_THREADS"] == "5"  # the user's
    assert "OMP_NUM_THREADS" not in started_with("gateway", {})  # torch-free
    assert started_with("talker", {})["PYTHONUNBUFFERED"] == "1"
