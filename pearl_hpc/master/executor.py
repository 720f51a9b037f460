"""The controller's executor for real engine workers: plans become process actions.

    start_workers ── activate an engine rank of the world: a base one (reserved or
                     overlap), or an elastic one the backend started (attached once it
                     joined); catch its weights up
    change_roles  ── set_role on the engine (the process stays)
    stop_workers  ── deactivate (partial turns come back to the router); a base rank is
                     kept (released), an elastic one's socket closed (it leaves with
                     its capacity). A worker still starting has its start cancelled:
                     a wait for an elastic rank at once, an engine start at its next
                     phase (vLLM's in-process engine construction cannot be
                     interrupted), before its weights catch up and it is admitted
    admit         ── the router follows the table: ACTIVE rollout slots with an engine
    release_capacity ── the backend gives the elastic component back

Every action runs as a task on the master's loop and reports back to the controller
through the event queue (WorkerReady / WorkerReleased / WorkerFailed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pearl_hpc.core.controller import (
    Event,
    WorkerFailed,
    WorkerReady,
    WorkerReleased,
)
from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.table import ElasticSource, RoleTable
from pearl_hpc.core.types import Mode, Role, Status, Zone
from pearl_hpc.engine.client import EngineClient
from pearl_hpc.engine.types import EngineError
from pearl_hpc.master.capacity import CapacityBackend, EngineWorkerHandle
from pearl_hpc.master.records import Counters, EventLog
from pearl_hpc.master.trainer import RemoteTrainer
from pearl_hpc.rollout.router import Router

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # an engine (re)start taking longer has failed


class _StartCancelled(Exception):
    """Internal: a plan removed the slot while its worker was starting."""


@dataclass
class _Start:
    """A worker's start in progress."""

    add: WorkerAdd
    t0: float  # perf_counter at its start
    task: asyncio.Task[None] | None = None
    phase: str = "queued"  # lend | attach | activate | catch_up | ready
    first: bool | None = None  # its engine's first start in the process (once activated)
    cancelled: bool = False  # a plan removed its slot: it goes no further

    def next_phase(self, phase: str) -> None:
        """The start goes on to ``phase``, unless a plan cancelled it meanwhile."""
        if self.cancelled:
            raise _StartCancelled
        self.phase = phase


@dataclass
class _Worker:
    """An engine rank and the slot it serves (None while idle)."""

    proc: EngineWorkerHandle  # its engine socket
    member_id: str  # its rank in the world (base or elastic)
    gpu_ids: tuple[str, ...]
    slot_id: int | None = None
    role: Role | None = None  # None: released (no engine)
    remote: bool = False  # an elastic rank, started by the backend
    persistent: bool = False  # a base rank: released when idle, never stopped
    overlap: bool = False  # on a trainer's GPUs (borrowed while it serves)


@dataclass
class RankEngine:
    """The engine socket of a base engine rank (kept while the rank lives)."""

    member_id: str
    client: EngineClient
    address: tuple[str, int]  # its engine socket
    failed: Callable[[str], None] = lambda member_id: None

    async def stop(self, timeout_s: float = 60.0) -> None:
        await self.client.close()

    def kill(self) -> None:
        """Its worker died (its socket, a turn, a start): the rank is declared failed
        (its launch is started again) and its engine client closed."""
        self.failed(self.member_id)
        with contextlib.suppress(RuntimeError):  # (no loop: nothing to close on)
            asyncio.get_running_loop().create_task(self.client.close())


def router_id(slot_id: int) -> str:
    """The router's name of the worker serving ``slot_id`` (in metrics and events)."""
    return f"s{slot_id}"


def weight_member(gpu_ids: tuple[str, ...]) -> str:
    """A worker's name in the weight broadcast group."""
    return f"g{'-'.join(gpu_ids)}"


class WorkerExecutor:
    """Carries the controller's plans out with the world's engine ranks."""

    def __init__(
        self,
        queue: asyncio.Queue[Event],
        router: Router,
        weights: RemoteTrainer,
        backend: CapacityBackend,
        events: EventLog,
        key: str,
        table: RoleTable,
        *,
        rank_failed: Callable[[str], None] = lambda member_id: None,
    ) -> None:
        """``table``: the controller's role table (read, never changed, here);
        ``rank_failed(member_id)``: a base engine rank whose worker died (the master
        declares it failed)."""
        self.queue = queue
        self.router = router
        self.weights = weights
        self.backend = backend
        self.log_event = events
        self.key = key  # engine workers' RPC key (elastic job steps read it too)
        self.table = table
        self.workers: dict[str, _Worker] = {}  # engine ranks, by member id
        self._on_gpus: dict[tuple[str, ...], str] = {}  # a GPU set -> its rank's member id
        self.tasks: set[asyncio.Task[None]] = set()
        self._starts: dict[int, _Start] = {}  # starting slots: their start / activation
        self.training_started = asyncio.Event()
        # weight broadcasts and membership changes of the broadcast group never overlap:
        # a member stopped mid-broadcast would leave the trainer blocked in the collective
        self.weights_lock = asyncio.Lock()
        self.counters = Counters()
        self.borrowed_turns_unrecorded = 0  # served by borrowed workers since the last step
        self.start_timeout_s = START_TIMEOUT_S
        self.rank_failed = rank_failed

    def router_failed(self, worker_id: str, reason: str) -> None:
        """A worker the router sent turns to failed: reported once (every turn in flight
        on it fails too, and says so), its process dropped with the slot."""
        worker = next(
            (w for w in self.workers.values()
             if w.slot_id is not None and router_id(w.slot_id) == worker_id),
            None,
        )  # fmt: skip
        if worker is not None:  # else already reported: the other turns it had in flight
            self._died(worker, reason)

    def member_failed(self, member_id: str, reason: str) -> None:
        """A rank of the world failed (silent, or its job ended): its worker with it."""
        worker = self.workers.get(member_id)
        if worker is None:
            return
        if worker.slot_id is None:  # placed nowhere: forgotten
            self._drop(worker)
            return
        self._died(worker, reason)

    def weights_unreachable(self, name: str) -> None:
        """Trainer 0 could not reach this weight-group member: its worker died."""
        worker = next((w for w in self.workers.values() if weight_member(w.gpu_ids) == name), None)
        if worker is not None and worker.slot_id is not None:
            self._died(worker, "unreachable for the weight broadcast")

    def _died(self, worker: _Worker, reason: str) -> None:
        assert worker.slot_id is not None
        slot_id = worker.slot_id
        self.log_event("worker_failed", slot=slot_id, reason=reason[:200])
        self._drop(worker)  # first: killing it may report it again
        worker.proc.kill()
        self.queue.put_nowait(WorkerFailed(slot_id, reason))

    # ------------------------------------------------------------------ views
    def spawn(self, coro: Any) -> None:
        """Run ``coro`` as a task of the executor (awaited or cancelled at the end)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _worker_of(self, slot_id: int) -> _Worker | None:
        return next((w for w in self.workers.values() if w.slot_id == slot_id), None)

    def activating_overlap(self) -> bool:
        """An overlap worker is activating or serving (training GPUs are lent)."""
        return any(s.status is not Status.INACTIVE for s in self.table.overlap_workers())

    def sync_router(self) -> None:
        """Route to every ACTIVE rollout slot with a serving engine (the table rules)."""
        clients, roles = {}, {}
        for slot in self.table.rollout_slots():
            w = self._worker_of(slot.slot_id)
            if slot.status is Status.ACTIVE and w is not None and w.role is not None:
                wid = router_id(slot.slot_id)
                clients[wid], roles[wid] = w.proc.client, w.role
        mode = Mode.DISAGGREGATED if Role.PREFILL in roles.values() else Mode.COLOCATED
        self.router.set_workers(clients, roles, mode)

    def serving(self) -> dict[str, Any]:
        """Workers with an engine (members of the next weight broadcast): their clients."""
        return {
            weight_member(w.gpu_ids): w.proc.client
            for w in self.workers.values()
            if w.role is not None
        }

    def serving_addresses(self) -> dict[str, tuple[str, int]]:
        """The engine sockets of :meth:`serving`'s workers (the trainer connects to them)."""
        return {
            weight_member(w.gpu_ids): _address(w)
            for w in self.workers.values()
            if w.role is not None
        }

    def slot_roles(self) -> tuple[dict[str, int], dict[str, Role]]:
        """Router worker id -> slot and -> role, of the workers placed on a slot now."""
        slots = {router_id(w.slot_id): w.slot_id for w in self.workers.values() if w.slot_id}
        roles = {
            router_id(w.slot_id): w.role
            for w in self.workers.values()
            if w.slot_id is not None and w.role is not None
        }
        return slots, roles

    async def add_engine_rank(
        self, member_id: str, gpu_ids: tuple[str, ...], address: tuple[str, int], *, overlap: bool
    ) -> None:
        """An engine rank of the world (reserved, or ``overlap`` on a trainer's GPUs):
        connected, released (no engine) until the controller places a worker on its GPUs."""
        client = EngineClient("rank-" + "-".join(gpu_ids))
        await client.connect(*address, self.key)
        rank = RankEngine(member_id, client, address, self.rank_failed)
        client.when_lost(lambda why: rank.kill())  # (idle too: a released overlap engine)
        self._keep(_Worker(rank, member_id, gpu_ids, persistent=True, overlap=overlap))

    def _keep(self, worker: _Worker) -> None:
        self.workers[worker.member_id] = worker
        self._on_gpus[worker.gpu_ids] = worker.member_id

    def _drop(self, worker: _Worker) -> None:
        self.workers.pop(worker.member_id, None)
        if self._on_gpus.get(worker.gpu_ids) == worker.member_id:
            del self._on_gpus[worker.gpu_ids]

    def _on(self, gpu_ids: tuple[str, ...]) -> _Worker | None:
        """The engine rank on ``gpu_ids`` (the table's slots are bound to GPU sets)."""
        member_id = self._on_gpus.get(gpu_ids)
        return None if member_id is None else self.workers.get(member_id)

    # ------------------------------------------------------------------ executor
    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        for add in adds:
            start = _Start(add, time.perf_counter())
            start.task = asyncio.create_task(self._start(start))
            self._starts[add.slot_id] = start
            self.tasks.add(start.task)
            start.task.add_done_callback(self.tasks.discard)

    async def _start(self, start: _Start) -> None:
        add = start.add
        try:
            worker, start.first = await self._bring_up(start)
            start.next_phase("catch_up")
            role = self._table_role(add.slot_id, add.role)
            if role is not add.role:  # re-planned while starting (change_roles skipped it)
                await worker.proc.client.set_role(role)
            async with self.weights_lock:
                await self.weights.catch_up(weight_member(add.gpu_ids), _address(worker))
                start.next_phase("ready")
                worker.slot_id, worker.role = add.slot_id, role
        except _StartCancelled:
            return  # _cancel_start takes it from here
        except Exception as exc:
            log.exception("slot %s failed to start", add.slot_id)
            failed = self._on(add.gpu_ids)
            gone = failed is not None and (failed.remote or isinstance(exc, TimeoutError))
            if failed is not None and gone and not failed.persistent:
                failed.proc.kill()
                self._drop(failed)
            if not start.cancelled:  # else released by _cancel_start
                await self.queue.put(WorkerFailed(add.slot_id, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            if self._starts.get(add.slot_id) is start:  # (a cancelled one was taken out)
                del self._starts[add.slot_id]
        took = time.perf_counter() - start.t0
        if add.reactivate:  # a first start compiles: no sample of a later activation
            counted = (
                self.counters.first_activation_s if start.first else self.counters.activation_s
            )
            counted.append(took)
        self.log_event(
            "ready",
            slot=add.slot_id,
            gpus=list(add.gpu_ids),
            source=None if add.source is None else add.source.tag,  # its elastic component
            role=str(add.role),
            s=round(took, 2),
            reactivate=add.reactivate,
            first=start.first,
        )
        await self.queue.put(WorkerReady(add.slot_id))

    async def _bring_up(self, start: _Start) -> tuple[_Worker, bool]:
        """An engine in ``add.role`` on ``add.gpu_ids``: a released worker there is
        activated, one the backend runs is attached and activated, else a new process;
        and whether that was its process's first engine start. A hung engine start
        (seen: NIXL's listener dying on a taken port) fails the slot instead of
        stalling admission of its whole group."""
        # NOTE: three cases, in this order. (1) A trainer's GPU (the overlap zone): the
        # trainer rank there moves its tensors to host memory first, or the engine waking
        # beside it runs out of device memory. (2) An engine rank already on these GPUs
        # (every base rank, and an elastic one placed before): activated in place, with
        # no process start; its weights are caught up by the caller. (3) Otherwise the
        # GPUs are an elastic component's: the backend waits for its rank to join the
        # world, and it is activated like (2).
        add = start.add
        worker = self._on(add.gpu_ids)
        if add.zone is Zone.OVERLAP:  # a trainer's GPU: its tensors leave first
            start.next_phase("lend")
            await self.weights.lend(add.gpu_ids)
        if worker is None:
            if add.source is None:  # a base GPU set: its engine rank registered at start
                raise EngineError(f"no engine rank holds {add.gpu_ids}")
            start.next_phase("attach")  # cancelled at once: a wait
            remote = await self.backend.attach(
                add.source, add.gpu_ids, self.key, self.start_timeout_s
            )
            if remote is None:
                raise EngineError(f"{add.source.tag} was given back before its rank joined")
            # an elastic rank that joined the world, serving no engine yet
            worker = _Worker(remote, remote.member_id, add.gpu_ids, remote=True)
            self._keep(worker)
        start.next_phase("activate")
        worker.slot_id = add.slot_id
        timing = await asyncio.wait_for(
            worker.proc.client.activate(add.role), timeout=self.start_timeout_s
        )
        return worker, bool(timing.detail.get("first"))

    def _table_role(self, slot_id: int, default: Role) -> Role:
        slot = next((s for s in self.table.rollout_slots() if s.slot_id == slot_id), None)
        return slot.role if slot is not None else default

    def admit(self, slot_ids: Sequence[int]) -> None:
        self.log_event("admit", slots=list(slot_ids))
        self.sync_router()

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        for slot_id, role in changes:
            self.counters.role_changes += 1
            self.router.remove(router_id(slot_id))
            self.spawn(self._rerole(slot_id, role))

    async def _rerole(self, slot_id: int, role: Role) -> None:
        worker = self._worker_of(slot_id)
        if worker is None or slot_id in self._starts:
            return  # still starting: _start takes the table's role when its engine is up
        try:
            timing = await worker.proc.client.set_role(role)
            worker.role = role
        except Exception as exc:
            if self._worker_of(slot_id) is worker:  # else reported already (by its turns)
                self._died(worker, f"{type(exc).__name__}: {exc}")
            return
        self.log_event("rerole", slot=slot_id, role=str(role), s=round(timing.wall_s, 2))
        await self.queue.put(WorkerReady(slot_id))

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        for slot_id in slot_ids:
            self.router.remove(router_id(slot_id))
            self.spawn(self._stop(slot_id, deadline_s))

    async def _stop(self, slot_id: int, deadline_s: float | None = None) -> None:
        start = self._starts.pop(slot_id, None)
        if start is not None:
            await self._cancel_start(start, reclaimed=deadline_s is not None)
            return
        worker = self._worker_of(slot_id)
        if worker is None:
            await self.queue.put(WorkerReleased(slot_id))
            return
        t0 = time.perf_counter()
        overlap = worker.overlap
        served, freed = await self._deactivate(worker)
        took = time.perf_counter() - t0
        if overlap:
            self.counters.deactivation_s.append(took)
        self._count_served(worker, served)
        self.log_event(
            "released", slot=slot_id, s=round(took, 2), overlap=overlap, served=served, **freed
        )
        await self.queue.put(WorkerReleased(slot_id))

    async def _deactivate(self, worker: _Worker) -> tuple[int | None, dict[str, int]]:
        """Drain and release ``worker``'s engine (an elastic rank's socket closed after):
        the turns it served since its activation (None: unknown, it failed to stop) and,
        on cuda, the device's free bytes before and after."""
        async with self.weights_lock:
            worker.role = None  # out of the next broadcast group
        served: int | None = None
        freed: dict[str, int] = {}
        try:
            timing, partial = await worker.proc.client.deactivate()
            served = int(timing.detail.get("served", 0))
            freed = {k: v for k, v in timing.detail.items() if k.startswith("gpu_free_")}
            self.counters.moved_turns += len(partial)
            if not worker.persistent:
                await worker.proc.stop()
                self._drop(worker)
        except Exception:
            log.exception("slot %s did not stop cleanly; killing it", worker.slot_id)
            worker.proc.kill()
            self._drop(worker)
        worker.slot_id, worker.role = None, None
        return served, freed

    def _count_served(self, worker: _Worker, served: int | None) -> None:
        """A borrow cycle or an elastic worker's stay, counted by whether it served."""
        c = self.counters
        if served is None:  # it failed to stop: what it served is unknown
            return
        if worker.overlap:
            c.borrowed_turns += served
            self.borrowed_turns_unrecorded += served
            if served:
                c.borrow_cycles += 1
            else:
                c.borrows_unserved += 1
        elif worker.remote and not served:
            c.elastic_unserved += 1

    async def _cancel_start(self, start: _Start, *, reclaimed: bool) -> None:
        """A plan removed ``start``'s slot while its worker was starting: no turn ran on it.
        A wait for an elastic rank to join, a lend or catch-up while the trainer ranks
        are lost (it would wait for the new ones, which wait for this GPU), or any start
        whose capacity is reclaimed (an engine start can outlast the reclaim's grace), is
        cancelled at once; an engine start (or a trainer's lend) ends its phase first,
        then goes no further: no weights catch-up, no admission. An engine that came up
        is released again (a base rank), or closed and its rank leaves with its capacity
        (an elastic one).

        A borrow whose warm engine came up for nothing cost its whole start and release:
        that is its sample of T_toggle (a first start, which compiles, is none)."""
        t0 = time.perf_counter()
        slot_id, task = start.add.slot_id, start.task
        assert task is not None
        phase, start.cancelled = start.phase, True
        on_trainers = phase in ("lend", "catch_up") and not self.weights.ready.is_set()
        if reclaimed or phase == "attach" or on_trainers:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        worker = self._worker_of(slot_id)
        if worker is not None:
            if reclaimed and not worker.persistent:  # its rank goes with the capacity
                self._drop(worker)
                worker.slot_id = None
                with contextlib.suppress(Exception):
                    await worker.proc.stop()
            else:
                await self._deactivate(worker)
        if start.add.zone is Zone.OVERLAP:
            self.counters.borrows_cancelled += 1
            if start.first is False:
                self.counters.activation_s.append(time.perf_counter() - start.t0)
        elif start.add.source is not None:
            self.counters.elastic_unserved += 1
        self.log_event(
            "start_cancelled", slot=slot_id, phase=phase, reclaimed=reclaimed,
            s=round(time.perf_counter() - t0, 2),
        )  # fmt: skip
        await self.queue.put(WorkerReleased(slot_id))

    def start_training(self, step: int) -> None:
        self.log_event("train", step=step)
        self.training_started.set()

    def release_capacity(self, source: ElasticSource) -> None:
        self.log_event("release_capacity", source=source.tag)
        self.backend.release(source)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        # their sockets closed; the ranks leave the world with it (elastic ones first)
        await asyncio.gather(
            *[w.proc.stop() for w in self.workers.values()], return_exceptions=True
        )


def _address(worker: _Worker) -> tuple[str, int]:
    return worker.proc.address
