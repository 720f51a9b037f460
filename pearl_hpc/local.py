"""The local backend: the controller drives real engine worker processes on this machine.

    pearl-hpc run configs/runs/local.yaml

Everything a cluster run does, on a laptop: the master's controller (role table, tracker,
decision engine, orchestrator, policies) decides; :class:`LocalExecutor` carries plans
out with engine worker processes (:mod:`pearl_hpc.engine`), the router and the weight
broadcast; an availability trace grants and reclaims "elastic" workers; the GRPO
trainer trains in this process. GPU ids are names (``train:0``, ``rsv:0``,
``el1:0``...): on CPU they only identify which worker runs where.

Data flow (one asyncio loop; the controller is called from it only)::

    trace task ──CapacityGranted/Reclaimed──┐
    worker tasks ──WorkerReady/Released/Failed──┤──> queue ──> controller.handle
    step loop ──StepTelemetry, TrainingBegin/Finished──┘            │
                                                                    ▼
      LocalExecutor.start_workers / admit / change_roles / stop_workers / start_training
          └── spawn / activate / set_role / deactivate engine workers (tasks)
          └── the router follows the table: ACTIVE rollout slots with a live engine

Steps overlap with bounded staleness 1 (``run.max_staleness``; 0 = synchronous)::

    rollout k (weights v_k) ─┬─ rollout k+1 (still v_k) ────────┬─ publish v_k+1 ─ rollout k+2
                             └─ Training Begin k: borrowed GPUs  │
                                return, GRPO on batch k, snapshot┘ (Training Finished k:
                                                                    GPUs may be lent again)

New weights go out between two rollouts, never into a generation in flight; the trainer
accepts batches at most one version old.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from pearl_hpc.config import load_yaml
from pearl_hpc.core.controller import (
    CapacityGranted,
    CapacityReclaimed,
    Controller,
    Event,
    StepTelemetry,
    TrainingBegin,
    TrainingFinished,
    WorkerFailed,
    WorkerReady,
    WorkerReleased,
)
from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.predictor import predict
from pearl_hpc.core.schema import from_mapping, spec_field
from pearl_hpc.core.table import IN_SERVICE, ElasticSource
from pearl_hpc.core.types import Mode, Role, Status, Zone
from pearl_hpc.engine.client import WorkerProcess, spawn_worker
from pearl_hpc.engine.rpc import new_key
from pearl_hpc.engine.vllm_engine import EngineSpec
from pearl_hpc.errors import ConfigError
from pearl_hpc.journal import read_journal, write_journal
from pearl_hpc.rollout.envs import ENV_NAMES
from pearl_hpc.rollout.router import Router
from pearl_hpc.rollout.types import Trajectory
from pearl_hpc.sim.traces import AvailabilityTrace, load_segment, load_trace
from pearl_hpc.slurmrun import ElasticJobs, RemoteWorker, SlurmSettings, source_of_gpus
from pearl_hpc.train.loop import WeightSync

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    """An engine worker process and the slot it serves (None while idle)."""

    proc: WorkerProcess | RemoteWorker  # a local child, or a step of an elastic Slurm job
    gpu_ids: tuple[str, ...]
    slot_id: int | None = None
    role: Role | None = None  # None: released (no engine)


@dataclass
class Counters:
    """What happened, for the summary and the must-show checks."""

    grows: int = 0
    reclaims: int = 0
    borrow_cycles: int = 0
    mode_changes: int = 0
    ratio_changes: int = 0
    role_changes: int = 0
    moved_turns: int = 0
    activation_s: list[float] = field(default_factory=list)
    deactivation_s: list[float] = field(default_factory=list)
    return_latency_s: list[float] = field(default_factory=list)  # Training Begin -> start


class LocalExecutor:
    """Carries the controller's plans out with local engine worker processes."""

    def __init__(
        self,
        spec: EngineSpec,
        run_dir: Path,
        queue: asyncio.Queue[Event],
        router: Router,
        sync: WeightSync,
        clock: Any,
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.queue = queue
        self.router = router
        self.sync = sync
        self.clock = clock
        self.key = new_key()
        self.controller: Controller | None = None
        self.workers: dict[tuple[str, ...], _Worker] = {}  # by GPU set
        self.tasks: set[asyncio.Task[None]] = set()
        self.starting: dict[int, asyncio.Task[None]] = {}  # slot -> its start / activation
        self.training_started = asyncio.Event()
        # weight broadcasts and membership changes of the broadcast group never overlap:
        # a member stopped mid-broadcast would leave the trainer blocked in the collective
        self.weights_lock = asyncio.Lock()
        self.counters = Counters()
        self.events_path = run_dir / "events.jsonl"
        self.last_table: list[list[Any]] = []
        self.start_timeout_s = 300.0  # an engine (re)start taking longer has failed
        self.elastic: ElasticJobs | None = None  # the Slurm backend's elastic jobs
        router.on_failure = self._on_router_failure

    def _on_router_failure(self, worker_id: str, reason: str) -> None:
        if worker_id.startswith("s") and worker_id[1:].isdigit():
            slot_id = int(worker_id[1:])
            self.log_event("worker_failed", slot=slot_id, reason=reason[:200])
            worker = self._worker_of(slot_id)
            if worker is not None:  # its process is of no further use: gone with the slot
                worker.proc.kill()
                self.workers.pop(worker.gpu_ids, None)
            self.queue.put_nowait(WorkerFailed(slot_id, reason))

    # ------------------------------------------------------------------ helpers
    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def log_event(self, kind: str, **fields: Any) -> None:
        with self.events_path.open("a") as f:
            f.write(json.dumps({"t_s": round(self.clock(), 3), "kind": kind, **fields}) + "\n")

    def _worker_of(self, slot_id: int) -> _Worker | None:
        return next((w for w in self.workers.values() if w.slot_id == slot_id), None)

    def activating_overlap(self) -> bool:
        """An overlap worker is activating or serving (training GPUs are lent)."""
        assert self.controller is not None
        return any(s.status is not Status.INACTIVE for s in self.controller.table.overlap_workers())

    def sync_router(self) -> None:
        """Route to every ACTIVE rollout slot with a serving engine (the table rules)."""
        assert self.controller is not None
        clients, roles = {}, {}
        for slot in self.controller.table.rollout_slots():
            w = self._worker_of(slot.slot_id)
            if slot.status is Status.ACTIVE and w is not None and w.role is not None:
                wid = f"s{slot.slot_id}"
                clients[wid], roles[wid] = w.proc.client, w.role
        mode = Mode.DISAGGREGATED if Role.PREFILL in roles.values() else Mode.COLOCATED
        self.router.set_workers(clients, roles, mode)

    def serving(self) -> dict[str, Any]:
        """Workers with an engine (members of the next weight broadcast)."""
        return {
            f"g{'-'.join(w.gpu_ids)}": w.proc.client
            for w in self.workers.values()
            if w.role is not None
        }

    async def add_overlap_process(self, gpu_ids: tuple[str, ...]) -> None:
        """Overlap workers live on the training GPUs for the whole run, released at first."""
        proc = await spawn_worker(
            self.spec, "ov-" + "-".join(gpu_ids), run_dir=self.run_dir, key=self.key, role=None
        )
        self.workers[gpu_ids] = _Worker(proc, gpu_ids)

    # ------------------------------------------------------------------ executor
    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        for add in adds:
            task = asyncio.create_task(self._start(add))
            self.tasks.add(task)
            self.starting[add.slot_id] = task
            task.add_done_callback(self.tasks.discard)

    async def _start(self, add: WorkerAdd) -> None:
        t0 = time.perf_counter()
        try:
            worker = self.workers.get(add.gpu_ids)
            if worker is not None:
                worker.slot_id = add.slot_id
            if worker is None and self.elastic is not None and source_of_gpus(add.gpu_ids):
                # an engine server in an elastic job's step: up with no engine, activate it
                remote = await self.elastic.attach(add.gpu_ids, self.key, self.start_timeout_s)
                worker = _Worker(remote, add.gpu_ids, slot_id=add.slot_id)
                self.workers[add.gpu_ids] = worker
                await asyncio.wait_for(
                    remote.client.activate(add.role), timeout=self.start_timeout_s
                )
            elif worker is None:
                proc = await spawn_worker(
                    self.spec,
                    f"w{add.slot_id}-" + "-".join(add.gpu_ids),
                    run_dir=self.run_dir,
                    key=self.key,
                    role=add.role,
                    slot_id=add.slot_id,
                )
                worker = _Worker(proc, add.gpu_ids, slot_id=add.slot_id)
                self.workers[add.gpu_ids] = worker
            else:
                # a hung engine start (seen: NIXL's listener dying on a taken port) must
                # fail the slot, not stall admission of its whole group
                await asyncio.wait_for(
                    worker.proc.client.activate(add.role), timeout=self.start_timeout_s
                )
            role = self._table_role(add.slot_id, add.role)
            if role is not add.role:  # re-planned while starting (change_roles skipped it)
                await worker.proc.client.set_role(role)
            async with self.weights_lock:
                await self.sync.catch_up(f"g{'-'.join(add.gpu_ids)}", worker.proc.client)
                worker.slot_id, worker.role = add.slot_id, role
        except Exception as exc:
            log.exception("slot %s failed to start", add.slot_id)
            failed = self.workers.get(add.gpu_ids)
            in_job = failed is not None and isinstance(failed.proc, RemoteWorker)
            if failed is not None and (in_job or isinstance(exc, TimeoutError)):
                failed.proc.kill()
                self.workers.pop(add.gpu_ids, None)
            await self.queue.put(WorkerFailed(add.slot_id, f"{type(exc).__name__}: {exc}"))
            return
        took = time.perf_counter() - t0
        if add.reactivate:
            self.counters.activation_s.append(took)
        self.log_event(
            "ready",
            slot=add.slot_id,
            role=str(add.role),
            s=round(took, 2),
            reactivate=add.reactivate,
        )
        await self.queue.put(WorkerReady(add.slot_id))

    def _table_role(self, slot_id: int, default: Role) -> Role:
        assert self.controller is not None
        slot = next(
            (s for s in self.controller.table.rollout_slots() if s.slot_id == slot_id), None
        )
        return slot.role if slot is not None else default

    def admit(self, slot_ids: Sequence[int]) -> None:
        self.log_event("admit", slots=list(slot_ids))
        self.sync_router()

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        for slot_id, role in changes:
            self.counters.role_changes += 1
            self.router.remove(f"s{slot_id}")
            self._spawn(self._rerole(slot_id, role))

    async def _rerole(self, slot_id: int, role: Role) -> None:
        worker = self._worker_of(slot_id)
        starting = self.starting.get(slot_id)
        if worker is None or (starting is not None and not starting.done()):
            return  # still starting: _start takes the table's role when its engine is up
        try:
            timing = await worker.proc.client.set_role(role)
            worker.role = role
        except Exception as exc:
            await self.queue.put(WorkerFailed(slot_id, str(exc)))
            return
        self.log_event("rerole", slot=slot_id, role=str(role), s=round(timing.wall_s, 2))
        await self.queue.put(WorkerReady(slot_id))

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        for slot_id in slot_ids:
            self.router.remove(f"s{slot_id}")
            self._spawn(self._stop(slot_id))

    async def _stop(self, slot_id: int) -> None:
        starting = self.starting.pop(slot_id, None)
        if starting is not None and not starting.done():
            # stopped while starting (e.g. Training Begin during an activation): let the
            # start finish, then drain and release it like any serving worker
            await asyncio.gather(starting, return_exceptions=True)
        worker = self._worker_of(slot_id)
        if worker is None:
            await self.queue.put(WorkerReleased(slot_id))
            return
        t0 = time.perf_counter()
        overlap = worker.gpu_ids[0].startswith("train")
        async with self.weights_lock:
            worker.role = None  # out of the next broadcast group
        try:
            _timing, partial = await worker.proc.client.deactivate()
            self.counters.moved_turns += len(partial)
            if not overlap:
                await worker.proc.stop()
                del self.workers[worker.gpu_ids]
        except Exception:
            log.exception("slot %s did not stop cleanly; killing it", slot_id)
            worker.proc.kill()
            self.workers.pop(worker.gpu_ids, None)
        worker.slot_id, worker.role = None, None
        took = time.perf_counter() - t0
        if overlap:
            self.counters.deactivation_s.append(took)
        self.log_event("released", slot=slot_id, s=round(took, 2), overlap=overlap)
        await self.queue.put(WorkerReleased(slot_id))

    def start_training(self, step: int) -> None:
        self.log_event("train", step=step)
        self.training_started.set()

    def release_capacity(self, source: ElasticSource) -> None:
        self.log_event("release_capacity", source=source.tag)
        if self.elastic is not None:
            self.elastic.release(source)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(
            *[w.proc.stop() for w in self.workers.values()], return_exceptions=True
        )
        for w in self.workers.values():
            w.proc.kill()


def zone_of(gpu_ids: tuple[str, ...]) -> Zone:
    return Zone.OVERLAP if gpu_ids[0].startswith("train") else Zone.DEDICATED


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


async def drain_queue(
    queue: asyncio.Queue[Event], controller: Controller, executor: LocalExecutor
) -> None:
    """Apply every queued event to the controller, then make the router follow the table."""
    while not queue.empty():
        event = queue.get_nowait()
        executor.log_event("event", event=type(event).__name__, **_fields(event))
        result = controller.handle(event)
        if result is not None:
            executor.log_event(
                "reconfigure",
                cause=result.cause,
                target=str(result.plan.target),
                add=len(result.plan.add),
                remove=len(result.plan.remove),
                role_changes=len(result.plan.role_changes),
                reason=result.decision.reason[:160],
                borrow_gate=result.borrow_gate.reason if result.borrow_gate else None,
                expansion_gate=result.expansion_gate.reason if result.expansion_gate else None,
            )
    executor.sync_router()
    table = [
        [s.slot_id, str(s.role), str(s.status), str(s.zone)]
        for s in controller.table.rollout_slots()
    ]
    if table != executor.last_table:  # the role timeline of `pearl-hpc report`
        executor.last_table = table
        executor.log_event("table", slots=table)


def _fields(event: Event) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in getattr(event, "__slots__", ()):
        value = getattr(event, name)
        if isinstance(value, int | float | str) or value is None:
            out[name] = value
        elif isinstance(value, ElasticSource):
            out[name] = value.tag
    return out


# ============================================================================ config


@dataclass(frozen=True)
class LocalWorkers:
    training_gpus: int = spec_field("GPUs the trainer holds (names on CPU)", default=1, ge=1)
    reserved_rollout: int = spec_field("dedicated rollout workers from the start", default=1, ge=1)
    overlap: int = spec_field(
        "overlap workers that borrow training GPUs (<= training_gpus)", default=1, ge=0
    )


@dataclass(frozen=True)
class TracePoint:
    at_step: int = spec_field("the step whose rollout this point precedes", ge=0)
    workers: int = spec_field("elastic workers available from then on", ge=0)
    after_s: float = spec_field(
        "seconds into that step's rollout (0: before it starts)", default=0.0, ge=0
    )


@dataclass(frozen=True)
class TraceReplay:
    """A time-based availability trace replayed over the run's wall clock."""

    segment: int = spec_field(
        "PEARL segment 1-3 of the real spot traces in pearl_hpc/data/traces (0: none)",
        default=0,
        ge=0,
        le=3,
    )
    file: str = spec_field("or an availability trace CSV (time_s,count)", default="")
    speedup: float = spec_field("trace seconds per run second", default=60.0, gt=0)
    instances_per_worker: int = spec_field(
        "trace instances (GPUs) per elastic worker", default=1, ge=1
    )
    max_workers: int = spec_field(
        "at most this many elastic workers (engine processes on this machine)", default=2, ge=0
    )
    poll_s: float = spec_field("how often the trace is read, run seconds", default=0.5, gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.segment or self.file)

    def load(self) -> AvailabilityTrace:
        return load_segment(self.segment) if self.segment else load_trace(self.file)


def replay_workers(trace: AvailabilityTrace, replay: TraceReplay, run_s: float) -> int:
    """Elastic workers the trace grants ``run_s`` seconds into the run (pure)."""
    t = min(trace.start_s + run_s * replay.speedup, trace.end_s)
    return min(replay.max_workers, trace.count_at(t) // replay.instances_per_worker)


@dataclass(frozen=True)
class LocalElastic:
    trace: list[TracePoint] = spec_field("elastic availability, by step", default=[])
    replay: TraceReplay = spec_field(
        "or availability over time, from a real trace (replaces trace)", default=TraceReplay()
    )
    grace_s: float = spec_field("reclaim deadline after the notice, seconds", default=30.0, gt=0)


@dataclass(frozen=True)
class LocalRunSettings:
    steps: int = spec_field("training steps", default=4, ge=1)
    env: str = spec_field("environment: calc | synthetic", default="calc")
    max_turns: int = spec_field("turns per trajectory", default=2, ge=1)
    num_groups: int = spec_field("prompts per step", default=2, ge=1)
    group_size: int = spec_field("samples per prompt (GRPO group)", default=4, ge=1)
    max_tokens_per_turn: int = spec_field("generation budget per turn", default=16, ge=1)
    temperature: float = spec_field("sampling temperature", default=1.0, ge=0)
    lr: float = spec_field("GRPO learning rate", default=0.02, gt=0)
    seed: int = spec_field("rollout and training seed", default=0, ge=0)
    max_staleness: int = spec_field(
        "1: step k+1's rollout runs while step k trains (its batch is one version "
        "behind); 0: synchronous steps",
        default=1,
        ge=0,
        le=1,
    )


@dataclass(frozen=True)
class LocalConfig:
    name: str = spec_field("run name (labels the run directory)")
    runs_dir: str = spec_field("where run directories go", default="runs")
    model: str = spec_field("'tiny' (built locally) or a model directory", default="tiny")
    backend: str = spec_field(
        "local (elastic workers are local processes) | slurm (elastic workers are "
        "heterogeneous Slurm jobs, reclaimed by preemption)",
        default="local",
    )
    slurm: SlurmSettings = spec_field("elastic jobs (backend: slurm)", default=SlurmSettings())
    profile: str = spec_field(
        "workload profile YAML (relative: to configs/)", default="profiles/tiny-cpu.yaml"
    )
    policy: PolicyConfig = spec_field("controller policies", default=PolicyConfig())
    workers: LocalWorkers = spec_field("worker layout", default=LocalWorkers())
    elastic: LocalElastic = spec_field("elastic capacity", default=LocalElastic())
    run: LocalRunSettings = spec_field("the workload", default=LocalRunSettings())


def load_local(path: str | Path) -> LocalConfig:
    cfg = from_mapping(LocalConfig, load_yaml(path), where=str(path))
    if cfg.workers.overlap > cfg.workers.training_gpus:
        raise ConfigError(
            f"{path}: workers.overlap ({cfg.workers.overlap}) > "
            f"workers.training_gpus ({cfg.workers.training_gpus}); lower it"
        )
    if cfg.elastic.trace and cfg.elastic.replay.enabled:
        raise ConfigError(
            f"{path}: elastic.trace and elastic.replay are both set; keep one (a step-indexed "
            "trace, or a time-based one replayed)"
        )
    if cfg.elastic.replay.enabled:
        cfg.elastic.replay.load()  # a bad segment or file fails here, naming the fix
    if cfg.backend not in ("local", "slurm"):
        raise ConfigError(f"{path}: backend {cfg.backend!r}: use local or slurm")
    if cfg.backend == "slurm" and not shutil.which("sbatch"):
        raise ConfigError(
            f"{path}: backend slurm needs the Slurm commands (sbatch not on PATH); run on a "
            "Slurm cluster (slurm/local-cluster.sh up for a local one) or use backend: local"
        )
    if cfg.run.env not in ENV_NAMES:
        raise ConfigError(f"{path}: run.env {cfg.run.env!r}: use one of {list(ENV_NAMES)}")
    return cfg


# ============================================================================ the run


class TrajectoryLog:
    """Every trajectory of a step after each of its turns, one JSON line per record
    (``trajectories/step-NNNNN.jsonl``): a restarted master keeps the finished ones and
    resumes the unfinished ones from their last turn. Lines are flushed as written, so a
    killed master loses at most the turn in flight."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "trajectories"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._step = -1

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:05d}.jsonl"

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


def new_run_dir(cfg: LocalConfig, config_path: Path) -> Path:
    """``RUNS_DIR/NAME-DATE`` with a copy of the run YAML (what ``--resume`` reads)."""
    run_dir = Path(cfg.runs_dir) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(Path(config_path).read_text())
    return run_dir


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file the run appends to; a missing file is empty and
    a torn line (being written, or cut by a kill) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def read_run_state(run_dir: Path) -> dict[str, Any]:
    """The run's journal (``journal.json``), or a clear error naming what is missing."""
    path = Path(run_dir) / "journal.json"
    if not path.exists():
        raise ConfigError(
            f"{run_dir}: no journal.json; pass the run directory that `pearl-hpc run` "
            "printed (runs/NAME-DATE)"
        )
    return read_journal(path)


@dataclass
class StepMetrics:
    step: int
    t_s: float
    rollout_s: float
    train_s: float
    sync_s: float  # the latest weight broadcast: of this step's weights (synchronous), or
    # of the previous step's (rollout ahead: this step's go out after the next rollout)
    return_latency_s: float
    generated_tokens: int
    tokens_per_s: float
    mean_reward: float
    version: int
    roles: dict[str, str]
    elastic_workers: int
    borrowed: bool
    moved_turns: int
    trajectories: int  # finished (done, rewarded) trajectories trained on
    resumed: int  # trajectories of the step recovered from a previous master's journal
    predicted_s: float  # the tracker's prediction of this rollout (before it ran)
    config: str  # the serving configuration at rollout start, e.g. 2C or 1P1D
    max_staleness: int = 0  # largest (trainer version - generating version) in the batch


@dataclass
class _Rollout:
    """A finished rollout step, waiting for its training."""

    trajectories: list[Trajectory]
    rollout_s: float
    roles: dict[str, str]
    borrowed: bool
    moved_turns: int
    resumed: int
    resumed_tokens: int  # generated by a previous master (not this rollout's work)
    predicted_s: float
    config: str


async def run_local(
    cfg: LocalConfig,
    run_dir: Path,
    on_step: Any = None,
    *,
    resume: bool = False,
    on_progress: Any = None,
) -> dict[str, Any]:
    """One local training run; returns the summary (also written to ``summary.json``).

    The run directory holds the journal (``journal.json``: controller snapshot, counters,
    next step), weight snapshots (``snapshots/``, one per step), the trajectory log and
    the metrics. ``resume=True`` continues a run whose master died: the trainer from its
    latest snapshot, the tracker's fitted profile and the counters from the journal, the
    step in progress from the trajectory log (finished trajectories kept, unfinished ones
    resumed from their last turn). Engine workers of the dead master exit on their own
    (they watch their parent); elastic workers are granted again from the trace.
    """
    from transformers import AutoTokenizer

    from pearl_hpc.config import REPO_CONFIGS, load_profile
    from pearl_hpc.engine.tinymodel import build_tiny_model, default_model_dir
    from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig, rollout_batch, tracker_turns
    from pearl_hpc.rollout.envs import make_env
    from pearl_hpc.train.grpo import GRPOConfig, GRPOTrainer, latest_snapshot

    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    state = read_run_state(run_dir) if resume else None
    offset_s = float(state["t_s"]) if state else 0.0  # run time continues across masters

    def clock() -> float:
        return offset_s + time.monotonic() - t_start

    model_dir = str(build_tiny_model(default_model_dir())) if cfg.model == "tiny" else cfg.model
    profile_path = Path(cfg.profile)
    profile = load_profile(
        profile_path if profile_path.is_absolute() else REPO_CONFIGS / profile_path
    )
    queue: asyncio.Queue[Event] = asyncio.Queue()
    router = Router(wait_for_workers_s=600)
    # elastic engines on other nodes reach the trainer's weight store by this host's name
    sync = WeightSync(host=socket.gethostname() if cfg.backend == "slurm" else "127.0.0.1")
    spec = EngineSpec(model_dir=model_dir)
    executor = LocalExecutor(spec, run_dir, queue, router, sync, clock)
    pool = None
    if cfg.backend == "slurm":
        pool = executor.elastic = ElasticJobs(
            cfg.slurm,
            spec,
            run_dir,
            executor.key,
            queue,
            clock,
            cfg.elastic.grace_s,
            lambda kind, fields: executor.log_event(kind, **fields),
        )
    controller = Controller(
        profile, executor, policy=cfg.policy, clock=clock, check_invariants=True
    )
    executor.controller = controller
    grpo = GRPOConfig(lr=cfg.run.lr, seed=cfg.run.seed)  # accepts batches one version old
    snapshots = run_dir / "snapshots"
    snapshot = None
    if state is not None:
        # a snapshot newer than the journal is of a step trained but never recorded (the
        # master died in between): that step is trained again from its trajectory log
        for newer in snapshots.glob("v[0-9]*"):
            if newer.name[1:].isdigit() and int(newer.name[1:]) > int(state["version"]):
                shutil.rmtree(newer)
        snapshot = latest_snapshot(snapshots)
    if snapshot is not None:
        trainer = GRPOTrainer.from_snapshot(model_dir, snapshot, grpo)
        sync.seed(trainer.state_dict(), trainer.version)  # new engines catch up to it
    else:
        trainer = GRPOTrainer(model_dir, grpo)
    first_step = 0
    recorded_version = trainer.version
    metrics: list[StepMetrics] = []
    if state is not None:
        first_step = int(state["next_step"])
        controller.tracker.restore(state["controller"]["tracker"])
        controller.toggle.restore(state["controller"]["toggle"])
        for key, value in state["counters"].items():
            setattr(executor.counters, key, value)
        metrics = [m for m in _read_metrics(run_dir) if m.step < first_step]
        _write_lines(run_dir / "metrics.jsonl", [json.dumps(asdict(m)) for m in metrics])
        executor.log_event("resumed", step=first_step, version=trainer.version)
    chat = ChatFormat(cast(Any, AutoTokenizer.from_pretrained(model_dir)))
    rollout = RolloutConfig(
        num_groups=cfg.run.num_groups,
        group_size=cfg.run.group_size,
        max_tokens_per_turn=cfg.run.max_tokens_per_turn,
        temperature=cfg.run.temperature,
        seed=cfg.run.seed,
    )

    def make() -> Any:
        return make_env(cfg.run.env, max_turns=cfg.run.max_turns)

    train_gpus = tuple(f"train:{i}" for i in range(cfg.workers.training_gpus))
    overlap_sets: list[tuple[str, ...]] = [(g,) for g in train_gpus[: cfg.workers.overlap]]
    pump_stop = asyncio.Event()

    async def pump() -> None:
        while not pump_stop.is_set():
            try:
                event = await asyncio.wait_for(queue.get(), timeout=0.2)
            except TimeoutError:
                continue
            await queue.put(event)
            await drain_queue(queue, controller, executor)
            save_state(first_step if not metrics else metrics[-1].step + 1, "running")

    # counters a previous master journaled; this master's history adds to them
    before_changes = (executor.counters.mode_changes, executor.counters.ratio_changes)
    before_capacity = (executor.counters.grows, executor.counters.reclaims)

    def update_counters() -> None:
        history = controller.history
        modes = [r.plan.target.mode for r in history]
        c = executor.counters
        c.mode_changes = before_changes[0] + sum(1 for a, b in itertools.pairwise(modes) if a != b)
        c.ratio_changes = before_changes[1] + sum(
            1
            for a, b in itertools.pairwise(history)
            if a.plan.target.mode == b.plan.target.mode
            and a.plan.target.mode is Mode.DISAGGREGATED
            and a.plan.target != b.plan.target
        )
        c.borrow_cycles = min(len(c.activation_s), len(c.deactivation_s))
        if pool is not None:  # grants and reclaims are Slurm's: counted as they arrive
            c.grows = before_capacity[0] + pool.counts["granted"]
            c.reclaims = before_capacity[1] + pool.counts["reclaimed"]

    def elastic_workers() -> int:
        return pool.live_workers() if pool is not None else len(granted)

    def save_state(next_step: int, status: str) -> None:
        update_counters()
        write_journal(
            run_dir / "journal.json",
            {
                "status": status,
                "pid": os.getpid(),
                "next_step": next_step,
                "steps": cfg.run.steps,
                "version": recorded_version,  # weights of the steps recorded so far
                "t_s": round(clock(), 3),
                "elastic_workers": elastic_workers(),
                "elastic_jobs": pool.describe() if pool is not None else [],
                "counters": asdict(executor.counters),
                "controller": controller.snapshot(),
            },
            time_s=clock(),
        )

    granted: list[tuple[ElasticSource, tuple[str, ...]]] = []
    job_counter = [0]
    trace = {p.at_step: p for p in cfg.elastic.trace}
    if first_step > 0:  # the trace's availability at the resumed step, granted afresh
        before = [at for at in trace if at <= first_step]
        if before:
            trace[first_step] = TracePoint(first_step, trace[max(before)].workers)

    async def apply_trace(step: int, point: TracePoint) -> None:
        """Grants / reclaims of a trace point, ``after_s`` into the step's rollout (a
        reclaim notice arriving mid-rollout drains turns in flight)."""
        if point.after_s:
            await asyncio.sleep(point.after_s)
        await set_elastic(point.workers, regrant=step == first_step and resume)
        if not point.after_s and pool is None:
            await drain_queue(queue, controller, executor)  # decided before the rollout

    async def set_elastic(workers: int, regrant: bool = False) -> None:
        """Bring the elastic workers to ``workers``: local grants / reclaims, or real jobs
        (grants and reclaims then arrive from squeue and the jobs' signals)."""
        if pool is not None:
            await pool.scale_to(workers)
            return
        for ev in trace_events(cfg.elastic.grace_s, clock(), granted, job_counter, workers):
            if isinstance(ev, CapacityGranted) and not regrant:
                executor.counters.grows += 1
            elif isinstance(ev, CapacityReclaimed):
                executor.counters.reclaims += 1
            await queue.put(ev)

    async def replay_trace(replay: TraceReplay) -> None:
        """The real trace over the run's clock (resumed runs continue where it was)."""
        real = replay.load()
        current = -1
        while not pump_stop.is_set():
            run_s = clock()
            workers = replay_workers(real, replay, run_s)
            if workers != current:
                trace_s = real.start_s + run_s * replay.speedup  # where in the trace
                executor.log_event("trace", workers=workers, trace_s=trace_s)
                await set_elastic(workers, regrant=current < 0 and resume)
                current = workers
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pump_stop.wait(), replay.poll_s)

    tlog = TrajectoryLog(run_dir)
    batch = cfg.run.num_groups * cfg.run.group_size

    def record_turn(step: int, traj: Trajectory) -> None:
        tlog.record(step, traj)
        if on_progress is not None:
            on_progress(step, traj, batch, executor)

    pump_task = asyncio.create_task(pump())
    watch_task = None
    tasks_to_cancel: list[asyncio.Task[Any]] = []
    try:
        if pool is not None:
            if resume:  # the dead master's elastic jobs: cancelled, granted afresh
                await pool.cancel_leftovers()
            watch_task = asyncio.create_task(pool.watch(pump_stop))
        await asyncio.gather(*[executor.add_overlap_process(s) for s in overlap_sets])
        controller.register_training(train_gpus, overlap_gpu_sets=overlap_sets)
        controller.grant_reserved([(f"rsv:{i}",) for i in range(cfg.workers.reserved_rollout)])
        executor.sync_router()
        save_state(first_step, "running")
        ahead = cfg.run.max_staleness >= 1  # rollout k+1 runs while step k trains
        if cfg.elastic.replay.enabled:  # after the base workers are registered
            tasks_to_cancel.append(asyncio.create_task(replay_trace(cfg.elastic.replay)))

        async def rollout_step(step: int) -> _Rollout:
            if step in trace and not trace[step].after_s:
                await apply_trace(step, trace[step])
            elif step in trace:
                executor._spawn(apply_trace(step, trace[step]))
            borrowed_before = len(executor.counters.activation_s)
            moved_before = executor.counters.moved_turns
            journaled = tlog.load(step)  # a resumed step (two with the rollout ahead)
            start_config, predicted = _serving_prediction(controller)
            t0 = time.perf_counter()
            trajectories = await rollout_batch(
                router,
                make,
                chat,
                rollout,
                step=step,
                on_turn=functools.partial(record_turn, step),
                journaled=journaled,
            )
            rollout_s = time.perf_counter() - t0
            iterations = []
            for client in executor.serving().values():
                with contextlib.suppress(Exception):
                    iterations.extend(await client.telemetry())
            slots = {f"s{w.slot_id}": w.slot_id for w in executor.workers.values() if w.slot_id}
            roles = {
                f"s{w.slot_id}": w.role
                for w in executor.workers.values()
                if w.slot_id is not None and w.role is not None
            }
            activated = executor.counters.activation_s[borrowed_before:]
            # an activation may still be in progress (it lands in a later step's record)
            borrowed = bool(activated) or executor.activating_overlap()
            await queue.put(
                StepTelemetry(
                    step,
                    tuple(tracker_turns(trajectories, slots, roles)),
                    tuple(iterations),
                    rollout_s=rollout_s,
                    batch_size=len(trajectories),
                    borrowed=borrowed,
                    activation_s=activated[-1] if activated else 0.0,
                    deactivation_s=(
                        executor.counters.deactivation_s[-1]
                        if executor.counters.deactivation_s
                        else 0.0
                    ),
                )
            )
            return _Rollout(
                trajectories,
                rollout_s,
                {k: str(v) for k, v in sorted(roles.items())},
                borrowed,
                executor.counters.moved_turns - moved_before,
                len(journaled),
                sum(t.num_generated() for t in journaled.values()),
                predicted,
                start_config,
            )

        async def train_step(step: int, trajectories: list[Trajectory]) -> tuple[Any, float, float]:
            """Training Begin (borrowed GPUs come back), GRPO, snapshot: (stats, train_s,
            return latency)."""
            executor.training_started.clear()
            t_begin = time.perf_counter()
            await queue.put(TrainingBegin(step))
            await executor.training_started.wait()
            return_latency = time.perf_counter() - t_begin
            in_service = [
                s.slot_id
                for s in controller.table.overlap_workers()
                if s.status is not Status.INACTIVE
            ]
            if in_service:
                raise RuntimeError(
                    f"training step {step} started while overlap slots "
                    f"{in_service} still serve rollout"
                )
            executor.counters.return_latency_s.append(return_latency)
            t1 = time.perf_counter()
            stats = await asyncio.to_thread(trainer.train_step, trajectories)
            train_s = time.perf_counter() - t1
            await asyncio.to_thread(trainer.save_snapshot, snapshots)
            _prune_snapshots(snapshots, keep=2)
            return stats, train_s, return_latency

        async def publish(version: int) -> float:
            async with executor.weights_lock:
                serving = executor.serving()
                if set(serving) != set(sync.members):
                    await sync.form(serving)
                return await sync.publish(trainer.state_dict(), version)

        def record(step: int, done: _Rollout, stats: Any, train_s: float, ret_s: float) -> None:
            """Step ``step`` is trained and snapshotted: its metrics line and the journal
            (a master killed from here on resumes at the next step)."""
            generated = sum(t.num_generated() for t in done.trajectories)
            m = StepMetrics(
                step=step,
                t_s=round(clock(), 2),
                rollout_s=round(done.rollout_s, 3),
                train_s=round(train_s, 3),
                sync_s=round(last_sync_s, 3),
                return_latency_s=round(ret_s, 3),
                generated_tokens=generated,
                tokens_per_s=round((generated - done.resumed_tokens) / done.rollout_s, 1),
                mean_reward=round(stats.mean_reward, 4),
                version=stats.version,
                roles=done.roles,
                elastic_workers=elastic_workers(),
                borrowed=done.borrowed,
                moved_turns=done.moved_turns,
                trajectories=sum(1 for t in done.trajectories if t.done and t.reward is not None),
                resumed=done.resumed,
                predicted_s=round(done.predicted_s, 3),
                config=done.config,
                max_staleness=stats.max_staleness,
            )
            nonlocal recorded_version
            recorded_version = stats.version
            metrics.append(m)
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(asdict(m)) + "\n")
            save_state(step + 1, "running")
            if on_step is not None:
                on_step(m)

        pending: asyncio.Task[_Rollout] | None = None
        last_sync_s = 0.0  # the latest weight broadcast (sync_s in the metrics)
        for step in range(first_step, cfg.run.steps):
            done = await pending if pending is not None else await rollout_step(step)
            pending = None
            if ahead and step + 1 < cfg.run.steps:
                # the next batch is generated by the current weights while this one trains
                # (staleness 1); the new weights go out between the two rollouts, never
                # into a generation in flight
                pending = asyncio.create_task(rollout_step(step + 1))
                tasks_to_cancel.append(pending)
            stats, train_s, return_latency = await train_step(step, done.trajectories)
            if pending is None:  # synchronous: publish, then the step is done
                last_sync_s = await publish(stats.version)
                record(step, done, stats, train_s, return_latency)
                await queue.put(TrainingFinished(step))
            else:  # done at its snapshot; its weights go out once the next rollout ends
                record(step, done, stats, train_s, return_latency)
                await queue.put(TrainingFinished(step))  # training GPUs may be lent again
                await asyncio.wait({pending})
                last_sync_s = await publish(stats.version)
        # let running starts / stops finish and their reports reach the controller, so a
        # reclaimed job is handed back before the run ends
        if executor.tasks:
            await asyncio.wait(set(executor.tasks), timeout=120)
        await asyncio.sleep(0.3)  # the pump applies what those tasks queued
    except BaseException:
        with contextlib.suppress(Exception):
            save_state(metrics[-1].step + 1 if metrics else first_step, "failed")
        raise
    finally:
        for task in tasks_to_cancel:  # a rollout running ahead of a failed step
            task.cancel()
        tlog.close()
        pump_stop.set()
        with contextlib.suppress(Exception):
            await pump_task
        if watch_task is not None:
            with contextlib.suppress(Exception):
                await watch_task
        await executor.close()
        if pool is not None:
            await pool.close()
    targets = [str(r.plan.target) for r in controller.history]
    update_counters()
    c = executor.counters
    summary = {
        "steps": len(metrics),
        "tokens_per_s": round(
            # tokens this run generated (a resumed step's journaled ones are not counted)
            sum(m.tokens_per_s * m.rollout_s for m in metrics)
            / max(1e-9, sum(m.rollout_s for m in metrics)),
            1,
        ),
        "reward_curve": [m.mean_reward for m in metrics],
        "targets": targets,
        "counters": asdict(c),
        "wall_s": round(clock(), 1),
        "toggle_cost_s": round(controller.toggle.estimate_s, 3),
        "profile": controller.profile.to_dict(),  # as refitted from the run's telemetry
    }
    if pool is not None:
        summary["slurm"] = {"jobs": pool.jobs, "preempting_jobs": pool.preemptors}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    save_state(cfg.run.steps, "finished")
    return summary


def _serving_prediction(controller: Controller) -> tuple[str, float]:
    """The configuration the controller has in service now (e.g. ``1P2D``; workers still
    joining included) and the tracker's predicted makespan for it."""
    roles = [s.role for s in controller.table.rollout_slots() if s.status in IN_SERVICE]
    n_p, n_d, n_c = (roles.count(r) for r in (Role.PREFILL, Role.DECODE, Role.COLOCATED))
    if n_p and n_d:
        return f"{n_p}P{n_d}D", predict(controller.profile, n_p, n_d, 0)
    n = max(1, n_c + n_p + n_d)
    return f"{n}C", predict(controller.profile, 0, 0, n)


def _read_metrics(run_dir: Path) -> list[StepMetrics]:
    out = []
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        with contextlib.suppress(TypeError):
            out.append(StepMetrics(**record))
    return out


def _write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def _prune_snapshots(root: Path, keep: int) -> None:
    """Weight snapshots are only for resuming: keep the newest ``keep``."""
    for old in sorted(root.glob("v[0-9]*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def format_step(m: StepMetrics) -> str:
    """One step's line of the run's log."""
    roles = " ".join(f"{k}={v[0].upper()}" for k, v in m.roles.items())
    return (
        f"step {m.step}: {m.tokens_per_s:.0f} tok/s, reward {m.mean_reward:.3f}, "
        f"rollout {m.rollout_s:.1f} s, train {m.train_s:.1f} s, return "
        f"{m.return_latency_s:.2f} s, elastic {m.elastic_workers}, "
        f"borrowed {'yes' if m.borrowed else 'no'}, moved turns {m.moved_turns}, "
        f"roles {roles}" + (f", resumed {m.resumed} trajectories" if m.resumed else "")
    )


def format_summary(summary: dict[str, Any]) -> str:
    c = summary["counters"]
    ret = c["return_latency_s"]
    lines = [
        f"steps {summary['steps']} in {summary['wall_s']} s; rollout {summary['tokens_per_s']} "
        "tokens/s",
        "reward per step: " + " ".join(f"{r:.3f}" for r in summary["reward_curve"]),
        f"elastic grows {c['grows']}, reclaims {c['reclaims']}; borrow cycles "
        f"{c['borrow_cycles']}; mode changes {c['mode_changes']}, ratio changes "
        f"{c['ratio_changes']}, role changes {c['role_changes']}; turns moved {c['moved_turns']}",
        "borrowed GPUs returned before every training step: "
        + ", ".join(f"{x:.2f} s" for x in ret),
        "targets: " + " -> ".join(_dedup(summary["targets"])),
    ]
    return "\n".join(lines)


def _dedup(items: list[str]) -> list[str]:
    return [x for i, x in enumerate(items) if i == 0 or items[i - 1] != x]
