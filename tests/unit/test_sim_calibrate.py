"""bench/sim/calibrate.py: a committed run becomes the simulated run it was (no simulation here)."""

from __future__ import annotations

import copy
import json

import pytest

from bench.sim.calibrate import RUNS, CalibrationError, spec_for
from bench.sim.run import ENGINE_CAP


def _measured(name: str) -> tuple[dict, str]:
    path, profile = RUNS[name]
    return json.loads(path.read_text()), profile


def test_the_calibration_run_keeps_every_tier():
    measured, profile = _measured("calibration")
    spec = spec_for(measured, profile)
    assert spec.tiers == tuple(sorted(int(c) for c in measured["tiers"]))
    assert spec.profile == "ee9c553" and not spec.mps


@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("verify_")])
def test_a_run_past_the_engine_cap_is_compared_to_the_cap(name):
    measured, profile = _measured(name)
    assert max(int(c) for c in measured["tiers"]) > ENGINE_CAP
    spec = spec_for(measured, profile)
    assert max(spec.tiers) == ENGINE_CAP and profile == "tip"
    assert spec.mps == measured["mps"]["requested"] and spec.load == measured["load"]


def test_a_run_whose_other_configs_differ_is_refused():
    measured, profile = _measured("verify_poisson_mps_off")
    changed = copy.deepcopy(measured)
    changed["configs"]["talker"]["engine"]["k_max"] = 4  # not a key sized for the top tier
    with pytest.raises(CalibrationError, match="differ"):
        spec_for(changed, profile)
