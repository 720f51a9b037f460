"""The master's port for capacity: the interface every backend satisfies (the master
owns it; backends implement it structurally and never see the master).

    want(N) ──> backend ──CapacityGranted / CapacityReclaimed──> the master's queue
    release(source) <── the controller gives a component back (release_capacity)
    attach(source, gpu_ids) ──> the engine socket of the elastic rank of ``source`` on
                        those GPUs, once it joined the world (None: given back)
    before_rollout(step), follow_trace(stop) ──> what the machine makes available, where
                        the backend is its own scheduler (local: the run's trace)

The rank-0 entry picks the backend (:func:`pearl_hpc.backends.backend_factory`) and hands
its factory to :func:`~pearl_hpc.master.loop.run_master`, which builds it with one
:class:`BackendContext` once the world's members are known.

``N`` is the controller's demand (:meth:`~pearl_hpc.core.controller.Controller.elastic_demand`:
the expansion gate at request time). Grants and reclaims reach the controller only
through the queue, whoever causes them (Slurm starting a request, a preemption signal,
the local backend's trace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pearl_hpc.comm.members import Members
from pearl_hpc.config.run import RunConfig
from pearl_hpc.core.controller import Event
from pearl_hpc.core.table import ElasticSource


@dataclass(frozen=True)
class BackendContext:
    """What a capacity backend is built with (one object for every backend)."""

    cfg: RunConfig  # the run (elastic, slurm sections)
    run_dir: Path
    model_dir: str  # the model elastic ranks load
    members: Members  # the world the elastic ranks join and leave
    queue: asyncio.Queue[Event]  # capacity events go here, to the controller
    clock: Callable[[], float]  # the run's clock (continues across masters)
    on_event: Callable[[str, dict[str, Any]], None]  # the run's event log
    decide_now: Callable[[], None]  # the queued events reach the controller now
    first_step: int  # the step this master starts at (a resumed run's next)
    resume: bool  # a previous master's leftovers exist


class EngineWorkerHandle(Protocol):
    """An engine rank's socket, as the master drives it."""

    client: Any  # pearl_hpc.engine.client.EngineClient
    member_id: str  # its rank in the world
    address: tuple[str, int]  # its engine socket (host, port)

    async def stop(self, timeout_s: float = 60.0) -> None: ...

    def kill(self) -> None: ...


class CapacityBackend(Protocol):
    """Elastic capacity: brought to a worker count, given back a component at a time."""

    counts: dict[str, int]  # "granted" / "reclaimed": capacity events delivered so far

    async def start(self) -> None:
        """Before the first step (a resumed run's backend adopts what the previous
        master left, :attr:`BackendContext.resume`)."""

    def want(self, workers: int) -> None:
        """The controller's demand: keep ``workers`` elastic workers held or requested
        (fewer: requests not started are withdrawn; running workers stay until the
        controller gives them back). Returns at once: the backend acts in its own task."""

    def release(self, source: ElasticSource) -> None:
        """The controller gives ``source`` back."""

    async def attach(
        self, source: ElasticSource, gpu_ids: tuple[str, ...], key: str, timeout_s: float
    ) -> EngineWorkerHandle | None:
        """The engine worker of ``source``'s rank on ``gpu_ids`` (the plan's
        :class:`~pearl_hpc.core.orchestrator.WorkerAdd`), once it joined (None: the
        backend holds no such component, e.g. given back already)."""

    async def before_rollout(self, step: int, spawn: Callable[[Awaitable[None]], None]) -> None:
        """Before ``step``'s rollout: capacity the backend itself makes available then
        (local: the run's trace point; ``spawn`` runs what comes later in the rollout)."""

    async def follow_trace(self, stop: asyncio.Event) -> None:
        """Until ``stop``: capacity the backend makes available over time (local: a
        replayed availability trace; returns at once where the scheduler decides)."""

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
