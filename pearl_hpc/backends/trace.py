"""The local backend's availability trace (the machine has no scheduler): what it offers
the run, through :meth:`~pearl_hpc.backends.local.LocalBackend.offer`.

    elastic.trace   points by step: before a step's rollout (or ``after_s`` into it)
    elastic.replay  a real availability trace over the run's clock (``speedup``)

The controller takes what it wants of it. A resumed run is offered afresh what the trace
gave at the step it resumes from (not counted as growth). On Slurm there is no trace:
capacity is what Slurm starts; slurm/replay-load replays a trace as other users' load.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from pearl_hpc.config.run import ElasticConfig, TracePoint, TraceReplay
from pearl_hpc.config.traces import AvailabilityTrace


def replay_workers(trace: AvailabilityTrace, replay: TraceReplay, run_s: float) -> int:
    """Elastic workers the trace grants ``run_s`` seconds into the run (pure)."""
    t = min(trace.start_s + run_s * replay.speedup, trace.end_s)
    return min(replay.max_workers, trace.count_at(t) // replay.instances_per_worker)


def resumed_points(trace: list[TracePoint], first_step: int) -> dict[int, TracePoint]:
    """The trace by step; a run resumed at ``first_step`` gets the availability the trace
    had then as a point of its own (pure)."""
    points = {p.at_step: p for p in trace}
    before = [at for at in points if at <= first_step]
    if first_step > 0 and before:
        points[first_step] = TracePoint(first_step, points[max(before)].workers)
    return points


class TraceDriver:
    """Applies ``elastic.trace`` per step and replays ``elastic.replay`` over time, as
    ``offer(workers, regrant=)`` (the local backend's)."""

    def __init__(
        self,
        elastic: ElasticConfig,
        offer: Callable[..., Awaitable[None]],
        *,
        first_step: int,
        resume: bool,
        clock: Callable[[], float],
        on_event: Callable[[str, dict[str, Any]], None],
        decide_now: Callable[[], None],
    ) -> None:
        self.elastic = elastic
        self.offer = offer
        self.first_step = first_step
        self.resume = resume
        self.clock = clock
        self.on_event = on_event
        self.decide_now = decide_now  # the queued capacity events reach the controller
        self.points = resumed_points(elastic.trace, first_step)

    async def before_rollout(self, step: int, spawn: Callable[[Any], None]) -> None:
        """The step's trace point: applied now, or ``after_s`` into its rollout (a
        reclaim notice arriving mid-rollout drains turns in flight)."""
        point = self.points.get(step)
        if point is None:
            return
        if point.after_s:
            spawn(self._apply(step, point))
        else:
            await self._apply(step, point)

    async def _apply(self, step: int, point: TracePoint) -> None:
        if point.after_s:
            await asyncio.sleep(point.after_s)
        regrant = step == self.first_step and self.resume
        await self.offer(point.workers, regrant=regrant)
        if not point.after_s:
            self.decide_now()  # decided before the rollout starts

    async def replay(self, stop: asyncio.Event) -> None:
        """The real trace over the run's clock (resumed runs continue where it was)."""
        replay = self.elastic.replay
        real = replay.load()
        current = -1
        while not stop.is_set():
            run_s = self.clock()
            workers = replay_workers(real, replay, run_s)
            if workers != current:
                trace_s = real.start_s + run_s * replay.speedup  # where in the trace
                self.on_event("trace", {"workers": workers, "trace_s": trace_s})
                await self.offer(workers, regrant=current < 0 and self.resume)
                current = workers
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), replay.poll_s)
