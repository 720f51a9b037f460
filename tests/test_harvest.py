"""The harvest benchmark's arithmetic (pearl_hpc/bench/harvest.py) on hand-made event
and load logs: what the load offered, what the run served, and the gap in parts."""

from __future__ import annotations

import pytest

from pearl_hpc.bench.harvest import harvest_figures, offered_worker_s, worker_intervals


def _events() -> list[dict]:
    """Run clock 0 = wall 1000. A two-component job granted at 10 s; its workers serve
    from 30 s; reclaimed at 60 s, given back at 65 s; the run ends at 100 s."""
    return [
        {"t_s": 0.0, "kind": "clock", "wall": 1000.0},
        {
            "t_s": 10.0,
            "kind": "event",
            "event": "CapacityGranted",
            "source": "7+0",
            "also": ["7+1"],
        },
        {"t_s": 25.0, "kind": "ready", "slot": 3, "gpus": ["7+0:n1:gpu0"], "source": "7+0"},
        {"t_s": 28.0, "kind": "ready", "slot": 4, "gpus": ["7+1:n2:gpu0"], "source": "7+1"},
        {"t_s": 28.0, "kind": "ready", "slot": 1, "gpus": ["gpu0"], "source": None},  # base
        {"t_s": 30.0, "kind": "admit", "slots": [3, 4, 1]},
        {"t_s": 60.0, "kind": "event", "event": "CapacityReclaimed", "source": "7+0"},
        {"t_s": 60.0, "kind": "event", "event": "CapacityReclaimed", "source": "7+1"},
        {"t_s": 65.0, "kind": "release_capacity", "source": "7+0"},
        {"t_s": 65.0, "kind": "release_capacity", "source": "7+1"},
        {"t_s": 100.0, "kind": "train", "step": 9},
    ]


def test_components_are_followed_from_grant_to_release() -> None:
    comps = worker_intervals(_events(), 100.0)
    assert comps == {
        "7+0": {"granted": 10.0, "serving": 30.0, "notice": 60.0, "released": 65.0, "ended": 65.0},
        "7+1": {"granted": 10.0, "serving": 30.0, "notice": 60.0, "released": 65.0, "ended": 65.0},
    }


def test_offered_capacity_is_the_idle_nodes_over_time_capped() -> None:
    load = [
        {"wall": 990.0, "idle_nodes": 0},
        {"wall": 1005.0, "idle_nodes": 3},  # capped at 2 workers
        {"wall": 1070.0, "idle_nodes": 1},
        {"wall": 1120.0, "end": True},
    ]
    assert offered_worker_s(load, 1000.0, 1100.0, cap=2) == pytest.approx(65 * 2 + 30 * 1)


def test_figures_split_the_gap_into_not_held_preparing_and_draining() -> None:
    load = [
        {"wall": 995.0, "idle_nodes": 0},
        {"wall": 1005.0, "idle_nodes": 2},
        {"wall": 1060.0, "idle_nodes": 0},  # other users come back: the reclaim
        {"wall": 1100.0, "idle_nodes": 2},
        {"wall": 1120.0, "end": True},
    ]
    f = harvest_figures(_events(), load, cap=2)
    assert f["window_s"] == 100.0  # run clock 0..100 = wall 1000..1100
    assert f["offered_worker_s"] == 2 * 55
    assert f["served_worker_s"] == 2 * 30  # 30 s .. 60 s, two workers
    assert f["efficiency"] == pytest.approx(60 / 110, abs=1e-3)
    assert f["preparing_worker_s"] == 2 * 20 and f["draining_worker_s"] == 2 * 5
    assert f["not_held_worker_s"] == 110 - 2 * 55  # held 10..65 = offered 5..60
    assert f["grants"] == 2 and f["reclaims"] == 2
    assert f["running_to_admitted_s"] == {"n": 2, "median": 20.0, "max": 20.0}
