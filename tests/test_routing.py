"""The one routing rule (core.routing) the real router and the simulator share."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pearl_hpc.core.routing import RoutingPolicy, RoutingRule, route_mode
from pearl_hpc.core.types import Mode

STICKY = RoutingRule(RoutingPolicy.STICKY, slack=2, slack_ratio=0.5)
SHORTEST = RoutingRule(RoutingPolicy.SHORTEST_QUEUE)


def test_least_loaded_then_fewest_routed_then_smallest_id() -> None:
    assert STICKY.pick([(3, 0, "a"), (1, 5, "b"), (1, 4, "c")]) == "c"
    assert STICKY.pick([(1, 4, "d"), (1, 4, "c")]) == "c"


def test_sticky_keeps_the_prefix_holder_up_to_slack_plus_ratio_of_the_least() -> None:
    # least loaded has 4: the holder may carry 4 + 2 + 0.5 * 4 = 8
    assert STICKY.pick([(4, 0, 1), (8, 0, 2)], last=2) == 2
    assert STICKY.pick([(4, 0, 1), (9, 0, 2)], last=2) == 1
    assert STICKY.pick([(4, 0, 1), (8, 0, 2)], last=7) == 1  # holder gone


def test_shortest_queue_ignores_the_prefix_holder() -> None:
    assert SHORTEST.pick([(4, 0, 1), (5, 0, 2)], last=2) == 1


def test_mode_prefers_pd_only_when_the_table_has_prefill_workers_and_pd_can_serve() -> None:
    assert route_mode(True, True, True) is Mode.DISAGGREGATED
    assert route_mode(False, True, True) is Mode.COLOCATED
    assert route_mode(True, True, False) is Mode.COLOCATED
    assert route_mode(True, False, True) is Mode.DISAGGREGATED
    assert route_mode(False, False, True) is Mode.DISAGGREGATED
    assert route_mode(True, False, False) is None


candidates = st.lists(
    st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 20)),
    min_size=1,
    max_size=8,
    unique_by=lambda c: c[2],
)


@given(candidates, st.one_of(st.none(), st.integers(0, 20)))
def test_a_pick_is_the_least_loaded_or_a_holder_within_the_limit(cands, last) -> None:
    best = min(cands)
    assert SHORTEST.pick(cands, last) == best[2]
    got = STICKY.pick(cands, last)
    if got != best[2]:
        load = next(c[0] for c in cands if c[2] == got)
        assert got == last and load <= best[0] * 1.5 + 2
