"""The live line of ``pearl-hpc run`` on a terminal (rank 0's output)."""

from __future__ import annotations

from typing import Any

from pearl_hpc.cli.view import format_pools


class LiveRollout:
    """A live line under the step log on a terminal: the rollout in progress, the
    serving roles, elastic and borrowed workers."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self.live = Live("", console=self.console, refresh_per_second=4, transient=True)
        self.live.start()
        self.finished: set[str] = set()

    def update(self, step: int, traj: Any, batch: int, executor: Any) -> None:
        if traj.done:
            self.finished.add(traj.trajectory_id)
        done = sum(1 for t in self.finished if t.startswith(f"s{step}-"))
        roles = " ".join(
            f"s{w.slot_id}={str(w.role)[0].upper()}"
            for w in executor.workers.values()
            if w.slot_id is not None and w.role is not None
        )
        borrowed = executor.activating_overlap()
        live = executor.backend.describe()
        jobs = f", elastic {format_pools(live) or 'none'}"
        self.live.update(
            f"step {step}: rollout {done}/{batch} trajectories, turns moved "
            f"{executor.counters.moved_turns}, roles {roles or '-'}, "
            f"borrowed {'yes' if borrowed else 'no'}{jobs}"
        )

    def stop(self) -> None:
        self.live.stop()
