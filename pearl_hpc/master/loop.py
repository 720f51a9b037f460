"""The master of ``pearl-hpc run``: rank 0 of the run's MPI world, one asyncio loop
around the controller (no torch model, no engine in this process).

    backend (trace, squeue, signals) ──CapacityGranted/Reclaimed──┐
    executor tasks ──WorkerReady/Released/Failed──────────────────┤──> queue ──> pump
    step pipeline ──StepTelemetry, TrainingBegin/Finished─────────┘              │
                                                                                 ▼
        Controller.handle(event) ──plan──> WorkerExecutor (engine ranks, router)
                 │                     └──> the members' role groups (partition event)
                 └── journal.json, events.jsonl (after every event)

    step pipeline ──TRAIN / PUBLISH / CATCH_UP──> trainer ranks (data-parallel GRPO;
                                                  trainer 0 broadcasts the weights)

The controller is called from the pump only (:meth:`MasterRun.decide_now`). A run
directory holds the journal (controller snapshot, counters, next step), the trainer's
checkpoints (every ``train.checkpoint_every`` steps), the trajectory log and the metrics;
``resume=True`` continues a run whose master died: the trainer from its newest
checkpoint and the recorded steps after it trained again from their logs, the tracker's
fitted profile and the counters from the journal, the step in progress from the
trajectory log (finished trajectories kept, unfinished ones resumed from their last
turn). Engine workers of the
dead master exit on their own (they watch their parent); elastic jobs on Slurm are
adopted, local elastic ranks offered again by the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar, cast

from pearl_hpc.comm.layout import ENGINE, TRAINER, TRAINERS, base_layout, domain_of
from pearl_hpc.comm.members import Members
from pearl_hpc.comm.membership import Member
from pearl_hpc.comm.mpi import MasterPlane
from pearl_hpc.config.files import REPO_CONFIGS, load_profile
from pearl_hpc.config.run import DashboardSettings, RunConfig
from pearl_hpc.core.controller import (
    Controller,
    EngineRankBack,
    Event,
    TrainersBack,
    TrainersLost,
    mode_changes,
)
from pearl_hpc.core.policies import prefill_locally
from pearl_hpc.core.table import IN_SERVICE, RoleTable
from pearl_hpc.core.types import Status
from pearl_hpc.core.window import run_end_s
from pearl_hpc.master.capacity import BackendContext, CapacityBackend
from pearl_hpc.master.dashboards import Dashboards
from pearl_hpc.master.executor import WorkerExecutor
from pearl_hpc.master.journal import TrajectoryLog
from pearl_hpc.master.records import (
    EventLog,
    StepMetrics,
    event_fields,
    read_metrics,
    rollout_summary,
    undone_switches,
)
from pearl_hpc.master.steps import StepPipeline, Workload
from pearl_hpc.master.trainer import RemoteTrainer, TrainerLost
from pearl_hpc.rollout.router import Router, RoutingTable
from pearl_hpc.rundir import RunDir, RunStatus, write_journal, write_lines

T = TypeVar("T")
BEAT_S = 0.01  # the loop's beat (_beat)
STALL_S = 1.0  # a gap between two beats this long is logged (loop_stalled)


def _run_delay_s() -> float:
    """Seconds this thread has waited for a CPU (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def run_master(
    cfg: RunConfig,
    run_dir: Path,
    plane: MasterPlane,
    make_backend: Callable[[BackendContext], CapacityBackend],
    *,
    model_dir: str,
    key: str,
    resume: bool = False,
    on_step: Callable[[StepMetrics], None] | None = None,
    on_progress: Callable[..., None] | None = None,
    started_s: float | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One training run (or its continuation, ``resume``) as rank 0 of the world whose
    master side is ``plane``, with the capacity backend ``make_backend`` builds (the
    entry picks it: :func:`pearl_hpc.backends.backend_factory`); returns the summary
    (also written to ``summary.json``). ``on_step`` sees each recorded step's metrics,
    ``on_progress(step, trajectory, batch_size, executor)`` each finished turn, ``say``
    a line per start-up phase (ranks up)."""
    master = MasterRun(
        cfg,
        run_dir,
        plane,
        make_backend,
        model_dir=model_dir,
        key=key,
        resume=resume,
        on_step=on_step,
        started_s=time.monotonic() if started_s is None else started_s,
        say=say,
    )
    return await master.run(on_progress)


def _freeze_start_objects() -> None:
    """What the start made (modules, the tokenizer, the members: ~300 k objects) lives as
    long as the master: out of the collector's reach from now, so a full collection during
    the steps scans only what they made (0.2-0.7 s of the loop's own time each, before; a
    step's trajectories are freed by reference counting). The one collection here runs
    before the loop's clock and beat start."""
    gc.collect()
    gc.freeze()


def _finite(x: float) -> float | None:
    """A time for a JSON record: None when not known (inf)."""
    return round(x, 1) if math.isfinite(x) else None


async def _unless_failed(work: Awaitable[T], guard: asyncio.Task[None]) -> T:
    """Run ``work`` to its end (its result), unless ``guard`` (a task that should
    outlive it) fails first: then ``work`` is cancelled and the guard's error raised."""
    task = asyncio.ensure_future(work)
    await asyncio.wait({task, guard}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        guard.result()  # its error (a guard that ended cleanly: the work was cut short)
        raise RuntimeError("the members' poll ended before the run")
    return task.result()


class MasterRun:
    """The master's state for one run; :meth:`run` reads top to bottom."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        plane: MasterPlane,
        make_backend: Callable[[BackendContext], CapacityBackend],
        *,
        model_dir: str,
        key: str,
        resume: bool,
        on_step: Callable[[StepMetrics], None] | None,
        started_s: float,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.make_backend = make_backend
        self.run_dir = run_dir
        self.paths = RunDir(run_dir)
        self.plane = plane
        self.started_s = started_s  # when this rank's process began (time.monotonic)
        self.model_dir = model_dir
        self.key = key
        self.resume = resume
        self.on_step = on_step
        self.say = say
        self.state = self.paths.read_state() if resume else None
        self._t_start = time.monotonic()
        self._offset_s = float(self.state["t_s"]) if self.state else 0.0  # across masters
        self.events = EventLog(self.paths.events, self.clock)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.metrics: list[StepMetrics] = []
        self._loop_gap_s = 0.0  # the longest gap between the loop's beats since a record
        self._loop_own_s = 0.0  # ... less the time its thread waited for a CPU
        self.first_step = int(self.state["next_step"]) if self.state else 0
        self.recorded_version = 0  # weights of the steps recorded so far
        self._last_table: list[list[Any]] = []
        self._pump_stop = asyncio.Event()
        self._demand = -1  # the elastic workers last asked of the backend
        self._registered = False  # the base engine ranks' first launches registered
        self._lent = False  # an overlap engine holds a trainer's GPU (the mark; none yet)
        self.paths.trainer_gpus_lent.unlink(missing_ok=True)  # (a previous world's)
        config = json.loads(json.dumps(asdict(cfg), default=str))
        self.dashboards = Dashboards(cfg.dashboards, run_dir, cfg.name, config)

    def clock(self) -> float:
        """Run time: continues across masters of the same run."""
        return self._offset_s + time.monotonic() - self._t_start

    async def run(self, on_progress: Callable[..., None] | None = None) -> dict[str, Any]:
        cfg = self.cfg
        # 1. the members joined: trainer ranks (their resumed version) and engine ranks
        #    (their sockets)
        self.members = self._members_in()
        self.trainer = RemoteTrainer(self.members)
        # the weights of the recorded steps (the trainer may resume an older checkpoint:
        # the steps after it are trained again from their logs)
        self.recorded_version = int(self.state["version"]) if self.state else 0
        # 2. the rollout workload (tokenizer, environment)
        work = self._build_workload()
        _freeze_start_objects()
        self._t_start = time.monotonic()  # the run's clock starts with its world up
        self.events("clock", wall=round(time.time(), 3))  # to line up outside logs
        # 3. the capacity backend, the controller and its executor (one role table)
        self.backend = self.make_backend(self._backend_context())
        table = RoleTable()
        self.router = Router(
            RoutingTable(local_prefill=self._prefill_locally if cfg.policy.local_prefill else None),
            wait_for_workers_s=600,
            on_failure=lambda worker_id, reason: executor.router_failed(worker_id, reason),
        )
        self.executor = executor = WorkerExecutor(
            self.queue, self.router, self.trainer, self.backend, self.events, self.key, table,
            rank_failed=lambda member_id: self.members.fail(member_id, "its engine died"),
        )  # fmt: skip
        self.controller = controller = Controller(
            self._profile(),
            executor,
            policy=cfg.policy,
            clock=self.clock,
            table=table,
            check_invariants=True,
        )
        # 4. what a dead master left: tracker, toggle estimate, counters, metrics
        self._restore()
        # 5. the pump, the members' reports, the trace
        pump_task = asyncio.create_task(self._pump())
        poll_task = asyncio.create_task(self.members.poll_forever(self._pump_stop))
        beat_task = asyncio.create_task(self._beat())
        tlog = TrajectoryLog(self.run_dir)
        pipeline = StepPipeline(
            cfg.run,
            controller=controller,
            executor=executor,
            router=self.router,
            trainer=self.trainer,
            queue=self.queue,
            backend=self.backend,
            tlog=tlog,
            work=work,
            clock=self.clock,
            on_recorded=self._on_recorded,
            events=self.events,
            checkpoint_every=cfg.train.checkpoint_every,
            export_every=cfg.train.export_every,
            on_progress=on_progress,
        )
        replay_task = None
        warned = self._on_warning_signal()
        try:
            await self.backend.start()
            await self._register_base_workers()
            self._request_capacity()
            self.save_state(self.first_step, RunStatus.RUNNING)
            # what the backend makes available over time (after the base workers are in)
            replay_task = asyncio.create_task(self.backend.follow_trace(self._pump_stop))
            # 6. the steps, the last checkpoint, the workers settled
            stopped = await self._run_steps(pipeline, poll_task, executor)
        except BaseException:
            with contextlib.suppress(Exception):
                self.save_state(self._next_step(), RunStatus.FAILED)
            raise
        finally:
            # 7. everything stops: rollouts ahead, the trace, the pump, engines, jobs
            warned()
            pipeline.cancel()
            if replay_task is not None:
                replay_task.cancel()
            tlog.close()
            self.dashboards.close()
            self._pump_stop.set()
            pump_task.cancel()
            beat_task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await pump_task
            with contextlib.suppress(Exception):
                await poll_task
            await executor.close()
            self.paths.trainer_gpus_lent.unlink(missing_ok=True)  # (its engines stopped)
            self.members.leave_all()  # elastic ranks leave the world before their jobs end
            await self.backend.close()
        # 8. the summary; the members leave the world
        summary = self._finish() if not stopped else self._stopped()
        self.members.shutdown()
        return summary

    def _members_in(self) -> Members:
        """The control plane's members once every base rank joined (the trainer ranks'
        launch and each engine rank's; blocking: before the loop serves anything)."""
        members = Members(
            self.plane,
            self.events,
            roles=self._member_roles,
            on_failed=self._member_failed,
            on_joined=self._member_joined,
            heartbeat_timeout_s=self.cfg.run.heartbeat_timeout_s,
        )
        layout = base_layout(self.cfg.workers, self.cfg.layout)
        engines = sum(1 for r in layout if r.kind == ENGINE)
        trainers = sum(1 for r in layout if r.kind == TRAINER)
        members.start(since_s=self.started_s, say=self.say, trainers=trainers, engines=engines)
        return members

    async def _run_steps(
        self, pipeline: StepPipeline, guard: asyncio.Task[None], executor: WorkerExecutor
    ) -> bool:
        """The steps (a control plane that fails, ``guard``, ends them: nothing could go
        on; ``pearl-hpc cancel`` stops them), then the last step's checkpoint complete
        before the end and, unless stopped, the workers settled; True when stopped."""
        stopped = await _unless_failed(self._steps_or_stop(pipeline), guard)
        while True:  # (trainer ranks lost at the end: the new ones trained up to it first)
            try:
                await self.trainer.save()
                break
            except TrainerLost:
                await pipeline.publish(self.recorded_version)
        if not stopped:
            await self._settle(executor)
        return stopped

    async def _steps_or_stop(self, pipeline: StepPipeline) -> bool:
        """The steps to the end, or until ``pearl-hpc cancel`` asks (``RUN_DIR/stop``,
        looked for every second): then the step in flight is cut (its logged turns are
        kept for a resume) and True returned."""
        steps = asyncio.ensure_future(pipeline.run(self.first_step))
        while not steps.done():
            await asyncio.wait({steps}, timeout=1.0)
            if not steps.done() and self.paths.stop_request.exists():
                self.events("stop_requested", step=self._next_step())
                steps.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await steps
                return True
        steps.result()
        return False

    def _stopped(self) -> dict[str, Any]:
        """The journal's ``stopped`` (``--resume`` continues from it)."""
        self._count()
        self.save_state(self._next_step(), RunStatus.STOPPED)
        return {"stopped": True, "steps": len(self.metrics), "next_step": self._next_step()}

    async def _settle(self, executor: WorkerExecutor, timeout_s: float = 120.0) -> None:
        """Let running starts / stops finish and their reports reach the controller until
        none is left (a report can start another: the last step's end borrows the overlap
        GPUs again), so a reclaimed job is handed back and the journal's table is the
        workers' last state, no slot left joining."""
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.sleep(0.3)  # the pump applies what the tasks queued
            tasks = set(executor.tasks)
            left_s = deadline - time.monotonic()
            if not tasks or left_s <= 0:
                break
            await asyncio.wait(tasks, timeout=left_s)

    # ------------------------------------------------------------------ setup
    def _build_workload(self) -> Workload:
        from transformers import AutoTokenizer

        from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig
        from pearl_hpc.rollout.envs.registry import environment
        from pearl_hpc.rollout.tasks import load_tasks

        cfg = self.cfg
        chat = ChatFormat(cast(Any, AutoTokenizer.from_pretrained(self.model_dir)))
        rollout = RolloutConfig(
            num_groups=cfg.run.num_groups,
            group_size=cfg.run.group_size,
            max_tokens_per_turn=cfg.run.max_tokens_per_turn,
            max_context_tokens=cfg.run.max_context_tokens,
            temperature=cfg.run.temperature,
            seed=cfg.run.seed,
            record_logprobs=cfg.train.record_logprobs,
            env_timeout_s=cfg.run.env_timeout_s,
        )
        tasks = load_tasks(cfg.run)
        return Workload(chat, rollout, functools.partial(environment, cfg.run), tasks)

    def _profile(self) -> Any:
        path = Path(self.cfg.profile)
        return load_profile(path if path.is_absolute() else REPO_CONFIGS / path)

    def _backend_context(self) -> BackendContext:
        return BackendContext(
            cfg=self.cfg,
            run_dir=self.run_dir,
            model_dir=self.model_dir,
            members=self.members,
            queue=self.queue,
            clock=self.clock,
            on_event=lambda kind, fields: self.events(kind, **fields),
            decide_now=self.decide_now,
            first_step=self.first_step,
            resume=self.resume,
        )

    def _on_warning_signal(self) -> Callable[[], object]:
        """Slurm's warning before the job's time limit or a preemption (``--signal``
        USR2): the trainer ranks checkpoint the current version at once (after a step in
        flight), so a resume replays nothing. Returns the handler's removal."""
        loop = asyncio.get_running_loop()
        saves: set[asyncio.Task[None]] = set()

        async def save() -> None:
            self.events("signal", signal="USR2", version=self.trainer.version)
            try:
                await self.trainer.save()
            except Exception as exc:  # the run goes on; the journal still has the steps
                self.events("checkpoint_failed", error=f"{type(exc).__name__}: {exc}")

        def on_signal() -> None:
            if not saves:  # one save at a time
                task = asyncio.create_task(save())
                saves.add(task)
                task.add_done_callback(saves.discard)

        loop.add_signal_handler(signal.SIGUSR2, on_signal)
        return lambda: loop.remove_signal_handler(signal.SIGUSR2)

    def _prefill_locally(self, uncached: int, prompt: int, decoding: int) -> bool:
        """``policy.local_prefill``'s rule, on the profile as the tracker refits it."""
        return prefill_locally(self.controller.profile, uncached, prompt, decoding)

    def _member_failed(self, member: Member) -> None:
        """A member declared failed: its engine slot (if any) is replaced; a failure
        domain's launch is marked lost (its launcher ends it and starts it again). A
        trainer rank's loss is every trainer rank's: they wait in each other's
        collectives."""
        if hasattr(self, "executor"):  # (else it failed while the world started)
            self.executor.member_failed(member.member_id, "rank failed")
        domain = domain_of(member.group)
        if domain is None:
            return
        self.paths.domain_note(member.group, "lost").touch()
        trainer = getattr(self, "trainer", None)
        if domain[0] == TRAINERS and trainer is not None and member.member_id in trainer.ranks:
            if trainer.ready.is_set():  # (once a loss: its other ranks fail next)
                trainer.lost()
                self.events("trainers_lost", group=member.group, member=member.member_id)
                self.queue.put_nowait(TrainersLost())  # their GPUs back before they load
            for other in self.members.membership.group(member.group):
                self.members.fail(other.member_id, "a trainer rank of its launch failed")

    def _member_joined(self, group: str) -> None:
        """A failure domain started again after a loss joined. Trainer ranks: the
        trainer's ranks from now (the step pipeline trains the steps they lack again).
        An engine rank: the member it replaces failed (if the master had not declared it
        yet), its engine registered, its GPUs back to the controller. (The first launches
        are registered at start.)"""
        domain = domain_of(group)
        if domain is None or not self._registered:
            return
        if domain[0] == TRAINERS:  # the old ranks (if not yet declared failed) fail first
            for member_id in self.trainer.ranks:
                self.members.fail(member_id, "its trainer ranks were started again")
            ranks = [m.member_id for m in self.members.membership.group(group)]
            self.trainer.adopt(ranks)
            self.events("trainers_back", group=group, version=self.trainer.version)
            self.queue.put_nowait(TrainersBack())
            return
        for member_id in self._older_launches():
            self.members.fail(member_id, "its rank was started again")
        for member in self.members.membership.group(group):
            self.executor.spawn(self._engine_back(member.member_id))

    def _older_launches(self) -> list[str]:
        """Live base engine members of a rank with a newer launch joined (its relaunch
        came in before its death was declared)."""
        newest: dict[str, tuple[int, str]] = {}
        older = []
        for member_id in self.members.base_engines():
            domain = domain_of(self.members.membership.members[member_id].group)
            assert domain is not None
            name, attempt = domain
            if name in newest and newest[name][0] > attempt:
                older.append(member_id)
                continue
            if name in newest:
                older.append(newest[name][1])
            newest[name] = (attempt, member_id)
        return older

    async def _engine_back(self, member_id: str) -> None:
        hello = self.members.hellos[member_id]
        overlap = self._overlap_sets()
        try:
            await self.executor.add_engine_rank(
                member_id, hello.gpu_ids, (hello.host, hello.port), overlap=hello.gpu_ids in overlap
            )
        except Exception as exc:  # its socket is gone already: it fails by heartbeat
            self.events("engine_back_failed", member=member_id, error=str(exc)[:200])
            return
        self.events("engine_back", member=member_id, gpus=list(hello.gpu_ids))
        await self.queue.put(EngineRankBack(hello.gpu_ids, overlap=hello.gpu_ids in overlap))

    def _overlap_sets(self) -> set[tuple[str, ...]]:
        return {r.gpu_ids for r in base_layout(self.cfg.workers, self.cfg.layout) if r.overlap}

    def _restore(self) -> None:
        """A resumed master continues the dead one's tracker, toggle estimate, counters
        and metrics (steps after the journal's next step are dropped)."""
        counters = self.executor.counters
        if self.state is not None:
            self.controller.tracker.restore(self.state["controller"]["tracker"])
            self.controller.toggle.restore(self.state["controller"]["toggle"])
            counters.load_state_dict(self.state["counters"])
            # one return latency per training step: the steps the trainer's checkpoint
            # holds (the others are trained again, from their logs or rolled out)
            counters.return_latency_s = counters.return_latency_s[: self.trainer.version]
            self.metrics = [m for m in read_metrics(self.run_dir) if m.step < self.first_step]
            write_lines(self.paths.metrics, [json.dumps(asdict(m)) for m in self.metrics])
            self.events(
                "resumed", step=self.first_step, version=self.recorded_version,
                checkpoint=self.trainer.version,
            )  # fmt: skip
            self._expect_end()
        # counters a previous master journaled; this master's history adds to them
        self._before_changes = (
            counters.mode_changes, counters.ratio_changes, counters.undone_switches,
        )  # fmt: skip
        self._before_capacity = (counters.grows, counters.reclaims)

    async def _register_base_workers(self) -> None:
        """The training GPUs (with their overlap engines, released) and the reserved
        rollout workers: the engine ranks of the world, connected, released."""
        layout = base_layout(self.cfg.workers, self.cfg.layout)
        overlap = self._overlap_sets()
        for member_id in self._older_launches():
            self.members.fail(member_id, "its rank was started again")
        for member_id in self.members.base_engines():
            hello = self.members.hellos[member_id]
            await self.executor.add_engine_rank(
                member_id, hello.gpu_ids, (hello.host, hello.port), overlap=hello.gpu_ids in overlap
            )
        train_gpus = tuple(g for r in layout if r.kind == TRAINER for g in r.gpu_ids)
        overlap_sets = [r.gpu_ids for r in layout if r.overlap]
        self.controller.register_training(train_gpus, overlap_gpu_sets=overlap_sets)
        self.controller.grant_reserved(
            [r.gpu_ids for r in layout if r.kind == ENGINE and not r.overlap]
        )
        self.executor.sync_router()
        self._registered = True

    # ------------------------------------------------------------------ the pump
    async def _pump(self) -> None:
        """Decide on the queued events as they come, until cancelled. It awaits
        ``queue.get()`` in its own task: a getter task of its own (``wait_for``) takes
        an event out as it arrives and holds it while the backend's ``decide_now``
        (before a rollout starts) decides the events queued after it, out of order."""
        while True:
            event = await self.queue.get()
            self.decide_now(event)
            self.save_state(self._next_step(), RunStatus.RUNNING)

    def decide_now(self, first: Event | None = None) -> None:
        """Apply ``first`` and every queued event, in order, to the controller (one
        decision for those that arrived together: :meth:`Controller.handle_all`), then
        make the router follow the table (and log the table when it changed: the role
        timeline of the report)."""
        log_event = self.events
        events = [first] if first is not None else []
        while not self.queue.empty():
            events.append(self.queue.get_nowait())
        for event in events:
            log_event("event", event=type(event).__name__, **event_fields(event))
        results = self.controller.handle_all(events)
        for result in results:
            log_event(
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
        self.executor.sync_router()
        self._mark_lent()
        if results:  # the members' role groups after the plan (logged when they change)
            self.members.partition()
        self._request_capacity()
        table = [
            [s.slot_id, str(s.role), str(s.status), str(s.zone)]
            for s in self.controller.table.rollout_slots()
        ]
        if table != self._last_table:
            self._last_table = table
            log_event("table", slots=table)

    def _mark_lent(self) -> None:
        """``domains/trainers.lent`` while an overlap worker is starting, serving or
        leaving (set before its start runs, gone once it slept): trainer ranks started
        again after a loss wait for it to go before loading onto their GPUs."""
        lent = any(s.status is not Status.INACTIVE for s in self.controller.table.overlap_workers())
        if lent == self._lent:
            return
        self._lent = lent
        mark = self.paths.trainer_gpus_lent
        if lent:
            mark.parent.mkdir(mode=0o700, exist_ok=True)
            mark.touch()
        else:
            mark.unlink(missing_ok=True)
        self.events("trainer_gpus", lent=lent)

    def _request_capacity(self) -> None:
        """The backend keeps what the controller's demand says is worth requesting (the
        expansion gate at request time); logged when it changes."""
        demand = self.controller.elastic_demand(
            self.cfg.elastic.max_workers, starts_in_s=self.backend.starts_in_s()
        )
        if demand.workers != self._demand:
            self._demand = demand.workers
            self.events(
                "demand",
                workers=demand.workers,
                window_s=round(demand.window_s, 1),
                starts_in_s=round(demand.starts_in_s),
                run_end_s=_finite(self.controller.run_end_s),
                reason=demand.reason[:160],
            )
            self.backend.want(demand.workers)

    def _expect_end(self) -> None:
        """The run's predicted end, from the pace of its recorded steps, for the
        expansion gate (capacity is worth nothing after the run ends)."""
        left = self.cfg.run.steps - self._next_step()
        self.controller.expect_end(run_end_s([m.t_s for m in self.metrics], left))

    def _member_roles(self) -> dict[str, str]:
        """Each member's group after the plan: trainer ranks ``training``, an engine rank
        the role of the slot in service on its GPUs (``idle`` when there is none)."""
        in_service = {
            s.gpu_ids: str(s.effective_role)
            for s in self.controller.table.rollout_slots()
            if s.status in IN_SERVICE
        }
        roles = {m: "training" for m in self.members.of_kind(TRAINER)}
        for member_id in self.members.of_kind(ENGINE):
            gpu_ids = self.members.hellos[member_id].gpu_ids
            roles[member_id] = in_service.get(gpu_ids, "idle")
        return roles

    # ------------------------------------------------------------------ records
    def _next_step(self) -> int:
        return self.metrics[-1].step + 1 if self.metrics else self.first_step

    async def _beat(self) -> None:
        """The loop's pulse: the longest gap between its turns goes into the next step's
        metrics, and the longest of those gaps less the time the loop's thread waited
        for a CPU (Linux's run delay: a machine with too few cores for the master, not
        the master's own work); a gap over ``STALL_S`` is an event."""
        last, waited = time.monotonic(), _run_delay_s()
        while True:
            await asyncio.sleep(BEAT_S)
            now, delay = time.monotonic(), _run_delay_s()
            gap, last = now - last, now
            own, waited = gap - (delay - waited), delay
            self._loop_gap_s = max(self._loop_gap_s, gap)
            self._loop_own_s = max(self._loop_own_s, own)
            if gap > STALL_S:
                self.events("loop_stalled", s=round(gap, 3), own_s=round(own, 3))

    def _on_recorded(self, m: StepMetrics) -> None:
        m.loop_gap_s, self._loop_gap_s = round(self._loop_gap_s, 4), 0.0
        m.loop_own_s, self._loop_own_s = round(self._loop_own_s, 4), 0.0
        self.recorded_version = m.version
        self.metrics.append(m)
        with self.paths.metrics.open("a") as f:
            f.write(json.dumps(asdict(m)) + "\n")
        self.save_state(m.step + 1, RunStatus.RUNNING)
        self._expect_end()
        self._request_capacity()
        try:
            self.dashboards.log(m)
        except Exception as e:
            self.events("dashboards_failed", error=f"{type(e).__name__}: {e}")
            self.dashboards.close()
            self.dashboards = Dashboards(DashboardSettings(), self.run_dir, self.cfg.name, {})
        if self.on_step is not None:
            self.on_step(m)

    def _count(self) -> None:
        """Mode / ratio changes (and mode switches undone) from the controller's
        history, and capacity events, added to what a previous master counted."""
        switches, ratios = mode_changes(self.controller.history)
        c = self.executor.counters
        c.mode_changes = self._before_changes[0] + len(switches)
        c.ratio_changes = self._before_changes[1] + ratios
        c.undone_switches = self._before_changes[2] + undone_switches(
            switches, [m.t_s for m in self.metrics if m.step >= self.first_step]
        )
        c.grows = self._before_capacity[0] + self.backend.counts["granted"]
        c.reclaims = self._before_capacity[1] + self.backend.counts["reclaimed"]

    def save_state(self, next_step: int, status: RunStatus) -> None:
        """The journal: what a restarted master needs, and what ``status`` shows.

        NOTE: the journal's contract. A step is *recorded* when the journal says so
        (``next_step`` past it, ``version`` its weights), written after the step's
        metrics line; its trajectory log is then complete. A step is *checkpointed*
        when a complete checkpoint of its weights exists (``checkpoints/vN``, every
        ``train.checkpoint_every`` steps and after the last, written while the run goes
        on). A resumed master discards whatever is newer than the journal (checkpoints
        of steps trained but not recorded, incomplete checkpoints:
        ``RunDir.drop_checkpoints``; metrics lines past ``next_step``: :meth:`_restore`),
        the trainer loads the newest checkpoint (version v), and the recorded steps
        v..next_step-1 are *replayed*: trained again from their logs, not rolled out
        (``StepPipeline.replay``); the step in progress keeps its finished trajectories
        and resumes the others. The file is replaced atomically, so a crash leaves the
        old journal or the new one."""
        self._count()
        write_journal(
            self.paths.journal,
            {
                "status": status,
                "pid": os.getpid(),
                "next_step": next_step,
                "steps": self.cfg.run.steps,
                "version": self.recorded_version,
                "t_s": round(self.clock(), 3),
                "elastic_workers": self.backend.live_workers(),
                "elastic_jobs": self.backend.describe(),
                "counters": asdict(self.executor.counters),
                "controller": self.controller.snapshot(),
            },
            time_s=self.clock(),
        )

    def _finish(self) -> dict[str, Any]:
        """``summary.json`` and the journal's ``finished``."""
        metrics = self.metrics
        self._count()
        summary: dict[str, Any] = {
            "steps": len(metrics),
            "tokens_per_s": round(
                # tokens this run generated (a resumed step's journaled ones are not counted)
                sum(m.tokens_per_s * m.rollout_s for m in metrics)
                / max(1e-9, sum(m.rollout_s for m in metrics)),
                1,
            ),
            **rollout_summary(metrics),
            "reward_curve": [m.mean_reward for m in metrics],
            "targets": [str(r.plan.target) for r in self.controller.history],
            "counters": asdict(self.executor.counters),
            "wall_s": round(self.clock(), 1),
            "toggle_cost_s": round(self.controller.toggle.estimate_s, 3),
            "profile": self.controller.profile.to_dict(),  # as refitted from the telemetry
        }
        backend = self.backend.summary()
        if backend is not None:
            summary["slurm"] = backend
        self.paths.summary.write_text(json.dumps(summary, indent=1))
        self.save_state(self.cfg.run.steps, RunStatus.FINISHED)
        return summary
