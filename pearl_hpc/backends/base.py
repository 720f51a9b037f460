"""The capacity interface the master drives, the same for every backend.

    want(N) ──> backend ──CapacityGranted / CapacityReclaimed──> the master's queue
    release(source) <── the controller gives a component back (release_capacity)
    attach(gpu_ids) ──> the engine socket of the elastic rank on those GPUs, once it
                        joined the world (None: not elastic GPUs)

``N`` is the controller's demand (:meth:`~pearl_hpc.core.controller.Controller.elastic_demand`:
the expansion gate at request time). Grants and reclaims reach the controller only
through the queue, whoever causes them (Slurm starting a request, a preemption signal,
the local backend's trace).
"""

from __future__ import annotations

from typing import Any, Protocol

from pearl_hpc.core.table import ElasticSource


class EngineWorkerHandle(Protocol):
    """An engine rank's socket, as the master drives it."""

    client: Any  # pearl_hpc.engine.client.EngineClient
    ready: dict[str, Any]  # what it announced: host, port (its engine socket), pid...

    async def stop(self, timeout_s: float = 60.0) -> None: ...

    def kill(self) -> None: ...


class CapacityBackend(Protocol):
    """Elastic capacity: brought to a worker count, given back a component at a time."""

    counts: dict[str, int]  # "granted" / "reclaimed": capacity events delivered so far

    async def start(self, *, resume: bool) -> None:
        """Before the first step (``resume``: a previous master's leftovers exist)."""

    def want(self, workers: int) -> None:
        """The controller's demand: keep ``workers`` elastic workers held or requested
        (fewer: requests not started are withdrawn; running workers stay until the
        controller gives them back). Returns at once: the backend acts in its own task."""

    def release(self, source: ElasticSource) -> None:
        """The controller gives ``source`` back."""

    async def attach(
        self, gpu_ids: tuple[str, ...], key: str, timeout_s: float
    ) -> EngineWorkerHandle | None:
        """The engine worker of the elastic rank the backend started on ``gpu_ids``,
        once it joined (None: no elastic component holds them)."""

    def live_workers(self) -> int:
        """Elastic workers available now (granted, not given back or being reclaimed)."""

    def starts_in_s(self) -> float:
        """Seconds until the scheduler would start a request made now (0: at once or not
        known), for the expansion gate at request time."""

    def describe(self) -> list[dict[str, Any]]:
        """The live elastic jobs, for the journal and ``pearl-hpc status``."""

    def summary(self) -> dict[str, Any] | None:
        """What the run's summary records of the backend (None: nothing)."""

    async def close(self) -> None:
        """Give every elastic resource back and see it gone."""
