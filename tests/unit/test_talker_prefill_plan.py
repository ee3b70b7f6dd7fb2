"""The talker's prefill calls (services/talker/prefill_plan.py): every chunk in exactly one call,
each call in a captured bucket where one holds it, and the fewest calls plus padded positions by
a call's fixed cost, where grouping by graph length alone made a call for every length class."""

from __future__ import annotations

import random

import pytest

from services.common.buckets import plan
from services.talker.prefill_plan import CALL_POSITIONS, EAGER_POSITIONS, PrefillPlanner

ROWS, TOKENS = (1, 2, 4, 8, 16, 32, 64), (16, 32, 64, 128, 256)
# the csm-1b bench's capture: all but the two largest fit the graph pool's budget
CAPTURED = [(r, t) for r in ROWS for t in TOKENS if (r, t) not in {(64, 128), (64, 256)}]


def cost(planner: PrefillPlanner, lengths: list[int], calls) -> int:
    return sum(planner.cost(len(c.rows), max(lengths[i] for i in c.rows)) for c in calls)


@pytest.mark.parametrize("count", [1, 2, 5, 20, 64, 65, 300])
def test_every_chunk_is_in_one_call_and_no_plan_costs_more_than_grouping_by_length(count):
    planner, rng = PrefillPlanner(CAPTURED), random.Random(count)
    lengths = [rng.randint(3, 300) for _ in range(count)]
    calls = planner.plan(lengths)
    assert sorted(i for c in calls for i in c.rows) == list(range(count))
    for call in calls:
        assert call.tokens == max(lengths[i] for i in call.rows)
        if call.tokens <= 256:  # within the graphs' lengths: a captured bucket holds it
            assert planner.holding(len(call.rows), call.tokens) is not None
    by_length = plan(lengths, list(TOKENS), list(ROWS))
    assert cost(planner, lengths, calls) <= cost(planner, lengths, by_length)


def test_a_steps_short_prompts_share_calls_instead_of_a_call_per_length_class():
    planner = PrefillPlanner(CAPTURED)
    lengths = [5, 9, 14, 18, 22, 27, 31, 33, 40, 47, 52, 58, 61, 12, 25, 36, 44, 8, 19, 63]  # 20 prompts
    by_length = plan(lengths, list(TOKENS), list(ROWS))
    calls = planner.plan(lengths)
    assert len(by_length) >= 5 and len(calls) <= 2
    assert cost(planner, lengths, calls) < 0.6 * cost(planner, lengths, by_length)


def test_a_call_no_bucket_holds_is_avoided_when_captured_ones_cost_less():
    planner = PrefillPlanner(CAPTURED)
    lengths = [100] * 64  # (64, 128) was not captured: an eager call of 64 would pay EAGER_POSITIONS
    calls = planner.plan(lengths)
    assert all(planner.holding(len(c.rows), c.tokens) is not None for c in calls)
    assert sorted(len(c.rows) for c in calls) == [32, 32]
    assert cost(planner, lengths, calls) == 2 * (CALL_POSITIONS + 32 * 128) < EAGER_POSITIONS + 64 * 100


def test_chunks_longer_than_every_graph_go_together_in_one_eager_call():
    planner = PrefillPlanner(CAPTURED)
    lengths = [300, 20, 400, 30]
    calls = planner.plan(lengths)
    eager = [c for c in calls if c.tokens > 256]
    assert len(eager) == 1 and sorted(eager[0].rows) == [0, 2] and eager[0].tokens == 400
    assert PrefillPlanner([]).plan(lengths)[0].rows == (0, 1, 2, 3)  # no graphs: one call
