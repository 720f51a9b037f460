"""The master journal: atomic file, clear errors, controller restart from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearl_hpc.core.controller import CapacityGranted, Controller, WorkerReady
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.rundir import JournalError, read_journal, write_journal
from tests.factories import ManualClock, RecordingExecutor, make_profile


def _controller() -> Controller:
    return Controller(
        make_profile(), RecordingExecutor(), clock=ManualClock(), check_invariants=True
    )


def test_master_restarts_from_journal(tmp_path: Path) -> None:
    ctl = _controller()
    ctl.register_training(["t:0", "t:1", "t:2", "t:3"], overlap_gpu_sets=[["t:0", "t:1"]])
    ctl.grant_reserved([["r:0", "r:1"], ["r:2", "r:3"]])
    for slot in ctl.table.in_service():
        ctl.handle(WorkerReady(slot.slot_id))
    ctl.handle(CapacityGranted(ElasticSource("42", 1), (("e:0", "e:1"),)))
    path = tmp_path / "run" / "journal.json"
    write_journal(path, ctl.snapshot(), time_s=12.5)

    restarted = _controller()
    restarted.restore(read_journal(path))
    assert restarted.snapshot() == ctl.snapshot()
    assert [p.name for p in path.parent.iterdir()] == ["journal.json"]  # no temp file left


def test_journal_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="no journal here"):
        read_journal(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(JournalError, match="corrupt journal"):
        read_journal(bad)
    bad.write_text(json.dumps({"format": "other/9", "state": {}}))
    with pytest.raises(JournalError, match="is not 'pearl-hpc-journal/1'"):
        read_journal(bad)


def test_counters_continue_from_a_journal_and_refuse_a_corrupt_one() -> None:
    from pearl_hpc.master.records import Counters

    counters = Counters()
    counters.load_state_dict({"grows": 2, "activation_s": [1.5], "a_key_of_later": 1})
    assert counters.grows == 2 and counters.activation_s == [1.5]
    assert not hasattr(counters, "a_key_of_later")  # only the fields, typed
    with pytest.raises(JournalError, match=r"counters: Expected `int`, got `str` - at `\$.grows`"):
        counters.load_state_dict({"grows": "two"})


def _turn(traj, n: int, version: int = 1) -> None:  # type: ignore[no-untyped-def]
    """One more turn of ``traj``: a response of ``n`` tokens and an observation."""
    from pearl_hpc.rollout.types import Segment, TurnStats

    traj.segments.append(Segment(tuple(range(n)), True, tuple([-0.5] * n), version))
    traj.segments.append(Segment((7, 8), False))
    traj.turns.append(TurnStats(len(traj.turns), 2, n, len(traj.token_ids()), 0.1, ("s1",)))
    traj.weight_versions.add(version)


def _new(trajectory_id: str):  # type: ignore[no-untyped-def]
    from pearl_hpc.rollout.types import Segment, Trajectory

    return Trajectory(trajectory_id, "s0-g0", [Segment((1, 2, 3), False)], info={"task_id": 4})


def test_the_trajectory_log_appends_each_turn_and_folds_back(tmp_path: Path) -> None:
    """Two steps' rollouts interleaved (the rollout ahead); each trajectory reads back
    whole from its step's log, and the log holds each token once."""
    import json

    from pearl_hpc.master.journal import TrajectoryLog

    log = TrajectoryLog(tmp_path)
    a, b = _new("s0-g0-k0"), _new("s1-g0-k0")
    for _ in range(30):
        _turn(a, 100)
        log.record(0, a)
        _turn(b, 50, version=2)
        log.record(1, b)
    a.done, a.reward = True, 1.0
    log.record(0, a)
    log.close()
    assert TrajectoryLog(tmp_path).load(0) == {a.trajectory_id: a}
    assert TrajectoryLog(tmp_path).load(1) == {b.trajectory_id: b}
    whole = len(json.dumps(a.to_dict()))
    assert log.path(0).stat().st_size < 1.5 * whole  # a whole record per turn: ~15x


def test_a_log_record_with_a_float_that_is_not_finite_reads_back_as_written(
    tmp_path: Path,
) -> None:
    """A NaN reward or an infinite log-probability (msgspec would write null) reads back
    as it was; the records beside it are msgspec's."""
    import math

    from pearl_hpc.master.journal import TrajectoryLog
    from pearl_hpc.rollout.types import Segment

    log = TrajectoryLog(tmp_path)
    a, b = _new("s0-g0-k0"), _new("s0-g0-k1")
    _turn(a, 3)
    a.segments.append(Segment((9, 9), True, (-0.25, -math.inf), 1))
    _turn(b, 3)
    for traj in (a, b):
        log.record(0, traj)
    b.done, b.reward = True, math.nan
    log.record(0, b)
    log.close()
    back = TrajectoryLog(tmp_path).load(0)
    assert back[a.trajectory_id] == a
    assert back[a.trajectory_id].segments[-1].logprobs == (-0.25, -math.inf)
    assert back[b.trajectory_id].done and math.isnan(back[b.trajectory_id].reward)


def test_a_resumed_master_continues_the_log_and_reads_an_older_one(
    tmp_path: Path,
) -> None:
    """An earlier release's log (a whole trajectory per record) still reads; a resumed
    master's records continue what it loaded; a torn line, or a record that does not
    continue what came before, is skipped."""
    import json

    from pearl_hpc.master.journal import TrajectoryLog

    a = _new("s3-g0-k1")
    _turn(a, 10)
    log = TrajectoryLog(tmp_path)
    log.path(3).write_text(json.dumps(a.to_dict()) + "\n")  # the earlier release's record
    resumed = TrajectoryLog(tmp_path)
    (loaded,) = resumed.load(3).values()
    assert loaded == a
    _turn(loaded, 20)
    resumed.record(3, loaded)
    resumed.close()
    with log.path(3).open("a") as f:
        gap = {"trajectory_id": a.trajectory_id, "group_id": "s3-g0", "from_segment": 99,
               "segments": [], "from_turn": 9, "turns": [], "reward": None, "done": True,
               "weight_versions": [], "info": {}}  # fmt: skip
        f.write(json.dumps(gap) + "\n" + '{"trajectory_id": "s3-g0-k1", "from_seg')
    assert TrajectoryLog(tmp_path).load(3) == {a.trajectory_id: loaded}
    assert len(loaded.turns) == 2 and not loaded.done
