"""The local backend: elastic workers are engine processes the master starts itself.

GPU ids are names (``el1:0``, ``el2:0``...): on CPU they only identify which worker runs
where. ``scale_to`` turns an availability count into grants and reclaims at once (the
last granted worker is the first reclaimed, with ``grace_s`` to drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pearl_hpc.core.controller import CapacityGranted, CapacityReclaimed, Event
from pearl_hpc.core.table import ElasticSource


def trace_events(
    grace_s: float,
    now: float,
    granted: list[tuple[ElasticSource, tuple[str, ...]]],
    job_counter: list[int],
    count: int,
) -> list[Event]:
    """Grants / reclaims that bring the elastic worker count to ``count`` (pure)."""
    events: list[Event] = []
    if count > len(granted):
        job_counter[0] += 1
        source = ElasticSource(f"el{job_counter[0]}", 0)
        sets = []
        for i in range(count - len(granted)):
            gpus: tuple[str, ...] = (f"el{job_counter[0]}:{i}",)
            granted.append((source, gpus))
            sets.append(gpus)
        events.append(CapacityGranted(source, tuple(sets)))
    reclaimed: dict[ElasticSource, list[str]] = {}
    while len(granted) > count:
        lost_source, lost_gpus = granted.pop()  # last granted, first reclaimed
        reclaimed.setdefault(lost_source, []).extend(lost_gpus)
    for source, ids in reclaimed.items():
        events.append(CapacityReclaimed(source, now + grace_s, tuple(ids)))
    return events


class LocalBackend:
    """Elastic capacity on this machine: granted and reclaimed when told to."""

    def __init__(
        self, queue: asyncio.Queue[Event], clock: Callable[[], float], grace_s: float
    ) -> None:
        self.queue = queue
        self.clock = clock
        self.grace_s = grace_s
        self.granted: list[tuple[ElasticSource, tuple[str, ...]]] = []
        self._job_counter = [0]
        self.counts = {"granted": 0, "reclaimed": 0}

    async def start(self, *, resume: bool) -> None:
        """Nothing outlives a local master (its engine children watch their parent)."""

    async def scale_to(self, workers: int, *, regrant: bool = False) -> None:
        now = self.clock()
        for event in trace_events(self.grace_s, now, self.granted, self._job_counter, workers):
            if isinstance(event, CapacityGranted) and not regrant:
                self.counts["granted"] += 1
            elif isinstance(event, CapacityReclaimed):
                self.counts["reclaimed"] += 1
            await self.queue.put(event)

    def release(self, source: ElasticSource) -> None:
        """Given back (its workers' processes are stopped by the executor): no longer
        counted; a later trace point grants the capacity afresh."""
        self.granted = [(s, gpus) for s, gpus in self.granted if s != source]

    async def attach(self, gpu_ids: tuple[str, ...], key: str, timeout_s: float) -> None:
        return None  # the master starts the engine process itself

    def live_workers(self) -> int:
        return len(self.granted)

    def describe(self) -> list[dict[str, Any]]:
        return []

    def summary(self) -> dict[str, Any] | None:
        return None

    async def close(self) -> None:
        pass
