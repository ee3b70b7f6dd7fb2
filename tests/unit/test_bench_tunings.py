"""The stack_step benchmarks' tunings and frame settings, built as values on the CPU (the benchmarks run
on a GPU only): their JSON keys are ``Tuning``'s fields, a deleted switch is refused by name, and a
bench/talker/fusion.py stage becomes the fused frame's ``FusedSettings``."""

from __future__ import annotations

import pytest

from bench.probes import backbone as backbone_probe
from bench.probes import stack_step as stack_probe
from bench.probes.stack_step_phases import phase_names, sweep_entry
from bench.talker import fusion as talker_fusion
from kernels.stack_step import BACKBONE, DEPTH
from models.csm.frame_fused import DEFAULT_SETTINGS


def test_talker_fusion_stages_are_frame_settings():
    settings = {name: talker_fusion.fused_settings(stage) for name, _, _, stage in talker_fusion.STAGES}
    assert settings["+ rope_attention kernel (default)"] == DEFAULT_SETTINGS
    assert talker_fusion.STAGES[-1][2]["rope_attention"] and not talker_fusion.STAGES[-2][2]["rope_attention"]
    assert settings["+ stack_step, depth calls <= 2 rows"].stack_step_rows == 2
    assert not settings["+ stack_step, depth calls <= 16 rows"].projected_inputs  # the stages before project
    # a candidate's tuning keys reach the depth calls and (over BACKBONE's changes) the backbone's launches
    candidate = talker_fusion.fused_settings({"projected": True, "BK": 128, "backbone_rows": 2})
    assert candidate.depth_tuning.BK == candidate.backbone_tuning.BK == 128
    assert (candidate.backbone_tuning.BN_QKV, candidate.backbone_stack_rows) == (BACKBONE.BN_QKV, 2)
    own = talker_fusion.fused_settings({"backbone_tuning": {"KQ_QKV": 8}}).backbone_tuning
    assert own.KQ_QKV == 8 and own.BN_QKV == DEPTH.BN_QKV  # "backbone_tuning" replaces BACKBONE's changes
    with pytest.raises(ValueError, match="unknown tuning key 'HOIST'"):
        talker_fusion.fused_settings({"HOIST": 0})


def test_probe_sweeps_are_tunings():
    assert sweep_entry(stack_probe.SWEEP[0]) == (DEPTH, False)  # the stack without mlp rows
    tuning, mlp_rows = sweep_entry({"KQ_O": 1})
    assert tuning.KQ_O == 1 and mlp_rows
    assert phase_names(DEPTH, 1, False, True) == ["QKV", "ATT", "OUT_PROJ", "MLP", "DOWN_REDUCE", "OUT"]
    assert phase_names(DEPTH, 2, True, False).count("DOWN") == 2
    assert [BACKBONE.with_keys(t).KQ_QKV for t in backbone_probe.TUNINGS] == [1, 8]
    with pytest.raises(ValueError, match="unknown tuning key 'MLP_DOWN'"):
        sweep_entry({"MLP_DOWN": 0})
