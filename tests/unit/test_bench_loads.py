"""bench.server's ``--load``: what each load makes of the command line, the stage configs
and the fingerprint, the load generator config of each tier and its time cap, and how the
report names the load (pure functions; the smoke e2e test runs a poisson load)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.server import load, report, settings
from bench.server.args import parse_args
from voxring import loads
from voxring.loadgen import schedule


def _settings(*args: str) -> settings.Settings:
    return parse_args(["--tiers", "1,8", *args])


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
    c1, c8 = (load.tier_config(poisson, ("unix:gw",), c, 60.0) for c in (1, 8))
    assert (c8.load, c8.num_requests, c8.concurrency, c8.audio_seconds) == ("poisson", 16, 8, (1.0, 10.0))
    assert (c8.request_timeout_s, c8.max_total_s) == (60.0, 60.0)
    assert {a.text for a in schedule(c1)}.isdisjoint(a.text for a in schedule(c8))
    burst = load.tier_config(_settings("--load", "burst"), ("unix:gw",), 8, 60.0)
    assert (burst.load, burst.num_requests, burst.concurrency) == ("burst", 8, 8)
    fixed = load.tier_config(_settings(), ("unix:gw",), 8, 60.0)
    assert (fixed.load, fixed.num_requests, fixed.text) == ("closed", 24, settings.PROMPT)
    smoke = load.tier_config(_settings("--smoke"), ("unix:gw",), 2, 60.0)
    assert smoke.num_requests == 2  # the fixed smoke's 2 requests a tier, as before
    warm = load.warmup_configs(poisson, ("unix:gw",), 30.0)
    assert [(c.load, c.num_requests) for c in warm] == [("closed", 2), ("closed", 16), ("closed", 32),
                                                        ("burst", load.WARMUP_BURST)]
    assert [c.load for c in load.warmup_configs(_settings(), ("unix:gw",), 30.0)] == ["closed"] * 3


def test_a_poisson_tier_cap_fits_its_schedule():
    s = _settings("--load", "poisson", "--tier-max-s", "5")
    config = load.tier_config(s, ("unix:gw",), 8, 5.0)
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


# --- the sequential C=1 tier, the steady rate and the delivery checks ---------------------------

ACCEPTANCE = ("--load", "poisson", "--audio-seconds", "2,8", "--requests-per-stream", "2", "--load-seed", "0")


def test_c1_of_poisson_and_burst_is_sequential_with_idle_gaps():
    s = _settings(*ACCEPTANCE)
    c1 = load.tier_config(s, ("unix:gw",), 1, 60.0, 12.5)
    assert (c1.load, c1.num_requests, c1.concurrency) == ("sequential", 50, 1)
    assert (c1.idle_gaps_s, c1.frame_rate_hz, c1.audio_seconds) == ((0.0, 0.5, 2.0, 5.0), 12.5, (2.0, 8.0))
    arrivals = schedule(c1)
    assert [a.idle_before_s for a in arrivals[:5]] == [0.0, 0.5, 2.0, 5.0, 0.0]
    # the texts and lengths a Poisson C=1 tier of the seed would draw
    assert [(a.text, a.max_audio_seconds) for a in arrivals] == [
        (a.text, a.max_audio_seconds) for a in loads.poisson_schedule(50, 1, (2.0, 8.0), c1.load_seed)]
    assert load.tier_config(s, ("unix:gw",), 8, 60.0).load == "poisson"  # only C=1
    burst = load.tier_config(_settings("--load", "burst"), ("unix:gw",), 1, 60.0)
    assert (burst.load, burst.num_requests) == ("sequential", 50)
    assert load.tier_config(_settings(), ("unix:gw",), 1, 60.0).load == "closed"  # fixed: as it was
    mine = _settings("--load", "poisson", "--sequential-requests", "8", "--idle-gaps", "0,1")
    c1 = load.tier_config(mine, ("unix:gw",), 1, 60.0)
    assert (c1.num_requests, c1.idle_gaps_s) == (8, (0.0, 1.0)) and load.tier_requests(mine, 1) == 8
    smoke = load.tier_config(_settings("--smoke", "--load", "poisson"), ("unix:gw",), 1, 60.0)
    assert (smoke.num_requests, smoke.idle_gaps_s) == (settings.SMOKE_SEQUENTIAL_REQUESTS,
                                                       settings.SMOKE_IDLE_GAPS_S)


@pytest.mark.parametrize("args", [["--sequential-requests", "5"], ["--idle-gaps", "1"],
                                  ["--load", "poisson", "--sequential-requests", "0"],
                                  ["--load", "poisson", "--idle-gaps", "1,-1"]])
def test_bad_sequential_options_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        _settings(*args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--sequential-requests" in err or "--idle-gaps" in err


def test_the_sequential_tier_cap_holds_its_idle_gaps_and_every_request_in_turn():
    s = _settings(*ACCEPTANCE)
    arrivals = schedule(load.tier_config(s, ("unix:gw",), 1, 60.0))
    idle = sum(a.idle_before_s for a in arrivals)
    audio = sum(a.max_audio_seconds for a in arrivals)
    assert idle == pytest.approx(13 * 0 + 13 * 0.5 + 12 * 2 + 12 * 5)
    assert load.wanted_cap_s(s, 1) == pytest.approx(idle + audio + 8.0)  # and the longest again
    assert load.wanted_cap_s(s, 1) > idle + audio / 10 + 60  # far more than a GPU at 10x needs
    smoke = _settings("--smoke", "--load", "poisson")
    assert load.wanted_cap_s(smoke, 1) == smoke.tier_max_s  # 4 short requests fit the plain cap


def test_the_fingerprint_holds_the_sequential_tier(tmp_path: Path):
    def fp(*args):
        s = _settings(*args)
        return settings.fingerprint(settings.stage_configs(s, tmp_path, None), s, None)

    base = fp("--load", "poisson")
    assert base != fp("--load", "poisson", "--sequential-requests", "60")
    assert base != fp("--load", "poisson", "--idle-gaps", "0,1")
    assert base == fp("--load", "poisson", "--sequential-requests", "50", "--idle-gaps", "0,0.5,2,5")


def test_frame_rate_comes_from_the_served_checkpoint(tmp_path: Path):
    assert load.frame_rate_hz(_settings()) == settings.FRAME_RATE_HZ == 12.5
    (tmp_path / "config.json").write_text('{"codec_config": {"sampling_rate": 24000, '
                                          '"upsampling_ratios": [8, 5, 4, 2]}}')
    assert load.frame_rate_hz(_settings("--checkpoint", str(tmp_path))) == 24000 / 640
    (tmp_path / "config.json").write_text('{"codec_config": {"frame_rate": 25.0}}')
    assert load.frame_rate_hz(_settings("--checkpoint", str(tmp_path))) == 25.0
    (tmp_path / "config.json").write_text("{}")
    assert load.frame_rate_hz(_settings("--checkpoint", str(tmp_path))) == 12.5  # said nothing


def _report(*, samples_short: int = 0, asked: float = 2.8, reason: str = "length") -> dict:
    """A load generator report of two 35-frame requests (2.8 s) sent at 0 and 3 s, the second
    ``samples_short``."""
    from voxring.loadgen import BenchConfig, RequestTrace, summarize

    traces = [RequestTrace([(0.1, 2.4), (2.4, 2.8)], "ok", 2.8, asked, sent_at_s=at, ended_at_s=at + 2.4,
                           pcm_bytes=2 * (67200 - short), sample_rate_hz=24000, frames=35,
                           finish_reason=reason)
              for at, short in ((0.0, 0), (3.0, samples_short))]
    config = BenchConfig(target="unix:gw", num_requests=2, concurrency=2, load="poisson", frame_rate_hz=12.5)
    return summarize(config, traces, wall_s=6.0).to_dict()


def test_a_tier_is_clean_only_with_every_requests_samples_and_audio():
    from bench.server.tiers import tier_record

    s = _settings("--load", "poisson")

    def record(report):
        return tier_record(s, 2, 2, 60.0, False, report, {}, {})

    ok = record(_report())
    assert ok["clean"] and ok["sample_mismatches"] == 0 and ok["audio_shortfalls"] == 0
    # the window (2, 3] s (2 s after the first send, the last send): the first request's 0.4 s at 2.4 s
    assert ok["steady_audio_s_per_s"] == pytest.approx(0.4 / 1.0) and ok["steady_window_s"] == [2.0, 3.0]
    assert ok["finish_reasons"] == {"length": 2} and ok["frame_rate_hz"] == 12.5
    short = record(_report(samples_short=1))
    assert not short["clean"] and short["sample_mismatches"] == 1
    assert short["sample_mismatch_examples"] == [(67199, 67200)]
    capped_short = record(_report(asked=3.0))  # 2.8 s delivered for 3 s asked, on the length cap
    assert not capped_short["clean"] and capped_short["audio_shortfalls"] == 2
    stopped = record(_report(asked=3.0, reason="stop"))  # a stop frame ended them: allowed
    assert stopped["clean"] and stopped["early_stops"] == 2


def test_the_report_shows_the_steady_rate_the_checks_and_the_sequential_tier():
    c1 = _tier(concurrency=1, load="poisson", sequential=True, mean_in_flight=0.8, max_in_flight=1,
               requested_audio_s=250.0, delivered_audio_s=250.0, steady_audio_s_per_s=None,
               sample_mismatches=0, audio_shortfalls=0,
               ttfa_by_idle_ms={"0": {"requests": 13, "p50": 40.0, "p90": 45.0, "p99": 50.0},
                                "5": {"requests": 12, "p50": 60.0, "p90": 70.0, "p99": 80.0}})
    c8 = _tier(load="poisson", mean_in_flight=6.25, max_in_flight=13, requested_audio_s=130.5,
               delivered_audio_s=131.0, steady_audio_s_per_s=7.5, sample_mismatches=2, audio_shortfalls=1,
               clean=False, ttfa_by_second_ms=[[0, 3, 40.0, 50.0, 51.0], [1, 4, 45.0, 300.0, 310.0],
                                               [2, 2, 41.0, 60.0, 61.0], [3, 5, 42.0, 55.0, 56.0]])
    data = {"mode": "mps-off-poisson", "load": "poisson", "requests_per_stream": 2, "audio_seconds": 5.0,
            "audio_range": [2.0, 8.0], "load_seed": 0, "sequential_requests": 50,
            "idle_gaps": [0.0, 0.5, 2.0, 5.0], "tiers": {"1": c1, "8": c8}}
    text = "\n".join(report.run_table("mps-off-poisson", data))
    assert ("C=1 is sequential: 50 requests one at a time, each sent once the previous one ended, "
            "after an idle of 0, 0.5, 2, 5 s in turn") in text
    assert "| audio-s/s | steady audio-s/s | RTF |" in text and "| PCM mismatches / short | clean |" in text
    assert "| 8.0 | 7.5 | 0.500 |" in text and "| 2 / 1 | no |" in text
    assert "| 8.0 | - | 0.500 |" in text and "| 0 / 0 | yes |" in text
    # the tail by second: the p99s' spread, and the seconds of the highest p99 first
    assert ("| 8 | 4 | 50.0 / 60.0 / 300.0 | 1 (4) 45.0 / 300.0 / 310.0; 2 (2) 41.0 / 60.0 / 61.0; "
            "3 (5) 42.0 / 55.0 / 56.0 |") in text
    header, separator = text.splitlines()[4:6]
    assert header.count("|") == separator.count("|")
    assert "| 1 | 5 | 12 | 60.0 / 70.0 / 80.0 |" in text and "| 1 | 0 | 13 | 40.0 / 45.0 / 50.0 |" in text
    older = {key: value for key, value in data.items() if key not in ("sequential_requests", "idle_gaps")}
    assert "sequential" not in report.load_text("mps-off-poisson", older)  # files from before


def test_client_connections_reach_every_tier_the_fingerprint_and_the_report(tmp_path: Path, capsys):
    spread = _settings("--load", "poisson", "--client-connections", "4")
    assert spread.client_connections == 4 and _settings().client_connections == 1
    assert {load.tier_config(spread, ("unix:gw",), c, 60.0).connections for c in (1, 8)} == {4}
    assert load.tier_config(_settings("--client-connections", "2"), ("unix:gw",), 8, 60.0).connections == 2

    def fp(s):
        return settings.fingerprint(settings.stage_configs(s, tmp_path, None), s, None)

    assert fp(spread) != fp(_settings("--load", "poisson"))  # tiers of one are not reused for the other
    text = report.load_text("mps-off-poisson", {"load": "poisson", "audio_range": [2, 8], "load_seed": 0,
                                                "requests_per_stream": 2, "audio_seconds": 5.0,
                                                "client_connections": 4})
    assert "over 4 client connections" in text
    assert "client connections" not in report.load_text("mps-off-poisson", {"load": "poisson"})
    with pytest.raises(SystemExit):
        _settings("--client-connections", "0")
    assert "--client-connections" in capsys.readouterr().err
