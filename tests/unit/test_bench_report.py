"""The server bench's talker table: the step split and what limited K, from the talker's counters."""

from bench.server.gateway_numbers import first_chunk_relay, refusal_times, start_ms
from bench.server.probes import k_bounds, prefill_cost, prefill_grant
from bench.server.snapshots import Snapshot, gc_pauses, scrape, share_over
from bench.server.tier_tables import code2wav_table, prefill_cost_table, refusal_table, step_split_table
from services.talker.pacing import BOUNDS


def _gateway(at: float, metrics: dict[str, float]) -> Snapshot:
    """A snapshot holding only the gateway's metrics, at ``at``."""
    return Snapshot(at, {}, {"gateway": metrics}, {}, [], [], {})


def _snap(at: float, counts: dict[str, float]) -> Snapshot:
    metrics = {f"voxring_steps_k_bound_{bound}_total": n for bound, n in counts.items()}
    return Snapshot(at, {}, {"talker-0": metrics}, {}, [], [], {})


def test_k_bound_shares_are_the_tiers_steps_per_bound_and_the_table_shows_them():
    before = _snap(0.0, dict.fromkeys(BOUNDS, 5.0))
    after = _snap(1.0, {**dict.fromkeys(BOUNDS, 5.0), "arrivals": 65.0, "slack": 45.0})
    shares = k_bounds(before, after, "talker-0", 100)
    assert shares == {**dict.fromkeys(BOUNDS, 0.0), "slack": 0.4, "arrivals": 0.6}
    older = ("k_max", "slack", "first_audio", "waiting", "arrivals", "unmeasured")  # no "behind" yet
    assert k_bounds(_snap(0.0, dict.fromkeys(older, 5.0)), _snap(1.0, dict.fromkeys(older, 15.0)),
                    "talker-0", 60) == dict.fromkeys(older, round(10 / 60, 3))
    assert k_bounds(before, _snap(1.0, {}), "talker-0", 100) is None  # a talker without the counters
    talker = {"step_ms": 24.0, "mean_k": 2.75, "k_bound_share": shares,
              "step_split_ms": {"schedule": 0.1, "prefill": 0.3, "decode": 0.6, "emit": 0.2, "other": 22.8}}
    table = step_split_table({"64": {"talker": talker}})
    assert "K limited by" in table[2] and table[-2].endswith("| arrivals 60%, slack 40% |")


def test_the_prefill_grant_is_per_step_that_prompts_waited():
    def snap(at, steps, granted, prefilled):
        metrics = {"voxring_prefill_grant_steps_total": steps, "voxring_prefill_tokens_total": prefilled,
                   "voxring_prefill_granted_positions_total": granted}
        return Snapshot(at, {}, {"talker-0": metrics}, {}, [], [], {})

    grant = prefill_grant(snap(0.0, 10, 4000, 900), snap(1.0, 30, 6000, 1900), "talker-0")
    assert grant == {"steps": 20, "positions_per_step": 100.0, "prefilled_per_step": 50.0}
    assert prefill_grant(snap(0.0, 10, 4000, 900), snap(1.0, 10, 4000, 900), "talker-0") is None
    assert prefill_grant(_snap(0.0, {}), _snap(1.0, {}), "talker-0") is None  # an older talker


def test_prefill_cost_is_the_steps_with_prefill_against_the_others_and_the_calls():
    def snap(at, steps, with_n, with_s, without_s, prefills, calls, padded, tokens):
        metrics = {"voxring_steps_total": steps, "voxring_steps_with_prefill_total": with_n,
                   "voxring_steps_with_prefill_seconds_total": with_s,
                   "voxring_steps_without_prefill_seconds_total": without_s,
                   "voxring_prefill_steps_total": prefills, "voxring_prefill_calls_total": calls,
                   "voxring_prefill_padded_positions_total": padded, "voxring_prefill_tokens_total": tokens}
        return Snapshot(at, {}, {"talker-0": metrics}, {}, [], [], {})

    before = snap(0.0, 100, 20, 1.0, 2.0, 25, 60, 5000, 4000)
    # 100 more steps, 60 of them after a prefill (4.8 s: 80 ms each), 40 without (1.2 s: 30 ms each);
    # 62 prefills in 93 calls, 30,000 positions run for 24,000 prompt positions
    after = snap(1.0, 200, 80, 5.8, 3.2, 87, 153, 35000, 28000)
    cost = prefill_cost(before, after, "talker-0")
    assert cost == {"share_with_prefill": 0.6, "step_ms_with_prefill": 80.0, "step_ms_without_prefill": 30.0,
                    "calls_per_prefill": 1.5, "padded_per_real": 1.25}
    assert prefill_cost(before, before, "talker-0") is None  # no step in the tier
    assert prefill_cost(_snap(0.0, {}), _snap(1.0, {}), "talker-0") is None  # an older talker
    table = prefill_cost_table({"1024": {"talker": {"prefill_cost": cost}}})
    assert table[-2] == "| 1024 | 60% | 80.0 / 30.0 | 1.50 | 1.25 |"
    assert prefill_cost_table({"1": {"talker": {}}}) == []


def test_the_gateways_open_and_submit_are_means_over_the_tier():
    def snap(at, opens, open_s, submits, submit_s):
        metrics = {"voxring_start_opens_total": opens, "voxring_start_open_seconds_total": open_s,
                   "voxring_start_submits_total": submits, "voxring_start_submit_seconds_total": submit_s}
        return _gateway(at, metrics)

    assert start_ms(snap(0.0, 10, 0.1, 8, 0.05), snap(1.0, 30, 0.9, 28, 0.25)) == {
        "open_ms_mean": 40.0, "submit_ms_mean": 10.0}
    assert start_ms(snap(0.0, 10, 0.1, 8, 0.05), snap(1.0, 10, 0.1, 8, 0.05)) == {}  # none in the tier
    empty = _gateway(0.0, {})
    assert start_ms(empty, empty) == {}  # an older gateway


def test_the_first_chunks_relay_is_a_mean_over_the_tier_with_its_tail():
    def snap(at, n, seconds, within_10ms, within_30ms):
        metrics = {"voxring_first_chunk_relay_seconds_count": n,
                   "voxring_first_chunk_relay_seconds_sum": seconds,
                   "voxring_first_chunk_relay_seconds_bucket@0.01": within_10ms,
                   "voxring_first_chunk_relay_seconds_bucket@0.03": within_30ms}
        return _gateway(at, metrics)

    got = first_chunk_relay(snap(0.0, 10, 0.1, 10, 10), snap(1.0, 110, 2.1, 60, 90))
    assert got == {"relay_ms_mean": 20.0, "relay_over_10ms": 0.5, "relay_over_30ms": 0.2}
    assert first_chunk_relay(snap(0.0, 10, 0.1, 10, 10), snap(1.0, 10, 0.1, 10, 10)) == {}  # none
    older = _gateway(0.0, {})
    assert first_chunk_relay(older, older) == {}  # a gateway without the histogram


def test_the_refusal_table_says_how_fast_and_why_each_tier_refused():
    loadgen = {"rejected": 3, "refusal_s": {"p50": 0.004, "p90": 0.006, "p99": 0.0071},
               "refusals": {"about # s before it could start (a|b)": 2, "# streams already use": 1}}
    gateway = {"refusals_held": 2.0, "loop_lag_over_25ms": 0.0125, "loop_lag_over_50ms": 0.0,
               "refusals_here": 2, "refusal_here_over_50ms": 0.0, "refusals_stages": 1,
               "refusal_stages_over_50ms": 1.0}
    collections = {"gateway": {"pauses": 40, "over_25ms": 1, "seconds": 0.2, "full": 2}}
    table = refusal_table({"64": {"loadgen": loadgen, "gateway": gateway, "gc": collections},
                           "8": {"loadgen": {**loadgen, "rejected": 1}},  # an older gateway: no count
                           "1": {"loadgen": {"rejected": 0}}})
    assert table[2] == ("| C | refused | p50 / p99 ms | held at the gateway | > 50 ms in the gateway: held / "
                        "by a stage | gateway loop late > 25 / 50 ms | messages |")
    assert table[4].startswith("| 8 | 1 | 4.0 / 7.1 | - | - / - | - / - | ")
    assert table[5] == ("| 64 | 3 | 4.0 / 7.1 | 2 | 0.0% of 2 / 100.0% of 1 | 1.2% / 0.0% (1 GC > 25 ms) | "
                        "2 x about # s before it could start (a/b); 1 x # streams already use |")
    assert refusal_table({"1": {"loadgen": {"rejected": 0}}}) == []


def test_refusal_times_split_the_gateways_refusals_by_who_answered_and_read_their_tail():
    def snap(at, here, here_fast, stages, stages_fast):
        metrics = {"voxring_refusal_here_seconds_count": here,
                   "voxring_refusal_here_seconds_bucket@0.05": here_fast,
                   "voxring_refusal_stages_seconds_count": stages,
                   "voxring_refusal_stages_seconds_bucket@0.05": stages_fast}
        return _gateway(at, metrics)

    got = refusal_times(snap(0.0, 10, 10, 4, 4), snap(1.0, 110, 109, 14, 9))
    assert got == {"refusals_here": 100, "refusal_here_over_50ms": 0.01,
                   "refusals_stages": 10, "refusal_stages_over_50ms": 0.5}
    none = refusal_times(snap(0.0, 10, 10, 4, 4), snap(1.0, 10, 10, 4, 4))
    assert none == {"refusals_here": 0, "refusal_here_over_50ms": None, "refusals_stages": 0,
                    "refusal_stages_over_50ms": None}
    older = _gateway(0.0, {})
    assert refusal_times(older, older) == {}  # a gateway without the histograms


def test_the_code2wav_table_shows_its_calls_tick_cuts_and_where_stalls_were_made():
    cw = {"decode_ms_per_call": 47.25, "chunks_per_call": 94.9, "tick_ms_at_end": 41.2,
          "cuts": {"first": 2278.0, "need": 7541.0, "size": 4461.0, "end": 2473.0, "segment": 0.0},
          "modeled_underruns": 12.0, "urgent_ms_per_call": 20.5, "urgent_chunks_per_call": 30.1,
          "rest_ms_per_call": 60.25, "rest_chunks_per_call": 120.0, "first_chunk_wait_ms": 4.5,
          "first_chunk_ms": 25.0}
    tiers = {"1536": {"code2wav": cw, "gateway": {"modeled_underruns": 30.0}, "underruns": 41},
             "1": {"code2wav": {"decode_ms_per_call": 3.0}}}
    table = code2wav_table(tiers)
    assert table[-2] == ("| 1536 | 47.2 | 94.9 | 20.5 / 30.1 | 60.2 / 120.0 | 4.5 / 25.0 | 41.2 "
                         "| 2278 / 7541 / 4461 / 2473 | 12 / 30 / 41 |")
    assert len(table) == 6  # one row: a tier from before the cuts were counted has none
    del tiers["1536"]["gateway"]  # a result from before the gateway modeled its listeners
    for key in ("urgent_ms_per_call", "rest_ms_per_call", "first_chunk_wait_ms"):  # ... or split its calls
        del cw[key]
    assert code2wav_table(tiers)[-2].endswith("| - / 30.1 | - / 120.0 | - / 25.0 | 41.2 "
                                              "| 2278 / 7541 / 4461 / 2473 | 12 / - / 41 |")
    assert code2wav_table({"1": {"code2wav": None}}) == []


def test_scrape_keeps_histogram_buckets_and_share_over_reads_the_tail(monkeypatch):
    text = ("# HELP voxring_event_loop_lag_seconds lag\n"
            'voxring_event_loop_lag_seconds_bucket{le="0.025"} 95\n'
            'voxring_event_loop_lag_seconds_bucket{le="+Inf"} 100\n'
            "voxring_event_loop_lag_seconds_count 100\n"
            'voxring_requests_total{stage="gateway",code="OK"} 7\n'
            "voxring_steps_total 12\n")

    class Reply:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return text.encode()

    monkeypatch.setattr("urllib.request.urlopen", lambda url, timeout: Reply())
    got = scrape("127.0.0.1:1")
    assert got == {"voxring_event_loop_lag_seconds_bucket@0.025": 95.0,
                   "voxring_event_loop_lag_seconds_bucket@+Inf": 100.0,
                   "voxring_event_loop_lag_seconds_count": 100.0, "voxring_steps_total": 12.0}
    earlier = {"voxring_event_loop_lag_seconds_count": 40.0,
               "voxring_event_loop_lag_seconds_bucket@0.025": 40.0}
    before = Snapshot(0.0, {}, {"gateway": earlier}, {}, [], [], {})
    after = Snapshot(1.0, {}, {"gateway": got}, {}, [], [], {})
    assert share_over(before, after, "gateway", "event_loop_lag_seconds", "0.025") == round(1 - 55 / 60, 4)
    assert share_over(before, before, "gateway", "event_loop_lag_seconds", "0.025") is None  # no wakes


def test_gc_pauses_per_stage_over_the_tier():
    def snap(count, within, seconds, full):
        return {"voxring_gc_pause_seconds_count": count, "voxring_gc_pause_seconds_bucket@0.025": within,
                "voxring_gc_pause_seconds_sum": seconds, "voxring_gc_full_pause_seconds_count": full}

    before = Snapshot(0.0, {}, {"gateway": snap(10, 10, 0.01, 1), "talker": {}}, {}, [], [], {})
    after = Snapshot(1.0, {}, {"gateway": snap(50, 47, 0.31, 3), "talker": {}}, {}, [], [], {})
    assert gc_pauses(before, after) == {"gateway": {"pauses": 40, "over_25ms": 3, "seconds": 0.3, "full": 2}}


def test_two_gateways_numbers_are_their_totals_with_the_busiest_and_the_spread():
    from bench.server.gateway_numbers import gateway_numbers

    def metrics(n, seconds, lag_n):
        ttfa, lag = "voxring_time_to_first_audio_seconds", "voxring_event_loop_lag_seconds"
        return {f"{ttfa}_count": n, f"{ttfa}_sum": seconds, f"{lag}_count": lag_n,
                f"{lag}_sum": lag_n * 0.002,
                f"{lag}_bucket@0.025": lag_n, f"{lag}_bucket@0.05": lag_n}

    names = ["gateway", "gateway-1"]
    before = Snapshot(0.0, {}, {g: metrics(0, 0.0, 0) for g in names}, {"gateway": 1.0, "gateway-1": 2.0},
                      [], [], {}, names)
    after = Snapshot(2.0, {}, {"gateway": metrics(30, 3.0, 100), "gateway-1": metrics(10, 2.0, 100)},
                     {"gateway": 2.0, "gateway-1": 2.6}, [], [], {}, names)
    got = gateway_numbers(before, after, 2.0, 20, 100.0)
    assert got["server_ttfa_mean_ms"] == 125.0  # (3 + 2) s over 40 first audios
    assert got["loop_lag_mean_ms"] == 2.0 and got["loop_lag_over_25ms"] == 0.0
    assert (got["cpu_cores"], got["cpu_cores_max"], got["processes"]) == (0.8, 0.5, 2)
    assert got["cpu_ms_per_audio_s"] == 16.0 and got["cpu_cores_per_stream"] == 0.04
    assert got["first_audios_by_process"] == {"gateway": 30, "gateway-1": 10}
    one = Snapshot(0.0, {}, {"gateway": metrics(0, 0.0, 0)}, {"gateway": 1.0}, [], [], {})
    alone = gateway_numbers(one, Snapshot(2.0, {}, {"gateway": metrics(30, 3.0, 100)}, {"gateway": 2.0},
                                          [], [], {}), 2.0, 20, 100.0)
    assert "processes" not in alone and alone["cpu_cores"] == 0.5
