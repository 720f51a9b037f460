"""The rollout line of a batch job's log: at most one every ``run.log_every_s``, with the
trajectories done of the step in progress (a unit test of cli/live.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pearl_hpc.cli.live import PeriodicLine
from pearl_hpc.master.records import Counters


def test_the_rollout_line_comes_every_log_every_s(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    line = PeriodicLine(60.0, clock=lambda: now[0])
    executor = SimpleNamespace(
        workers={1: SimpleNamespace(slot_id=1, role="prefill")},
        activating_overlap=lambda: False,
        backend=SimpleNamespace(describe=lambda: []),
        counters=Counters(moved_turns=3, borrow_cycles=2, borrowed_turns=40, borrows_cancelled=1),
    )
    for i, t in enumerate((10.0, 59.0, 61.0, 62.0, 125.0)):
        now[0] = t
        line.update(4, SimpleNamespace(done=True, trajectory_id=f"s4-{i}"), 64, executor)
    out = capsys.readouterr().out.splitlines()
    borrows = "borrow cycles 2 served (40 turns), 0 unserved, 1 cancelled"
    assert out == [
        f"step 4: rollout {n}/64 trajectories, turns moved 3, roles s1=P, borrowed no "
        f"({borrows}), elastic none"
        for n in (3, 5)
    ]
