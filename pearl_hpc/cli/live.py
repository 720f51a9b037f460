"""The rollout line of ``pearl-hpc run`` (rank 0's output): live on a terminal, every
``run.log_every_s`` in a batch job's log."""

from __future__ import annotations

import time
from typing import Any

from pearl_hpc.cli.view import format_pools
from pearl_hpc.master.records import format_borrows


def rollout_line(step: int, done: int, batch: int, executor: Any) -> str:
    """The rollout in progress: trajectories done, turns moved, serving roles,
    borrowed and elastic workers."""
    roles = " ".join(
        f"s{w.slot_id}={str(w.role)[0].upper()}"
        for w in executor.workers.values()
        if w.slot_id is not None and w.role is not None
    )
    borrowed = executor.activating_overlap()
    live = executor.backend.describe()
    return (
        f"step {step}: rollout {done}/{batch} trajectories, turns moved "
        f"{executor.counters.moved_turns}, roles {roles or '-'}, "
        f"borrowed {'yes' if borrowed else 'no'} ({format_borrows(vars(executor.counters))}), "
        f"elastic {format_pools(live) or 'none'}"
    )


class _Done:
    """Trajectories finished, by step."""

    def __init__(self) -> None:
        self.finished: set[str] = set()

    def count(self, step: int, traj: Any) -> int:
        if traj.done:
            self.finished.add(traj.trajectory_id)
        return sum(1 for t in self.finished if t.startswith(f"s{step}-"))


class PeriodicLine:
    """The rollout line every ``every_s`` seconds in a log (a batch job's output, not a
    terminal), between the step lines."""

    def __init__(self, every_s: float, clock: Any = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.next_s = clock() + every_s
        self.done = _Done()

    def update(self, step: int, traj: Any, batch: int, executor: Any) -> None:
        done = self.done.count(step, traj)
        if self.clock() >= self.next_s:
            self.next_s = self.clock() + self.every_s
            print(rollout_line(step, done, batch, executor), flush=True)


class LiveRollout:
    """A live line under the step log on a terminal: the rollout in progress, the
    serving roles, elastic and borrowed workers."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self.live = Live("", console=self.console, refresh_per_second=4, transient=True)
        self.live.start()
        self.done = _Done()

    def update(self, step: int, traj: Any, batch: int, executor: Any) -> None:
        self.live.update(rollout_line(step, self.done.count(step, traj), batch, executor))

    def stop(self) -> None:
        self.live.stop()
