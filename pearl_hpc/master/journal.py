"""The trajectory log: what each turn of a step's trajectories added, appended and flushed.

The run directory's names, its lock and the journal file are :mod:`pearl_hpc.rundir`'s;
this module holds what needs the rollout's types.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from pearl_hpc.rollout.types import Segment, Trajectory, fold_log
from pearl_hpc.rundir import RunDir, read_jsonl


class TrajectoryLog:
    """Every trajectory of a step as it grows, one JSON line per turn, appended and
    flushed (``trajectories/step-NNNNN.jsonl``): a restarted master keeps the finished
    trajectories and resumes the unfinished ones from their last turn; a killed master
    loses at most the turn in flight.

    A record carries what the turn added (``from_segment``/``segments``,
    ``from_turn``/``turns``) and the trajectory's small fields (reward, done, versions,
    info); a trajectory is the fold of its records, so the log grows linearly with the
    tokens (a record of the whole trajectory after each turn grows with turns x tokens:
    ~15x the final size at 30 turns). A record without ``from_segment`` is a whole
    trajectory (the log of an earlier release): it replaces what came before."""

    def __init__(self, run_dir: Path) -> None:
        self.run = RunDir(run_dir)
        self.run.trajectories.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._step = -1
        # (step, trajectory id) -> (segments, turns) already in the log
        self._written: dict[tuple[int, str], tuple[int, int]] = {}

    def path(self, step: int) -> Path:
        return self.run.trajectory_log(step)

    def record(self, step: int, traj: Trajectory) -> None:
        """Append what ``traj`` gained since its last record (all of it the first time)."""
        if step != self._step:
            self.close()
            self._file, self._step = self.path(step).open("ab"), step
        key = (step, traj.trajectory_id)
        segments, turns = self._written.get(key, (0, 0))
        record = {
            "trajectory_id": traj.trajectory_id,
            "group_id": traj.group_id,
            "from_segment": segments,
            "segments": [s.to_list() for s in traj.segments[segments:]],
            "from_turn": turns,
            "turns": traj.turns[turns:],
            "reward": traj.reward,
            "done": traj.done,
            "weight_versions": sorted(traj.weight_versions),
            "info": traj.info,
        }
        self._file.write(_line(record, traj.reward, traj.segments[segments:]))
        self._file.flush()
        if traj.done:  # its last record: forget it (the run's steps would pile up here)
            self._written.pop(key, None)
        else:
            self._written[key] = (len(traj.segments), len(traj.turns))

    def load(self, step: int) -> dict[str, Trajectory]:
        """Each trajectory of ``step`` as its records fold (a torn last line, or a record
        that does not continue what came before, is skipped); the next records of these
        trajectories continue from them."""
        out = fold_log(read_jsonl(self.path(step)))
        for traj in out.values():
            if not traj.done:  # a finished one is kept as it is, never recorded again
                self._written[(step, traj.trajectory_id)] = (len(traj.segments), len(traj.turns))
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_ENCODE = msgspec.json.Encoder().encode


def _line(record: dict[str, Any], reward: float | None, segments: list[Segment]) -> bytes:
    """``record`` as one JSON line, by msgspec (a turn's tokens and log-probabilities in
    ~1/15 of json's time: the master logs every turn of every trajectory). msgspec
    writes a float that is not finite as null: a record whose reward or log-probability
    is NaN or infinite is written by json (``NaN``, ``-Infinity``, which the log reads
    back); one in ``info`` becomes null."""
    finite = (reward is None or math.isfinite(reward)) and all(
        all(map(math.isfinite, s.logprobs)) for s in segments
    )
    if finite:
        return _ENCODE(record) + b"\n"
    return (json.dumps(record, default=msgspec.to_builtins) + "\n").encode()
