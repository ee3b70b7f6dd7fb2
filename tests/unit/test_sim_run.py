"""The simulator's harness on small tiers: every request ends, the frames the talker wrote
are the frames Code2Wav sent as audio, lanes' clocks never run backwards (the kernel raises),
and a request past the gateway's admission limit is refused as the real gateway refuses it.
Nothing here is a performance check: the numbers are virtual and not asserted."""

import json
import subprocess
import sys

import pytest

from bench.sim.run import RunSpec, run_tier, stage_config_objects


def _checked(record: dict, requests: int) -> dict:
    inv = record["invariants"]
    assert inv["requests_ended"] == requests
    assert inv["frames_in"] == inv["frames_out"] == inv["frames_asked_by_completed"] > 0
    assert record["completed"] == requests - record["rejected"]
    assert record["talker"]["steps"] > 0 and record["code2wav"]["chunks"] > 0
    return record


@pytest.mark.parametrize("concurrency", [1, 8])
def test_closed_loop_tiers_end_every_request(concurrency):
    spec = RunSpec(profile="ee9c553", load="fixed", tiers=(1, 8), requests_per_stream=2,
                   audio_seconds=(1.0, 1.0))
    record = _checked(run_tier(spec, concurrency), 2 * concurrency)
    assert record["rejected"] == 0 and not record["errors"]
    assert record["talker"]["frames"] == 2 * concurrency * 13  # 1 s at 12.5 frames/s, rounded up


def test_poisson_tier_on_todays_costs_ends_every_request():
    spec = RunSpec(profile="tip", load="poisson", tiers=(8,), requests_per_stream=2, audio_seconds=(0.5, 2.0))
    record = _checked(run_tier(spec, 8), 16)
    assert record["load"] == "poisson" and record["mean_in_flight"] > 0


def test_past_the_gateways_admission_limit_requests_are_refused():
    spec = RunSpec(load="burst", tiers=(8,), audio_seconds=(0.5, 1.0),
                   env={"VOXRING_GATEWAY__ADMISSION__MAX_IN_FLIGHT": "4"})
    record = _checked(run_tier(spec, 8), 8)
    assert record["rejected"] == 4 and record["admitted"] == 4 and not record["clean"]
    refusals = record["refusals"]
    assert (refusals["admitted"], refusals["refused"]) == (4, 4)
    latency = refusals["refusal_ms"]
    assert 0 < latency["p50"] <= latency["p99"] <= latency["max"] < record["ttfa_ms"]["p50"]
    burst = record["burst"]   # the floor of all 8 prompts, and of the 4 admitted the ratio uses
    assert burst["prompts"] == 8 and burst["admitted_prompts"] == 4
    assert burst["admitted_prefill_floor_ms"] <= burst["prefill_floor_ms"] and burst["one_step_ms"] > 0
    # the ratio is taken before its parts are rounded to 0.1 ms (a 10 ms floor + step moves it by 1%)
    assert burst["ttfa_p99_over_floor_step"] == pytest.approx(
        burst["ttfa_p99_ms"] / (burst["admitted_prefill_floor_ms"] + burst["one_step_ms"]), rel=0.02)


def test_refusal_latency_is_from_send_to_refusal():
    from bench.sim.report import refusals
    from voxring.loadgen import RequestTrace
    traces = [RequestTrace(sent_at_s=1.0, outcome="rejected", ended_at_s=1.0 + ms / 1e3) for ms in (2, 4, 10)]
    traces.append(RequestTrace(sent_at_s=0.0, outcome="ok", ended_at_s=5.0))
    out = refusals(traces)
    assert (out["admitted"], out["refused"]) == (1, 3)
    assert out["refusal_ms"]["p50"] == 4.0 and out["refusal_ms"]["max"] == 10.0
    assert refusals([])["refusal_ms"] == {"p50": None, "p99": None, "max": None}


def test_with_code2wav_free_its_process_uses_no_cpu_and_no_gpu():
    spec = RunSpec(load="poisson", tiers=(8,), requests_per_stream=2, audio_seconds=(0.5, 2.0),
                   free_code2wav=True)
    record = _checked(run_tier(spec, 8), 16)
    assert record["cpu_cores_busy"]["code2wav"] == 0 and record["gpu_busy"]["codec"] == 0
    assert record["cpu_cores_busy"]["talker"] > 0 and record["gpu_busy"]["talker"] > 0
    assert spec.describe()["free_code2wav"] is True


def test_past_the_talkers_queue_requests_are_refused_as_resource_exhausted():
    spec = RunSpec(load="burst", tiers=(8,), audio_seconds=(0.5, 1.0),
                   env={"VOXRING_TALKER__ENGINE__MAX_NUM_SEQS": "2",
                        "VOXRING_TALKER__ENGINE__MAX_WAITING": "2"})
    record = _checked(run_tier(spec, 8), 8)
    # at most 2 run and 2 wait at once; which of the rest find the queue full depends on when
    # the engine admits, as on the real talker: at least 4 are refused, and none fails otherwise
    assert 4 <= record["rejected"] < 8 and not record["errors"]


def test_engines_are_sized_for_the_top_tier_up_to_the_cost_files_largest_bucket():
    talker, code2wav, gateway = stage_config_objects(RunSpec(tiers=(1, 64, 2048)))
    assert talker.engine.max_num_seqs == 1024 and max(talker.engine.buckets) == 1024
    assert code2wav.engine.max_slots == 1024 and gateway.admission.max_in_flight == 1024


def test_a_bad_override_is_refused_naming_it():
    with pytest.raises(Exception, match="VOXRING_TALKER__ENGINE__K_MAX: must be >= 1"):
        stage_config_objects(RunSpec(tiers=(1,), env={"VOXRING_TALKER__ENGINE__K_MAX": "0"}))


def test_the_command_prints_the_table(tmp_path):
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "bench.sim", "--tiers", "1", "--load", "fixed",
                           "--requests-per-stream", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "| 1 | 1 / 0 |" in done.stdout and "simulator" in done.stdout
    assert out.exists()


def test_the_command_runs_code2wav_free_and_writes_the_acceptance(tmp_path):
    out, md = tmp_path / "sim.json", tmp_path / "sim.md"
    command = [sys.executable, "-m", "bench.sim", "--tiers", "1,8", "--load", "burst", "--free-code2wav",
               "--out", str(out), "--md", str(md)]
    subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    doc, text = json.loads(out.read_text()), md.read_text()
    assert doc["spec"]["free_code2wav"] is True and doc["tiers"]["8"]["burst"]["prompts"] == 8
    assert "Code2Wav free" in text and "TTFA p99 / (floor + step)" in text
    assert "| burst C=8: TTFA p99 within 1.5x (prefill floor + one step) |" in text
    assert "| mean K >= 4 at C=256 | - | not run |" in text


def test_the_command_refuses_bad_tiers():
    done = subprocess.run([sys.executable, "-m", "bench.sim", "--tiers", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--tiers" in done.stderr


def test_the_identity_check_is_bit_reproducible():
    from bench.sim import identity
    first, second = (identity.run(["calibration"], (8,)) for _ in range(2))
    assert first == second and first["calibration"]["8"]["invariants"]["requests_ended"] > 0
