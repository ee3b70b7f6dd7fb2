"""Faults and load on the real stack (short versions; `make soak` runs the long ones in
tests/soak/test_fault_soak.py): two engine pairs behind one gateway, real processes,
real rings, the tiny model on the CPU. The scenarios and what each asserts are in
tests/e2e/scenarios_faults.py and scenarios_load.py.

- kill -9 of a talker, of a Code2Wav, of the gateway, with streams in flight: who ends
  how and how fast, what the survivors free, what a restart re-attaches and sweeps;
- a storm of client cancels at random points, then nothing left (slots, streams,
  segments, fds);
- 2x overload of the gateway's admission limit: exact split, retry hint, bounded RSS;
- (the seeded random soak, whose RSS slope needs some 300 requests past Code2Wav's warm-up,
  runs only in `make soak`, tests/soak/test_fault_soak.py: half a minute of this suite's budget);
- SIGTERM of a gateway and of a talker under load: drain, refuse, exit 0.

Already covered elsewhere, with stand-ins or on one pair: a killed (fake) talker fails
Code2Wav's streams and a new one is attached (tests/integration/test_code2wav_service.py),
the sweep of a dead producer's ring (tests/integration/test_ring_processes.py), a dead
consumer's rows dropped and a talker's SIGTERM drain (tests/integration/
test_talker_service.py), one client cancel and one overload on one pair
(tests/e2e/test_synthesis_e2e.py), a gateway SIGTERM loop without engines
(tests/soak/test_restart_soak.py). Here every fault hits the whole stack.

One stack serves the module; each test starts by restarting whatever an earlier one
left dead. Each test prints what it measured (run with -s to see it).
"""

from __future__ import annotations

import pytest

from tests.e2e.scenarios_faults import (
    kill_code2wav,
    kill_gateway,
    kill_talker,
    sigterm_gateway,
    sigterm_talker,
)
from tests.e2e.scenarios_load import cancel_storm, format_leaks, overload_scenario
from tests.e2e.stack import healed, running_stack

# Overload: RSS may not grow more than this after the first round (MB). The first round
# meets most of the load's shapes (up to 4 rows per pair, chunks of 2-8 frames); RSS
# still grows in steps while a stage meets the remaining (batch, chunk) shapes: measured
# up to +9 MB in rounds 2-3 (Code2Wav), then flat for 40 rounds. The 3 short rounds can
# only catch gross growth (e.g. the buffers of an overloaded or rejected request kept);
# the soak's 20 rounds bound it per round.
OVERLOAD_RSS_MB = 24.0


def report(line: str) -> None:
    print(f"[faults] {line}")


@pytest.fixture(scope="module")
def stack(model_cache):
    with running_stack(model_cache, report) as st:
        yield st


@pytest.fixture
def fresh(stack):
    return healed(stack, report)


def test_kill9_talker(fresh):
    report(kill_talker(fresh))


def test_kill9_code2wav(fresh):
    report(kill_code2wav(fresh))


def test_kill9_gateway(fresh):
    report(kill_gateway(fresh))


def test_cancel_storm(fresh):
    result = cancel_storm(fresh, n=200, seed=20260101, concurrency=8, timeout=240)
    report(f"cancel storm: 200 requests in {result['wall_s']:.1f} s, outcomes {result['outcomes']}; "
           + format_leaks(result["leaks"]))


def test_overload_twice_the_admission_limit(fresh):
    report(overload_scenario(fresh, rounds=3, warm_rounds=1, rss_mb=OVERLOAD_RSS_MB))


def test_sigterm_gateway_under_load(fresh):
    report(sigterm_gateway(fresh))


def test_sigterm_talker_under_load(fresh):
    report(sigterm_talker(fresh))
