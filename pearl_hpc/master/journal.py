"""The trajectory log: every trajectory of a step after each of its turns.

The run directory's names, its lock and the journal file are :mod:`pearl_hpc.rundir`'s;
this module holds what needs the rollout's types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pearl_hpc.master.records import read_jsonl
from pearl_hpc.rollout.types import Trajectory
from pearl_hpc.rundir import RunDir


class TrajectoryLog:
    """Every trajectory of a step after each of its turns, one JSON line per record
    (``trajectories/step-NNNNN.jsonl``): a restarted master keeps the finished ones and
    resumes the unfinished ones from their last turn. Lines are flushed as written, so a
    killed master loses at most the turn in flight."""

    def __init__(self, run_dir: Path) -> None:
        self.run = RunDir(run_dir)
        self.run.trajectories.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._step = -1

    def path(self, step: int) -> Path:
        return self.run.trajectory_log(step)

    def record(self, step: int, traj: Trajectory) -> None:
        if step != self._step:
            self.close()
            self._file, self._step = self.path(step).open("a"), step
        self._file.write(json.dumps(traj.to_dict()) + "\n")
        self._file.flush()

    def load(self, step: int) -> dict[str, Trajectory]:
        """The last record of each trajectory of ``step`` (a torn last line is skipped)."""
        out: dict[str, Trajectory] = {}
        for record in read_jsonl(self.path(step)):
            try:
                traj = Trajectory.from_dict(record)
            except (KeyError, TypeError):
                continue
            out[traj.trajectory_id] = traj
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
