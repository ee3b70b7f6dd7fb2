"""bench.sim's device cost model: the committed h200.json is what build_costs makes from the
committed result files, it loads for both profiles, its lookups give the measured values at
measured points and stay between neighbours elsewhere, and a bad file is refused naming the key
path. Expected numbers are read from the result files, not written here; no timing is asserted."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil

import pytest

from bench.sim import build_costs
from bench.sim.costs import DEFAULT_PATH, PROFILES, CostFileError, load_costs
from tests.conftest import REPO

BUCKETS = [2**i for i in range(11)]
TALKER = {"tip": "talker_step_b7f9a75", "db1c4a9": "talker_step_db1c4a9", "ee9c553": "talker_step_ee9c553",
          "3d75c85": "talker_step_db1c4a9"}
CODEC = {"tip": build_costs.VERIFY_COSTS, "db1c4a9": build_costs.CODEC_DET, "ee9c553": build_costs.CODEC_FREE,
         "3d75c85": build_costs.CODEC_FREE}
STEPS = {"tip": build_costs.VERIFY_STEPS, "db1c4a9": build_costs.TIP_STEPS}
PREFILLS = {"tip": build_costs.VERIFY_COSTS, "db1c4a9": build_costs.PREFILL}


def _result(file: str) -> dict:
    return json.loads((REPO / file).read_text())


@pytest.fixture
def doc() -> dict:
    return json.loads(DEFAULT_PATH.read_text())


def _write(tmp_path, doc: dict):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(doc))
    return path


def _refused(tmp_path, doc: dict, *fragments: str):
    with pytest.raises(CostFileError) as info:
        load_costs(_write(tmp_path, doc))
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "h200.json" in str(info.value)


def test_committed_file_is_what_the_builder_makes(doc):
    built = build_costs.build()
    assert built == doc
    assert build_costs.render(built) == DEFAULT_PATH.read_text()


@pytest.mark.parametrize("profile", PROFILES)
def test_loads_with_every_bucket(profile):
    costs = load_costs(profile=profile)
    assert costs.profile == profile
    assert costs.sha256 == hashlib.sha256(DEFAULT_PATH.read_bytes()).hexdigest()
    costs.check_talker_buckets(BUCKETS)
    for b in BUCKETS:
        assert costs.talker_step_ms(b, 1) > 0


def test_talker_measured_points_exact():
    ee = load_costs(profile="ee9c553")
    for profile, file in STEPS.items():
        costs, steps = load_costs(profile=profile), _result(file)["talker"]["steps"]
        for b in (1, 8, 64, 256, 512, 1024):
            for k in (1, 4, 8):
                assert costs.talker_step_ms(b, k) == steps[f"B={b}"][f"K={k}"]["median_ms"]
    wall = _result(build_costs.BARRIER)["fused_step_wall_ms"]
    for b in (1, 8, 64, 256):
        for k in (1, 8):
            assert ee.talker_step_ms(b, k) == wall[f"B={b}"][f"K{k}"]


@pytest.mark.parametrize("profile", PROFILES)
def test_talker_between_neighbours(profile):
    costs = load_costs(profile=profile)
    for b in BUCKETS:
        for k in range(2, 8):
            step = costs.talker_step_ms
            assert step(b, k - 1) < step(b, k) < step(b, k + 1)
        assert costs.talker_step_ms(b, 9) > costs.talker_step_ms(b, 8)  # extrapolated past K=8
    for lo, b, hi in ((1, 2, 8), (1, 4, 8), (8, 16, 64), (8, 32, 64), (64, 128, 256)):
        for k in (1, 8):
            assert costs.talker_step_ms(lo, k) <= costs.talker_step_ms(b, k) <= costs.talker_step_ms(hi, k)


def test_estimated_entries_name_a_rule_and_respect_the_floor(doc):
    rules = doc["rules"]
    measured = {"talker_step_db1c4a9": {1, 8, 64, 256, 512, 1024}, "talker_step_ee9c553": {1, 8, 64, 256},
                "talker_step_b7f9a75": {1, 8, 64, 256, 512, 1024}}
    for name, table in ((n, doc["tables"][n]) for n in TALKER.values()):
        for b, entry in table["buckets"].items():
            assert ("estimated" in entry) == (int(b) not in measured[name]), (name, b)
            assert entry.get("estimated", "rows_linear") in rules
            floor = table["floor_ms_per_frame"][b]
            assert ("estimated" in floor) == (int(b) not in {1, 8, 64, 256})
            for k, ms in entry["k"].items():
                assert ms >= int(k) * floor["ms"], (name, b, k)
    assert doc["tables"]["copy"]["estimated"] in rules
    for name in ("prefill_eager", "codec_free", "codec_deterministic", "sharing", "prefill_eager_b7f9a75",
                 "codec_deterministic_b7f9a75", "sharing_b7f9a75"):
        assert doc["tables"][name]["source"] and "estimated" not in doc["tables"][name]


@pytest.mark.parametrize("profile", sorted(PREFILLS))
def test_prefill_measured_points_and_between(profile):
    costs = load_costs(profile=profile)
    calls = _result(PREFILLS[profile])["prefill"]
    launch = calls["prompts=1,tokens=32"]["median_ms"]  # no eager call takes less than its launch
    for r in (1, 8, 64):
        for t in (32, 128, 512):
            assert costs.prefill_ms(r, t) == max(launch, calls[f"prompts={r},tokens={t}"]["median_ms"])
    launch = calls["prompts=1,tokens=32"]["median_ms"]
    corners = [calls[f"prompts={r},tokens={t}"]["median_ms"] for r in (8, 64) for t in (32, 128)]
    assert min(corners) <= costs.prefill_ms(20, 64) <= max(corners)
    assert costs.prefill_ms(1, 1) == launch  # tokens below 32 clamp
    assert costs.prefill_ms(128, 512) > costs.prefill_ms(64, 512)  # rows extrapolated
    assert costs.prefill_ms(64, 1024) > costs.prefill_ms(64, 512)  # tokens extrapolated
    assert costs.prefill_host_ms(64, 512) == launch
    with pytest.raises(ValueError):
        costs.prefill_ms(0, 32)


@pytest.mark.parametrize("profile", PROFILES)
def test_codec_measured_points_and_between(profile):
    costs = load_costs(profile=profile)
    calls = _result(CODEC[profile])["codec"]["calls"]
    smallest = calls["B=1,T=1"]["eager"]["median_ms"]
    for key, call in calls.items():
        b, t = (int(part.split("=")[1]) for part in key.split(","))
        assert costs.codec_ms(b, t, graph=True) == call["graph"]["median_ms"]
        assert costs.codec_ms(b, t, graph=False) == max(smallest, call["eager"]["median_ms"])
    graph = {b: calls[f"B={b},T=8"]["graph"]["median_ms"] for b in (2, 4)}
    assert costs.codec_ms(3, 8, graph=True) == graph[4]  # padded to its bucket
    eager = [calls[f"B={b},T={t}"]["eager"]["median_ms"] for b in (256, 512) for t in (8, 16)]
    assert min(eager) <= costs.codec_ms(300, 12, graph=False) <= max(eager)
    assert costs.codec_ms(1024, 16, graph=False) > costs.codec_ms(512, 16, graph=False)
    assert costs.codec_host_ms(512, 16, graph=False) == smallest
    assert 0 < costs.codec_host_ms(512, 16, graph=True) < smallest


def test_codec_graph_outside_the_measured_shapes():
    costs = load_costs()
    with pytest.raises(CostFileError, match="T=3"):
        costs.codec_ms(1, 3, graph=True)
    with pytest.raises(CostFileError, match="B=1024"):
        costs.codec_ms(1024, 8, graph=True)


@pytest.mark.parametrize("profile, file", [("tip", build_costs.VERIFY_OVERLAP),
                                           ("db1c4a9", build_costs.OVERLAP)])
def test_copy_and_sharing(profile, file):
    costs = load_costs(profile=profile)
    assert costs.d2h_ms(0) == build_costs.COPY_LATENCY_MS
    assert math.isclose(costs.d2h_ms(25_000_000) - costs.d2h_ms(0), 1.0)  # 25 MB at 25 GB/s
    overlap = _result(file)
    for mps, mode in ((False, "mps_off"), (True, "mps_on")):
        measured = overlap[mode]["slowdown"]
        assert costs.slowdown(mps) == (measured["talker"], measured["codec"])


def test_missing_bucket(tmp_path, doc):
    bad = copy.deepcopy(doc)
    del bad["tables"]["talker_step_ee9c553"]["buckets"]["512"]
    _refused(tmp_path, bad, "tables.talker_step_ee9c553.buckets", "512")
    del bad["tables"]["talker_step_ee9c553"]["floor_ms_per_frame"]["512"]
    costs = load_costs(_write(tmp_path, bad), profile="ee9c553")
    with pytest.raises(CostFileError, match="no bucket 512"):
        costs.talker_step_ms(512, 1)
    with pytest.raises(CostFileError, match="no bucket 512"):
        costs.check_talker_buckets([1, 2, 512, 1024])
    load_costs(_write(tmp_path, bad), profile="tip").check_talker_buckets(BUCKETS)


@pytest.mark.parametrize("value", [-1.0, 0, float("inf"), "5"])
def test_bad_cost(tmp_path, doc, value):
    bad = copy.deepcopy(doc)
    bad["tables"]["prefill_eager"]["rows"]["8"]["tokens"]["128"] = value
    _refused(tmp_path, bad, "tables.prefill_eager.rows.8.tokens.128")


@pytest.mark.parametrize("where", ["top", "table", "profile", "entry", "floor"])
def test_unknown_key(tmp_path, doc, where):
    bad = copy.deepcopy(doc)
    holder = {"top": bad, "table": bad["tables"]["copy"], "profile": bad["profiles"]["tip"],
              "entry": bad["tables"]["talker_step_db1c4a9"]["buckets"]["2"],
              "floor": bad["tables"]["talker_step_db1c4a9"]["floor_ms_per_frame"]["2"]}[where]
    holder["bogus"] = 1
    _refused(tmp_path, bad, "bogus")


def test_profiles(tmp_path, doc):
    with pytest.raises(CostFileError, match="nope"):
        load_costs(profile="nope")
    bad = copy.deepcopy(doc)
    bad["profiles"]["old"] = bad["profiles"]["tip"]
    _refused(tmp_path, bad, "old")
    bad = copy.deepcopy(doc)
    bad["profiles"]["tip"]["codec"] = "codec_missing"
    _refused(tmp_path, bad, "profiles.tip.codec", "codec_missing")


def test_bad_shapes(tmp_path, doc):
    cases = []
    bad = copy.deepcopy(doc)
    del bad["tables"]["codec_free"]["batches"]["8"]["frames"]["4"]
    cases.append((bad, ("tables.codec_free.batches", "4")))
    bad = copy.deepcopy(doc)
    del bad["tables"]["prefill_eager"]["rows"]["64"]["tokens"]["512"]
    cases.append((bad, ("tables.prefill_eager.rows", "512")))
    bad = copy.deepcopy(doc)
    bad["tables"]["talker_step_db1c4a9"]["buckets"]["2"] = {"estimated": "rows_linear"}
    cases.append((bad, ("tables.talker_step_db1c4a9.buckets.2", "'k'")))
    bad = copy.deepcopy(doc)
    table = bad["tables"]["talker_step_db1c4a9"]
    for part in ("buckets", "floor_ms_per_frame"):
        table[part]["3"] = table[part].pop("2")
    cases.append((bad, ("buckets.3", "power of two")))
    bad = copy.deepcopy(doc)
    bad["tables"]["talker_step_db1c4a9"]["buckets"]["2"]["estimated"] = "a_guess"
    cases.append((bad, ("buckets.2.estimated", "a_guess")))
    bad = copy.deepcopy(doc)
    bad["tables"]["talker_step_db1c4a9"]["buckets"]["1"]["k"]["1"] = 1.0
    cases.append((bad, ("buckets.1.k.1", "floor")))
    bad = copy.deepcopy(doc)
    bad["format"] = 2
    cases.append((bad, ("format",)))
    for bad, fragments in cases:
        _refused(tmp_path, bad, *fragments)


def _results_copy(tmp_path):
    for file in build_costs.COMMITS:
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / file, tmp_path / file)
    return tmp_path


def test_builder_stops_on_a_failed_cross_check(tmp_path):
    root = _results_copy(tmp_path)
    l2 = json.loads((root / build_costs.L2_PREFETCH).read_text())
    stage = next(s for s in l2["stages"] if s["stage"] == build_costs.CROSS_CHECK_STAGE)
    stage["per_bucket"]["B=64"]["device_ms_per_frame"] *= 1.2
    (root / build_costs.L2_PREFETCH).write_text(json.dumps(l2))
    with pytest.raises(build_costs.BuildError, match="B=64"):
        build_costs.build(root)


def test_builder_stops_on_another_commit(tmp_path):
    root = _results_copy(tmp_path)
    overlap = json.loads((root / build_costs.OVERLAP).read_text())
    overlap["commit"] = "0000000"
    (root / build_costs.OVERLAP).write_text(json.dumps(overlap))
    with pytest.raises(build_costs.BuildError, match="0000000"):
        build_costs.build(root)


def test_builder_raises_estimates_to_the_floor():
    floor = {str(b): {"ms": 2.0} for b in BUCKETS}
    estimated = {b: ({1: 1.0, 8: 20.0}, "rows_linear") for b in BUCKETS}
    table = build_costs._talker_table({}, estimated, floor, [])
    assert table["buckets"]["4"] == {"k": {"1": 2.0, "8": 20.0}, "estimated": "rows_linear",
                                     "raised_to_floor": True}
    with pytest.raises(build_costs.BuildError, match="below"):
        build_costs._talker_table({b: {1: 1.0} for b in BUCKETS}, {}, floor, [])


def test_graphed_prefill_rule_from_the_committed_files(doc):
    costs = load_costs(profile="db1c4a9")
    table = doc["tables"]["prefill_graphed"]
    assert table["estimated"] == "graphed_prefill" and "graphed_prefill" in doc["rules"]
    rows, tokens = build_costs.PREFILL_COMPUTE_SHAPE
    largest = _result(build_costs.PREFILL)["prefill"][f"prompts={rows},tokens={tokens}"]["median_ms"]
    bandwidth = _result(build_costs.BARRIER)["copy_bandwidth_TBps"]
    per_token, weights = round(largest / (rows * tokens), 4), round(build_costs.backbone_params() * 2 / (
        bandwidth * 1e12) * 1e3, 4)
    assert (table["ms_per_token"], table["weight_floor_ms"]) == (per_token, weights)
    assert 0.9e9 < build_costs.backbone_params() < 1.1e9   # csm-1b: a 1 B backbone
    assert costs.prefill_graphed_ms(1, 1) == weights       # a short prompt reads the weights once
    assert costs.prefill_graphed_ms(64, 512) == pytest.approx(per_token * 64 * 512)
    assert costs.prefill_graphed_ms(1, 110) < costs.prefill_ms(1, 110)   # far below the eager launch
    with pytest.raises(ValueError, match="rows >= 1"):
        costs.prefill_graphed_ms(0, 10)


def test_graphed_prefill_measured_on_the_h200(doc, tmp_path):
    """The tip's graphed prefill: the verification run's one-prompt call is its floor, its 8-prompt
    call (bucket (8, 128)) gives the time per position."""
    costs = load_costs(profile="tip")
    table = doc["tables"]["prefill_graphed_b7f9a75"]
    assert table["estimated"] == "graphed_prefill_measured" and "graphed_prefill_measured" in doc["rules"]
    calls = _result(build_costs.VERIFY_COSTS)["prefill_graphs"]["calls"]
    one, eight = (calls[f"prompts={n}"]["through_runner"]["median_ms"] for n in (1, 8))
    assert costs.prefill_graphed_ms(1, 110) == one
    assert costs.prefill_graphed_ms(8, 128) == pytest.approx(eight, abs=0.05)
    assert costs.prefill_graphed_ms(64, 512) == pytest.approx(64 * 512 * eight / 1024, rel=0.01)
    wrong = copy.deepcopy(_result(build_costs.VERIFY_COSTS))
    wrong["prefill_graphs"]["calls"]["prompts=8"]["graph_bucket"] = [8, 256]
    with pytest.raises(build_costs.BuildError, match="buckets"):
        build_costs.prefill_graphed_measured(_tree_with(tmp_path, build_costs.VERIFY_COSTS, wrong))


def _tree_with(root, file: str, content: dict):
    """A result tree for the builder holding only ``file``, as ``content``."""
    (root / file).parent.mkdir(parents=True)
    (root / file).write_text(json.dumps(content))
    return root


def test_a_bursts_prefill_floor_bounds_every_packing():
    costs = load_costs(profile="tip")
    lengths = [30, 100, 100, 257, 64, 12, 180, 75]
    floor = costs.prefill_burst_floor_ms(lengths)
    assert floor == max(costs.prefill_graphed_ms(1, 1), costs.prefill_graphed_ms(1, sum(lengths)))
    one_call = costs.prefill_graphed_ms(len(lengths), max(lengths))
    one_each = sum(costs.prefill_graphed_ms(1, n) for n in lengths)
    assert floor <= one_call and floor <= one_each
    assert costs.prefill_burst_floor_ms([5]) == costs.prefill_graphed_ms(1, 1)
    for bad in ([], [0, 3]):
        with pytest.raises(ValueError, match="lengths"):
            costs.prefill_burst_floor_ms(bad)


def test_a_file_without_the_graphed_prefill_is_refused(tmp_path, doc):
    bad = copy.deepcopy(doc)
    del bad["tables"]["prefill_graphed"]["weight_floor_ms"]
    _refused(tmp_path, bad, "tables.prefill_graphed", "weight_floor_ms")
    bad = copy.deepcopy(doc)
    del bad["profiles"]["tip"]["prefill_graphed"]
    _refused(tmp_path, bad, "profiles.tip", "prefill_graphed")
