"""bench.server's ``--load``: what each load makes of the command line, the stage configs
and the fingerprint, the load generator config of each tier and its time cap, and how the
report names the load (pure functions; the smoke e2e test runs a poisson load)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.server import load, report, settings
from voxring import loads
from voxring.loadgen import schedule


def _settings(*args: str) -> settings.Settings:
    return settings.parse_args(["--tiers", "1,8", *args])


def test_the_load_names_the_mode_and_the_audio_range():
    fixed, poisson = _settings(), _settings("--load", "poisson")
    assert (fixed.mode, fixed.load, fixed.audio_seconds, fixed.audio_range) == ("mps-off", "fixed", 4.0, None)
    assert (poisson.mode, poisson.audio_range, poisson.audio_seconds) == ("mps-off-poisson", (1.0, 10.0), 5.5)
    assert poisson.max_audio_seconds == 10.0
    smoke = _settings("--smoke", "--load", "burst", "--layout", "two-pairs")
    assert (smoke.mode, smoke.audio_range) == ("two-pairs-smoke-burst", (0.4, 1.2))
    ranged = _settings("--load", "poisson", "--audio-seconds", "2,3", "--load-seed", "5")
    assert (ranged.audio_range, ranged.load_seed) == ((2.0, 3.0), 5)


@pytest.mark.parametrize("args", [["--audio-seconds", "1,3"], ["--load", "poisson", "--audio-seconds", "3,1"],
                                  ["--load", "steady"]])
def test_bad_load_options_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        _settings(*args)
    assert exit_.value.code == 2
    assert ("--audio-seconds" if "--audio-seconds" in args else "--load") in capsys.readouterr().err


def test_configs_fit_the_longest_text_and_length(tmp_path: Path):
    s = _settings("--load", "poisson", "--audio-seconds", "1,10")
    configs = settings.stage_configs(s, tmp_path, None)
    assert configs["gateway"]["limits"] == {"max_audio_seconds": 10.0, "default_audio_seconds": 5.5}
    # any corpus prompt (byte-level tokens + the speaker tag and specials) and 10 s of frames fit
    assert configs["talker"]["engine"]["max_len"] >= loads.MAX_TEXT_CHARS + 16 + 125
    fixed = settings.stage_configs(_settings(), tmp_path, None)
    assert fixed["gateway"]["limits"] == {"max_audio_seconds": 4.0, "default_audio_seconds": 4.0}
    assert fixed["talker"]["engine"]["max_len"] == 256  # the fixed load's configs as they were


def test_the_fingerprint_tells_loads_and_seeds_apart(tmp_path: Path):
    def fp(*args):
        s = _settings(*args)
        return settings.fingerprint(settings.stage_configs(s, tmp_path, None), s, None)

    prints = [fp(), fp("--load", "poisson"), fp("--load", "burst"),
              fp("--load", "poisson", "--load-seed", "1"), fp("--load", "poisson", "--audio-seconds", "1,9")]
    assert len(set(prints)) == len(prints)
    assert fp("--load", "poisson") == fp("--load", "poisson")


def test_each_tier_gets_its_load_and_its_own_texts():
    poisson = _settings("--load", "poisson", "--requests-per-stream", "2")
    c1, c8 = (load.tier_config(poisson, "unix:gw", c, 60.0) for c in (1, 8))
    assert (c8.load, c8.num_requests, c8.concurrency, c8.audio_seconds) == ("poisson", 16, 8, (1.0, 10.0))
    assert (c8.request_timeout_s, c8.max_total_s) == (60.0, 60.0)
    assert {a.text for a in schedule(c1)}.isdisjoint(a.text for a in schedule(c8))
    burst = load.tier_config(_settings("--load", "burst"), "unix:gw", 8, 60.0)
    assert (burst.load, burst.num_requests, burst.concurrency) == ("burst", 8, 8)
    fixed = load.tier_config(_settings(), "unix:gw", 8, 60.0)
    assert (fixed.load, fixed.num_requests, fixed.text) == ("closed", 24, settings.PROMPT)
    smoke = load.tier_config(_settings("--smoke"), "unix:gw", 2, 60.0)
    assert smoke.num_requests == 2  # the fixed smoke's 2 requests a tier, as before
    warm = load.warmup_configs(poisson, "unix:gw", 30.0)
    assert [(c.load, c.num_requests) for c in warm] == [("closed", 2), ("closed", 16), ("closed", 32),
                                                        ("burst", load.WARMUP_BURST)]
    assert [c.load for c in load.warmup_configs(_settings(), "unix:gw", 30.0)] == ["closed"] * 3


def test_a_poisson_tier_cap_fits_its_schedule():
    s = _settings("--load", "poisson", "--tier-max-s", "5")
    config = load.tier_config(s, "unix:gw", 8, 5.0)
    span = loads.schedule_span_s(schedule(config))
    assert span > 5  # 24 arrivals at 8 / 5.5 s: the 5 s cap cannot hold them
    assert load.wanted_cap_s(s, 8) == pytest.approx(span + 10.0)
    assert load.wanted_cap_s(_settings("--tier-max-s", "5"), 8) == 5.0  # fixed: the cap as given
    roomy = _settings("--load", "poisson", "--tier-max-s", "900")
    assert load.wanted_cap_s(roomy, 8) == 900.0


def _tier(**extra) -> dict:
    return {"concurrency": 8, "admitted": 8, "rejected": 0, "errors": {},
            "ttfa_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "gap_p99_ms": 4.0, "underruns": 0,
            "audio_s_per_s": 8.0, "rtf": 0.5, "clean": True, "status": "done", **extra}


def test_the_report_says_which_load_each_table_is():
    fixed = {"mode": "mps-off", "requests_per_stream": 3, "audio_seconds": 4.0, "tiers": {"8": _tier()}}
    poisson = {"mode": "mps-off-poisson", "load": "poisson", "requests_per_stream": 3, "audio_seconds": 5.5,
               "audio_range": [1.0, 10.0], "load_seed": 0,
               "tiers": {"8": _tier(load="poisson", mean_in_flight=6.25, max_in_flight=13,
                                    requested_audio_s=130.5, delivered_audio_s=131.0)}}
    text = "\n".join(report.run_table("mps-off", fixed))
    assert "Load: fixed, 3 x C requests per tier of 4.0 s audio each" in text
    assert "in flight" not in text
    text = "\n".join(report.run_table("mps-off-poisson", poisson))
    assert "Load: poisson, 3 x C requests per tier in an open loop at C / 5.5 s" in text
    assert "audio 1.0-10.0 s each" in text
    assert text.splitlines()[4].endswith("| in flight mean / peak | audio-s asked / delivered |")
    assert "| yes | 6.25 / 13 | 130.5 / 131.0 |" in text
    burst = {**poisson, "load": "burst"}
    assert "Load: burst, C requests at once per tier" in report.load_text("mps-off-burst", burst)
