"""The master rank on a Slurm cluster: the controller, its Slurm capacity manager and
the MPI control plane, in one loop.

    squeue ──> SlurmCapacity ──CapacityGranted/Reclaimed──┐
    joins/reports ──> MasterPlane ──WorkerReady/Released/Failed──> Controller.handle
    the workload (no-op until issue 5) ──TrainingBegin/Finished──┘        │
                                                                          v
       Executor calls (start_workers, change_roles, ...) ──> commands over MPI,
       sbatch / scancel, Comm.Split after every applied plan

The master is the controller's :class:`~pearl_hpc.core.controller.Executor`. Every
event goes to ``events.jsonl`` and the controller's state to ``journal.json`` in the
run directory; ``latency.json`` keeps each elastic component's milestones and
``summary.json`` the run's outcome.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.cluster import ClusterConfig
from pearl_hpc.comm.membership import Member, MemberState
from pearl_hpc.comm.messages import Kind, Op, Report
from pearl_hpc.comm.mpi import MasterPlane
from pearl_hpc.config import load_profile
from pearl_hpc.core.controller import (
    CapacityReclaimed,
    Controller,
    Event,
    TrainingBegin,
    TrainingFinished,
    WorkerFailed,
    WorkerReady,
    WorkerReleased,
)
from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.core.types import Role, Status
from pearl_hpc.master.journal import write_journal
from pearl_hpc.slurm.capacity import CapacityManager, ComponentState, SlurmCapacity
from pearl_hpc.slurm.client import SlurmClient, SlurmError
from pearl_hpc.slurm.scripts import JobSpec

log = logging.getLogger(__name__)

SUBMIT_RETRY_S = 5.0
TRANSIENT_SLURM_ERRORS = ("Unable to contact slurm controller", "Socket timed out", "no answer")
LEAVE_TIMEOUT_S = 15.0  # members that do not ack LEAVE by then are cancelled anyway


class SqueuePoller:
    """Runs ``squeue`` in a thread, so that a slow or unreachable slurmctld (squeue
    retries for ~9 s before failing) never stalls the master's loop.

    ``fork_lock`` is held while squeue runs: MPICH (ch4:ucx) crashed in ``Accept`` when a
    child forked after ``MPI_Init`` was alive meanwhile, so the master's join step takes
    the same lock."""

    def __init__(self, client: SlurmClient, run_tag: str, interval_s: float) -> None:
        self.client = client
        self.run_tag = run_tag
        self.interval_s = interval_s
        self._rows: dict[str, Any] | None = None
        self.not_before = 0.0
        self.fork_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="squeue", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with self.fork_lock:
                rows = self.client.poll(self.run_tag)
            with self._lock:
                if started >= self.not_before:
                    self._rows = rows
            self._stop.wait(self.interval_s)

    def latest(self) -> dict[str, Any] | None:
        """The newest answer not yet taken (None if there is none)."""
        with self._lock:
            rows, self._rows = self._rows, None
        return rows

    def invalidate(self) -> None:
        """A job was just submitted: answers from squeue runs begun before now would
        miss it (and make it look ended)."""
        with self._lock:
            self.not_before = time.monotonic()
            self._rows = None

    def stop(self) -> None:
        self._stop.set()


def _source_of(group: str) -> ElasticSource:
    job, _, component = group.partition("+")
    return ElasticSource(job, int(component or 0))


class Master:
    """Rank 0 of the base job. :meth:`run` returns the run's summary."""

    def __init__(
        self,
        cfg: ClusterConfig,
        run_dir: Path,
        run_tag: str,
        plane: MasterPlane,
        client: SlurmClient,
        *,
        worker_command: Callable[[ClusterConfig, Path], list[str]],
        rendezvous: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.run_tag = run_tag
        self.plane = plane
        self.clock = clock
        self.t0 = clock()
        self.worker_command = worker_command
        manager = CapacityManager(
            run_tag, pending_timeout_s=cfg.elastic.pending_timeout_s, grace_s=cfg.elastic.grace_s
        )
        self.capacity = SlurmCapacity(manager, client)
        self.squeue = SqueuePoller(client, run_tag, cfg.elastic.poll_s)
        self.controller = Controller(
            load_profile(cfg.profile_path()),
            self,
            policy=cfg.policy,
            clock=self.now,
            check_invariants=True,
        )
        self.slot_members: dict[int, list[str]] = {}
        self.pending: dict[int, WorkerAdd] = {}  # adds whose ranks have not joined yet
        self.awaiting: dict[int, tuple[str, int]] = {}  # command seq -> (what, slot/step)
        self.training_acks: set[str] = set()
        self.queue: list[Event] = []
        self.releasing: dict[str, tuple[ElasticSource, float]] = {}  # group -> (src, by)
        self.retry_submit: dict[int, float] = {}  # request index -> when to try again
        self.to_admit: list[str] = []  # joined groups waiting to enter the universe
        self.submitted: dict[int, str] = {}  # request index -> job id
        self.latency: dict[str, dict[str, Any]] = {}
        self.need_partition = False
        self.partitions: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.step = 0
        self.phase = "rollout"
        self.rollout_ends_s = 0.0
        self.stop_requested: int | None = None
        self._events = (run_dir / "events.jsonl").open("a")
        # The data plane's store runs in a child started before MPI (see launch.py);
        # torch stays out of this process. Workers resolve the backend setting.
        self.rendezvous: Any = rendezvous
        self.backend = cfg.run.data_plane

    def now(self) -> float:
        return self.clock() - self.t0

    # ================================================================== the loop
    def run(self) -> dict[str, Any]:
        for signum in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        try:
            base = self.plane.start_base()
            self._start_base(base)
            self._start_step()
            while self.step < self.cfg.run.steps and self.stop_requested is None:
                self._tick()
                time.sleep(0.01)
            return self._finish()
        except BaseException as exc:
            self._log("crashed", error=repr(exc))
            self._cancel_all()
            log.exception("master failed; elastic jobs cancelled, aborting the base job")
            self.plane.abort()
            raise

    def _cancel_all(self) -> None:
        """Cancel every job of this run still in squeue (best effort)."""
        for job_id in sorted({c.source.job_id for c in self.capacity.manager.live()}):
            try:
                self.capacity.client.cancel(job_id)
            except SlurmError as exc:
                self._log("error", during="scancel", message=str(exc))

    def _tick(self) -> None:
        now = self.now()
        if self.plane.joins_waiting():
            with self.squeue.fork_lock:  # no squeue child alive during Accept
                joined = self.plane.poll_joins()
            for group in joined:
                self._on_join(group, now)
        for report in self.plane.poll():
            self._on_report(report)
        for member in self.plane.overdue():
            self._on_silent(member)
        rows = self.squeue.latest()
        if rows is not None:  # a fresh squeue answer (or the last known state)
            actions = self.capacity.manager.observe(rows, now)
            for job_id, component in actions.cancel:  # pending too long
                self._log("pending_timeout", job_id=job_id)
                try:
                    self.capacity.client.cancel(job_id, component)
                except SlurmError as exc:
                    self._log("error", during="scancel", message=str(exc))
            for event in actions.events:
                self._note_capacity(event, now)
                self.queue.append(event)
            self._note_gone(now)
        for index, when in list(self.retry_submit.items()):
            if now >= when:
                del self.retry_submit[index]
                self._submit(index)
        self._drain_queue()
        self._finish_releases(now)
        self._admit_joined()
        if self.need_partition and not self.to_admit and self.plane.all_fresh():
            self._partition()
        if self.phase == "rollout" and now >= self.rollout_ends_s:
            self.phase = "training"
            self._handle(TrainingBegin(self.step))

    def _drain_queue(self) -> None:
        while self.queue:
            self._handle(self.queue.pop(0))

    def _handle(self, event: Event) -> None:
        self._log("event", type=type(event).__name__, **_plain(event))
        reconf = self.controller.handle(event)
        if reconf is not None:
            self.need_partition = True
            self._log(
                "reconfiguration",
                cause=reconf.cause,
                target=reconf.decision.target.spec(),
                reason=reconf.decision.reason,
                add=len(reconf.plan.add),
                remove=len(reconf.plan.remove),
                role_changes=len(reconf.plan.role_changes),
            )
        write_journal(
            self.run_dir / "journal.json",
            {"controller": self.controller.snapshot(), "step": self.step, "run_tag": self.run_tag},
            time_s=self.now(),
        )

    # ============================================================ the workload
    def _start_base(self, base: list[Member]) -> None:
        b = self.cfg.base
        gpw = b.gpus_per_worker
        for member in base:
            rank = member.link_rank
            member.gpu_ids = tuple(f"base:r{rank}:gpu{k}" for k in range(gpw))
        trainers = [m for m in base if 1 <= m.link_rank <= b.num_training_workers]
        reserved = [m for m in base if m.link_rank > b.num_training_workers]
        self.trainers = [m.member_id for m in trainers]
        overlap = [m.gpu_ids for m in trainers] if self.cfg.policy.borrowing != "none" else []
        self.controller.register_training(
            [g for m in trainers for g in m.gpu_ids], overlap_gpu_sets=overlap
        )
        for slot in self.controller.table.training_slots():
            self.slot_members[slot.slot_id] = list(self.trainers)
        self._log(
            "base",
            trainers=self.trainers,
            reserved=[m.member_id for m in reserved],
            master_pid=os.getpid(),
        )
        reconf = self.controller.grant_reserved([m.gpu_ids for m in reserved])
        if reconf is not None:
            self.need_partition = True

    def _start_step(self) -> None:
        self.phase = "rollout"
        self.rollout_ends_s = self.now() + self.cfg.run.rollout_s
        self._log("step", step=self.step)
        for i, request in enumerate(self.cfg.elastic.requests):
            if request.at_step == self.step:
                self._submit(i)
            for rel in request.release:
                if rel.at_step == self.step:
                    self._give_back(i, rel.component)

    def _submit(self, index: int) -> None:
        request = self.cfg.elastic.requests[index]
        spec = JobSpec(
            name="pearl-elastic",
            run_tag=self.run_tag,
            components=tuple(self.cfg.elastic_component(c) for c in request.components),
            command=self.worker_command(self.cfg, self.run_dir),
            signal=self.cfg.elastic.signal,
            output=str(self.run_dir / "elastic-%j.out"),
        )
        try:
            job_id = self.capacity.acquire(spec, self.cfg.base.gpus_per_worker, self.now())
            self.squeue.invalidate()
        except SlurmError as exc:
            transient = any(text in str(exc) for text in TRANSIENT_SLURM_ERRORS)
            self._log("error", during="submit", message=str(exc), retry=transient)
            if transient:  # slurmctld unreachable: try again shortly
                self.retry_submit[index] = self.now() + SUBMIT_RETRY_S
                log.warning("elastic request %d: %s; retrying in %g s", index, exc, SUBMIT_RETRY_S)
            else:
                self.errors.append(str(exc))
                log.error("elastic request %d not submitted: %s", index, exc)
            return
        self.submitted[index] = job_id
        for k in range(len(request.components)):
            self.latency[f"{job_id}+{k}"] = {"submitted": self.now()}
        self._log("submitted", request=index, job_id=job_id)

    def _give_back(self, index: int, component: int) -> None:
        job_id = self.submitted.get(index)
        if job_id is None:
            return
        source = ElasticSource(job_id, component)
        self.latency.setdefault(source.tag, {})["give_back"] = self.now()
        self._log("give_back", group=source.tag)
        self.queue.append(CapacityReclaimed(source, self.now() + self.cfg.elastic.grace_s))

    # ========================================================== plane events
    def _on_join(self, group: str, now: float) -> None:
        lat = self.latency.setdefault(group, {})
        lat["joined"] = now
        lat["accept_s"] = self.plane.timings.accept_s[-1]
        if group in self.releasing or self._source_gone(group):
            self.plane.leave(group)
            return
        self._log(
            "joined",
            group=group,
            members={m.member_id: m.info.get("pid") for m in self.plane.membership.group(group)},
        )
        self.to_admit.append(group)
        self._admit_joined()

    def _admit_joined(self) -> None:
        """Extend the universe with the joined groups, only while every member was heard
        very recently (a dead member would hang the collective call)."""
        while self.to_admit and self.plane.all_fresh(joining=self.to_admit[0]):
            group = self.to_admit.pop(0)
            if any(m.state is not MemberState.LINKED for m in self.plane.membership.group(group)):
                continue  # failed or left before it could be admitted
            self.latency.setdefault(group, {})["universe_s"] = self.plane.admit(group)
            self._bind_pending()

    def _bind_pending(self) -> None:
        for slot_id, add in list(self.pending.items()):
            if self._bind(slot_id, add.gpu_ids):
                del self.pending[slot_id]
                self._send_role(slot_id, add.role)
        self.need_partition = True

    def _source_gone(self, group: str) -> bool:
        comp = self.capacity.manager.components.get(group)
        return comp is not None and comp.state in (ComponentState.RELEASING, ComponentState.GONE)

    def _on_report(self, report: Report) -> None:
        if report.kind is Kind.SIGNAL:
            self._on_member_signal(report)
            return
        if report.kind is Kind.ERROR:
            self.errors.append(f"{report.member_id}: {report.args.get('message')}")
            self._log("error", member=report.member_id, message=report.args.get("message"))
            return
        if report.kind is not Kind.ACK:
            return
        what = self.awaiting.pop(report.seq, None)
        op = report.args.get("op")
        if op == Op.PARTITION:
            epoch = report.args.get("epoch")
            entry = next((p for p in self.partitions if p["epoch"] == epoch), None)
            if entry is not None:
                entry["acks"][report.member_id] = report.args.get("group_size")
                if "dataplane" in report.args:
                    entry["dataplane"][report.member_id] = report.args["dataplane"]
        if what is None:
            return
        kind, ident = what
        if kind == "ready":
            self.queue.append(WorkerReady(ident))
        elif kind == "released":
            self.slot_members.pop(ident, None)
            self.queue.append(WorkerReleased(ident))
        elif kind == "train":
            self.training_acks.discard(report.member_id)
            if not self.training_acks:
                self.queue.append(TrainingFinished(ident))
                self._drain_queue()
                self.step += 1
                if self.step < self.cfg.run.steps:
                    self._start_step()

    def _on_member_signal(self, report: Report) -> None:
        member = self.plane.membership.members.get(report.member_id)
        if member is None or member.group == "base":
            self._log("signal", member=report.member_id, base=True)
            return
        source = _source_of(member.group)
        self.latency.setdefault(member.group, {}).setdefault("signal", self.now())
        self._log(
            "signal", member=report.member_id, group=member.group, signum=report.args.get("signum")
        )
        event = self.capacity.manager.signalled(source, self.now())
        if event is not None:
            self.queue.append(event)

    def _on_silent(self, member: Member) -> None:
        self.failures.append({"member": member.member_id, "at": self.now()})
        self._log("failed", member=member.member_id, group=member.group)
        for slot_id, members in list(self.slot_members.items()):
            if member.member_id in members and self.controller.table.get(slot_id).status not in (
                Status.INACTIVE,
            ):
                if member.member_id in self.trainers:
                    continue  # training slots are not failed here (the base job's own)
                self.slot_members.pop(slot_id)
                self.queue.append(WorkerFailed(slot_id, f"{member.member_id} stopped answering"))
        if member.group != "base" and all(
            m.state in (MemberState.FAILED, MemberState.GONE)
            for m in self.plane.membership.group(member.group)
        ):
            self.plane.drop_group(member.group)
        self.need_partition = True

    # ========================================================= capacity events
    def _note_capacity(self, event: Any, now: float) -> None:
        tag = event.source.tag
        lat = self.latency.setdefault(tag, {})
        if isinstance(event, CapacityReclaimed):
            lat.setdefault("reclaimed", now)
        else:
            lat["running"] = now
            comp = self.capacity.manager.components[tag]
            lat["nodes"] = list(comp.nodes)
            self._log("granted", group=tag, nodes=list(comp.nodes), gpu_sets=len(event.gpu_sets))

    def _note_gone(self, now: float) -> None:
        for tag, comp in self.capacity.manager.components.items():
            lat = self.latency.setdefault(tag, {})
            if comp.state is ComponentState.GONE and "gone" not in lat:
                lat["gone"] = now
                self._log("gone", group=tag)

    def _finish_releases(self, now: float) -> None:
        for group, (source, by) in list(self.releasing.items()):
            members = self.plane.membership.group(group)
            left = all(m.state in (MemberState.GONE, MemberState.FAILED) for m in members)
            if left or now >= by:
                del self.releasing[group]
                self.latency.setdefault(group, {})["left"] = now
                self._cancel(source)

    def _cancel(self, source: ElasticSource) -> None:
        comp = self.capacity.manager.components.get(source.tag)
        if comp is not None and comp.state is not ComponentState.GONE:
            # a signalled (preempted) component is RELEASING already: cancel it anyway,
            # its GPUs are free now, before the grace time ends
            target = self.capacity.manager.release(source) or (
                self.capacity.manager.cancel_target(source)
            )
            job_id, component = target
            try:
                self.capacity.client.cancel(job_id, component)
            except SlurmError as exc:  # e.g. the job ended on its own meanwhile
                self._log("error", during="scancel", message=str(exc))
            scancel = job_id if component is None else f"{job_id}+{component}"
            self._log("cancelled", group=source.tag, scancel=scancel)
        self.latency.setdefault(source.tag, {})["cancelled"] = self.now()

    # ============================================================== executor
    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        for add in adds:
            if self._bind(add.slot_id, add.gpu_ids):
                self._send_role(add.slot_id, add.role)
            else:
                self.pending[add.slot_id] = add

    def admit(self, slot_ids: Sequence[int]) -> None:
        for slot_id in slot_ids:
            source = self.controller.table.get(slot_id).source
            if source is not None:
                self.latency.setdefault(source.tag, {}).setdefault("admitted", self.now())
        self._log("admitted", slots=list(slot_ids))
        self.need_partition = True

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        for slot_id, role in changes:
            if slot_id in self.pending:
                self.pending[slot_id] = dataclasses.replace(self.pending[slot_id], role=role)
            else:
                self._send_role(slot_id, role)

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        for slot_id in slot_ids:
            if slot_id in self.pending:  # never started: nothing to drain
                del self.pending[slot_id]
                self.queue.append(WorkerReleased(slot_id))
                continue
            for member_id in self._live(slot_id):
                seq = self.plane.send(member_id, Op.RELEASE, slot=slot_id)
                self.awaiting[seq] = ("released", slot_id)

    def start_training(self, step: int) -> None:
        self.training_acks = set(self.trainers)
        for member_id in self.trainers:
            seq = self.plane.send(member_id, Op.TRAIN, step=step, seconds=self.cfg.run.train_s)
            self.awaiting[seq] = ("train", step)

    def release_capacity(self, source: ElasticSource) -> None:
        leaving = self.plane.leave(source.tag)
        self.latency.setdefault(source.tag, {})["release"] = self.now()
        self._log("release", group=source.tag, members=[m.member_id for m in leaving])
        if leaving:
            self.releasing[source.tag] = (source, self.now() + LEAVE_TIMEOUT_S)
            self.need_partition = True
        else:
            self._cancel(source)

    # ================================================================ helpers
    def _bind(self, slot_id: int, gpu_ids: Sequence[str]) -> bool:
        wanted = set(gpu_ids)
        members = [
            m.member_id
            for m in self.plane.membership.live()
            if m.gpu_ids and set(m.gpu_ids) <= wanted and m.state is MemberState.MEMBER
        ]
        if not members:
            return False
        self.slot_members[slot_id] = members
        return True

    def _live(self, slot_id: int) -> list[str]:
        live = {m.member_id for m in self.plane.membership.live()}
        return [i for i in self.slot_members.get(slot_id, []) if i in live]

    def _send_role(self, slot_id: int, role: Role) -> None:
        for member_id in self._live(slot_id):
            seq = self.plane.send(member_id, Op.ROLE, slot=slot_id, role=str(role))
            self.awaiting[seq] = ("ready", slot_id)

    def _roles(self) -> dict[str, str]:
        roles: dict[str, str] = {}
        for slot in self.controller.table.in_service():
            for member_id in self._live(slot.slot_id):
                if slot.role is not Role.TRAINING or member_id not in roles:
                    roles[member_id] = str(slot.role)
        return roles

    def _partition(self) -> None:
        self.need_partition = False
        roles = self._roles()
        entry: dict[str, Any] = {"at": self.now(), "roles": roles, "acks": {}, "dataplane": {}}
        dataplane = None
        if self.rendezvous is not None:
            dp_roles = {m: r for m, r in roles.items() if r != "idle"}
            for member_id in self.trainers:  # trainers hold the weights whatever they host
                if self.plane.membership.members[member_id].state is MemberState.MEMBER:
                    dp_roles[member_id] = str(Role.TRAINING)
            dataplane = {
                "host": self.rendezvous.host,
                "port": self.rendezvous.port,
                "backend": self.backend,
                "roles": dp_roles,
            }
        entry["seconds"] = self.plane.partition(roles, dataplane=dataplane)
        entry["epoch"] = self.plane.epoch
        entry["universe"] = list(self.plane.membership.universe)
        self.partitions.append(entry)
        self._log("partition", epoch=self.plane.epoch, roles=roles, seconds=entry["seconds"])

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_requested = signum

    def _log(self, what: str, **fields: Any) -> None:
        record = {"t": round(self.now(), 4), "what": what, **fields}
        self._events.write(json.dumps(record, default=str) + "\n")
        self._events.flush()

    # ================================================================= finish
    def _finish(self) -> dict[str, Any]:
        """Give every elastic job back, shut the plane down, write the summary."""
        for comp in self.capacity.manager.live():  # elastic ranks leave, base ranks exit:
            if comp.state is not ComponentState.RELEASING:  # together, so that a data-plane
                self.plane.leave(comp.source.tag)  # leave barrier never waits on the others
        self.plane.shutdown()
        self.squeue.stop()
        self._cancel_all()
        deadline = self.clock() + LEAVE_TIMEOUT_S  # see the jobs leave squeue
        while self.clock() < deadline and self.capacity.manager.live():
            self.capacity.poll(self.now())
            self._note_gone(self.now())
            time.sleep(self.cfg.elastic.poll_s)
        summary = {
            "run_tag": self.run_tag,
            "steps": self.step,
            "stopped_by_signal": self.stop_requested,
            "reconfigurations": len(self.controller.history),
            "partitions": self.partitions,
            "failures": self.failures,
            "errors": self.errors,
            "slurm_poll_failures": self.capacity.client.poll_failures,
            "latency": self.latency,
            "timings": dataclasses.asdict(self.plane.timings),
            "table": self.controller.table.to_dict(),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        self._log("finished", steps=self.step)
        self._events.close()
        return summary


def _plain(event: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        out[f.name] = value.tag if isinstance(value, ElasticSource) else value
    return out
