"""The Slurm backend: elastic engine ranks in heterogeneous jobs.

    sbatch launch/run.sbatch configs/runs/slurm-local.yaml     # the master as a batch job

The base job is the run's MPI world (:mod:`pearl_hpc.backends.world`). Elastic capacity:
a grow submits one heterogeneous job with one component per engine worker
(``--comment=pearl:<run tag>``, partition ``slurm.partition``); its batch step
(:mod:`pearl_hpc.backends.slurm_job`) runs one engine rank per component in its own
``srun --mpi=pmi2 --het-group=K`` step, which joins the world (Connect + Merge, see
:mod:`pearl_hpc.master.members`); the master connects to its engine socket when the
controller places a worker on those GPUs (:meth:`SlurmBackend.attach`). Reclaims are
Slurm's:

    squeue (thread) ──RUNNING──> CapacityGranted      the job's --signal (preemption)
    component gone ──────────> CapacityReclaimed      ──> JOB.signal ──> CapacityReclaimed
                                                                          (deadline = grace)

The controller drains the component's workers (their partial turns finish elsewhere),
releases them and calls ``release_capacity``: the component's rank leaves the world
(LEAVE + Disconnect), then ``scancel JOB+K``. The availability trace of a run config is
carried out for real: a trace point that lowers the elastic count submits a job on
``slurm.preempt_partition`` to each node of the newest elastic job, and Slurm preempts it
(the job's signal first, then cancel after the partition's GraceTime).

Every process of an elastic job ends with the master: the job's launcher watches the
master's lease file (``RUN_DIR/elastic/master.lease``, touched every second) and ends its
steps once it goes stale. A resumed master adopts the jobs of its run it finds by tag:
their batch steps start their ranks again, which join the new world (no cancel, no
resubmission); the trace then asks only for what they do not cover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pearl_hpc.backends.lease import MasterLease
from pearl_hpc.backends.ranks import RankWorker, attach_rank
from pearl_hpc.comm.membership import MemberState
from pearl_hpc.config.run import SlurmSettings
from pearl_hpc.core.controller import CapacityGranted, CapacityReclaimed, Event
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.engine.vllm_engine import EngineSpec
from pearl_hpc.master.members import LEAVE_TIMEOUT_S, Members
from pearl_hpc.slurm.capacity import CapacityManager, Component, ComponentState
from pearl_hpc.slurm.client import SlurmClient, SlurmError, run_command
from pearl_hpc.slurm.scripts import HetComponent, JobSpec

log = logging.getLogger(__name__)

GONE = ComponentState.GONE
LIVE = {MemberState.LINKED, MemberState.MEMBER, MemberState.LEAVING}
SUBMIT_RETRY_S = 5.0  # a submission that met an unreachable slurmctld is retried after
# what sbatch says when the controller could not be reached (retried; anything else, e.g.
# a bad partition, is reported and not retried)
TRANSIENT_SLURM_ERRORS = ("Unable to contact slurm controller", "Socket timed out", "no answer",
                          "could not run")  # fmt: skip


def source_of_gpus(gpu_ids: tuple[str, ...]) -> ElasticSource | None:
    """The job component that elastic GPU ids (``JOB+K:node:gpuI``) belong to."""
    tag = gpu_ids[0].split(":", 1)[0]
    job, plus, component = tag.partition("+")
    if not plus or not job.isdigit() or not component.isdigit():
        return None
    return ElasticSource(job, int(component))


def run_tag_of(run_dir: Path) -> str:
    """A run's Slurm tag (``--comment=pearl:<tag>``): its directory name, stable across
    resumes."""
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in run_dir.resolve().name)


def elastic_job_spec(
    s: SlurmSettings,
    run_tag: str,
    elastic_dir: Path,
    spec: EngineSpec,
    workers: int,
    python: str,
) -> JobSpec:
    """One grow: a heterogeneous job of ``workers`` components, one engine rank each,
    whose batch step is :mod:`pearl_hpc.backends.slurm_job` (pure)."""
    component = HetComponent(
        partition=s.partition,
        gpus_per_node=s.gpus_per_worker,
        cpus_per_task=s.cpus_per_worker,
        time_limit=s.time_limit,
        extra=tuple(s.sbatch_extra),
    )
    engine_args = [
        f"--run-dir={elastic_dir.parent}",
        f"--model={spec.model_dir}",
        f"--lease-timeout-s={s.lease_timeout_s:g}",
    ]
    return JobSpec(
        name="pearl-elastic",
        run_tag=run_tag,
        components=(component,) * workers,
        command=[python, "-m", "pearl_hpc.backends.slurm_job", *engine_args],
        signal=s.signal,
        output=str(elastic_dir / "job-%j.out"),
    )


class SlurmBackend:
    """This run's elastic heterogeneous jobs (a :class:`~.base.CapacityBackend`): submit,
    watch, preempt (for the trace), release, and cancel everything at the end."""

    def __init__(
        self,
        settings: SlurmSettings,
        spec: EngineSpec,
        run_dir: Path,
        queue: asyncio.Queue[Event],
        clock: Callable[[], float],
        grace_s: float,
        on_event: Callable[[str, dict[str, Any]], None],
        members: Members,
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.members = members  # the world the elastic ranks join
        self.dir = run_dir / "elastic"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tag = run_tag_of(run_dir)
        self.client = SlurmClient(min_backoff_s=settings.poll_s)
        self.manager = CapacityManager(
            self.tag, pending_timeout_s=settings.pending_timeout_s, grace_s=grace_s
        )
        self.queue = queue
        self.clock = clock
        self.on_event = on_event
        self.jobs: list[str] = []  # submitted, oldest first
        self.preemptors: list[str] = []
        self.counts = {"granted": 0, "reclaimed": 0}
        self.target = 0  # elastic workers the trace asks for
        self.errors: list[str] = []  # submissions that failed, for the summary
        self._retry_at: float | None = None
        self.preempting: set[str] = set()  # jobs the trace had preempted
        self.released: set[str] = set()  # components the controller gave back
        self._held: dict[str, list[CapacityGranted]] = {}  # grants of a partly started job
        # scancel targets waiting for their component's rank to leave the world
        self._cancels: dict[str, tuple[tuple[str, int | None], float]] = {}
        self._watch_stop = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._lease = MasterLease(self.dir)

    # ---------------------------------------------------------------- lifetime

    async def start(self, *, resume: bool) -> None:
        """Watch squeue and the jobs' signals; a resumed master first adopts the elastic
        jobs the dead one left (:meth:`adopt_leftovers`)."""
        if resume:
            await self.adopt_leftovers()
        self._watch = asyncio.create_task(self.watch(self._watch_stop))

    async def adopt_leftovers(self) -> list[str]:
        """Take over the elastic jobs of this run a dead master left (found by tag):
        their batch steps start their ranks again once this master holds the lease,
        and the ranks join this world; granted when squeue shows them running, like a
        job of this master's. The dead master's preempting jobs are cancelled."""
        rows = (await asyncio.to_thread(self.client.poll, None)).values()
        mine = [r for r in rows if r.comment == f"pearl:{self.tag}"]
        for job_id in sorted({r.job_id for r in rows if r.comment == f"pearl:{self.tag}.preempt"}):
            with contextlib.suppress(SlurmError):
                await asyncio.to_thread(self.client.cancel, job_id)
        gpus = self.settings.gpus_per_worker
        self.manager.adopt(mine, gpus, gpus, self.clock())
        jobs = sorted({r.job_id for r in mine})
        self.jobs.extend(jobs)
        if jobs:
            tags = sorted(ElasticSource(r.job_id, r.component or 0).tag for r in mine)
            self.on_event("adopted", {"jobs": jobs, "components": tags})
        return jobs

    async def close(self) -> None:
        """Cancel every elastic and preempting job of the run and see them leave squeue."""
        self._watch_stop.set()
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch
        self._lease.stop()
        for job_id in self.jobs + self.preemptors:
            with contextlib.suppress(SlurmError):
                await asyncio.to_thread(self.client.cancel, job_id)
        await self._wait_gone(60.0)

    async def _tagged_jobs(self) -> set[str]:
        """This run's jobs in squeue, elastic and preempting ones (one squeue call)."""
        rows = await asyncio.to_thread(self.client.poll, None)
        mine = {f"pearl:{self.tag}", f"pearl:{self.tag}.preempt"}
        return {row.job_id for row in rows.values() if row.comment in mine}

    async def _wait_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not await self._tagged_jobs():
                return
            await asyncio.sleep(self.settings.poll_s)
        log.error("jobs tagged pearl:%s are still in squeue after %.0f s", self.tag, timeout_s)

    # ---------------------------------------------------------------- capacity
    def describe(self) -> list[dict[str, Any]]:
        """The run's live elastic components, for the journal and ``pearl-hpc status``."""
        return [
            {"component": c.source.tag, "state": str(c.state), "nodes": list(c.nodes)}
            for c in self.manager.live()
        ]

    def _counted(self) -> list[Component]:
        """Components that count as available: not given back, not being preempted."""
        return [
            c
            for c in self.manager.live()
            if c.state is not ComponentState.RELEASING and c.source.job_id not in self.preempting
        ]

    def live_workers(self) -> int:
        return sum(len(c.gpu_sets()) if c.nodes else 1 for c in self._counted())

    def summary(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "preempting_jobs": self.preemptors,
            "errors": self.errors,
            "poll_failures": self.client.poll_failures,  # squeue calls that failed
        }

    async def scale_to(self, workers: int, *, regrant: bool = False) -> None:
        """The trace's availability: submit one heterogeneous job for the missing workers,
        or preempt the newest jobs (whole jobs) until at most ``workers`` remain. (Grants
        are counted as Slurm starts jobs; a resumed master's jobs are new ones.)"""
        self.target = workers
        have = self.live_workers()
        if workers > have:
            await self._try_submit(workers - have)
        for job_id in reversed(self.jobs):
            if have <= workers:
                break
            comps = [c for c in self._counted() if c.source.job_id == job_id]
            if not comps:
                continue
            have -= sum(len(c.gpu_sets()) if c.nodes else 1 for c in comps)
            if all(c.state is ComponentState.RUNNING for c in comps):
                await self.preempt(job_id)
            else:  # not started yet: nothing to preempt
                with contextlib.suppress(SlurmError):
                    await asyncio.to_thread(self.client.cancel, job_id)

    async def _try_submit(self, workers: int) -> None:
        """Submit, or report why not: the run goes on without that capacity (an
        unreachable slurmctld is retried from the watch, SUBMIT_RETRY_S later)."""
        try:
            await self.submit(workers)
        except SlurmError as exc:
            retry = any(t in str(exc) for t in TRANSIENT_SLURM_ERRORS)
            self.errors.append(str(exc)[:300])
            self.on_event("submit_failed", {"error": str(exc)[:300], "retry": retry})
            if retry:
                self._retry_at = time.monotonic() + SUBMIT_RETRY_S

    async def _retry_submit(self) -> None:
        if self._retry_at is None or time.monotonic() < self._retry_at:
            return
        self._retry_at = None
        missing = self.target - self.live_workers()
        if missing > 0:
            await self._try_submit(missing)

    async def submit(self, workers: int) -> str:
        job = elastic_job_spec(
            self.settings, self.tag, self.dir.resolve(), self.spec, workers, sys.executable
        )
        job_id = await asyncio.to_thread(self.client.submit, job)
        self.manager.submitted(job_id, job, self.settings.gpus_per_worker, self.clock())
        self.jobs.append(job_id)
        self.on_event("submitted", {"job": job_id, "components": workers})
        return job_id

    async def preempt(self, job_id: str) -> None:
        """Make Slurm preempt ``job_id``: a job on the preempting partition on each of its
        nodes (what another user's high-priority job does on a shared cluster)."""
        nodes = sorted(
            {n for c in self.manager.live() if c.source.job_id == job_id for n in c.nodes}
        )
        for node in nodes:
            argv = [
                "sbatch", "--parsable", "-p", self.settings.preempt_partition, "-w", node,
                f"--gres=gpu:{self.settings.gpus_per_worker}", "-n1", "-o", "/dev/null",
                "-J", "pearl-preempt", f"--comment=pearl:{self.tag}.preempt",
                "--wrap", f"sleep {self.settings.preempt_hold_s}",
            ]  # fmt: skip
            result = await asyncio.to_thread(run_command, argv)
            if result.returncode != 0:
                raise SlurmError(f"preempting job on {node}: {result.stderr.strip()}")
            self.preemptors.append(result.stdout.strip().split(";")[0])
        self.preempting.add(job_id)
        self.on_event("preempt", {"job": job_id, "nodes": nodes})

    def release(self, source: ElasticSource) -> None:
        """The controller gives a component back: its rank leaves the world, then
        ``scancel JOB+K`` (a signalled one too: it is RELEASING already and is cancelled
        all the same), once the rank acked or after ``LEAVE_TIMEOUT_S``.

        Component 0 runs the job's batch step, and cancelling it ends every component:
        while others serve, its allocation is kept (its rank has left) and given back
        with the last of them."""
        self.manager.release(source)
        self.released.add(source.tag)
        self.members.leave(source.tag)
        job = [c for c in self.manager.components.values() if c.source.job_id == source.job_id]
        others = [c for c in job if c.source.tag not in self.released and c.state is not GONE]
        if source.het_component == 0 and others:
            self.on_event("release_deferred", {"source": source.tag})
            return
        if not others and any(c.source.het_component == 0 for c in job):
            target: tuple[str, int | None] = (source.job_id, None)  # the whole job
        else:
            target = self.manager.cancel_target(source)
        self._cancels[source.tag] = (target, time.monotonic() + LEAVE_TIMEOUT_S)

    async def _cancel_left(self) -> None:
        """The scancels whose component's rank has left the world (or took too long)."""
        for tag, (target, by) in list(self._cancels.items()):
            if not (self.members.left(tag) or time.monotonic() > by):
                continue
            del self._cancels[tag]
            try:
                await asyncio.to_thread(self.client.cancel, *target)
            except SlurmError as exc:  # already gone: nothing to give back
                log.info("scancel %s: %s", tag, exc)
            self.on_event("scancel", {"target": "+".join(str(t) for t in target if t is not None)})

    async def watch(self, stop: asyncio.Event) -> None:
        """squeue and the jobs' signal files -> capacity events, until ``stop``; a poll
        that fails is logged (``watch_error``) and the next one tried."""
        while not stop.is_set():
            try:
                await self._watch_once()
            except Exception as exc:  # the watch must outlive any one bad poll
                log.exception("elastic job watch")
                self.on_event("watch_error", {"error": f"{type(exc).__name__}: {exc}"[:300]})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.poll_s)

    async def _watch_once(self) -> None:
        """One squeue poll and the signal files, folded into capacity events."""
        rows = await asyncio.to_thread(self.client.poll, self.tag)
        now = self.clock()
        for reclaim in self._signals(now):
            # Slurm kills the component after its grace: its rank leaves the world now
            # (a rank killed inside a collective call would hang it), its engine drains
            self.members.leave(reclaim.source.tag)
            await self._put(reclaim)
        actions = self.manager.observe(rows, now)
        for comp in self.manager.components.values():  # ended under its rank: dead
            if comp.state is GONE and self.members.group_state(comp.source.tag) & LIVE:
                for member in self.members.plane.membership.group(comp.source.tag):
                    self.members.fail(member.member_id, "its job component ended")
        for job_id, component in actions.cancel:
            with contextlib.suppress(SlurmError):
                await asyncio.to_thread(self.client.cancel, job_id, component)
        for event in actions.events:
            if isinstance(event, CapacityGranted):
                self._held.setdefault(event.source.job_id, []).append(event)
            else:
                await self._put(event)
        await self._release_grants()
        await self._cancel_left()
        await self._retry_submit()

    async def _release_grants(self) -> None:
        """Grants of a heterogeneous job go to the controller as one event, once every
        component runs (Slurm starts them together; squeue may show them one by one)."""
        for job_id in list(self._held):
            comps = [c for c in self.manager.live() if c.source.job_id == job_id]
            if any(c.state in (ComponentState.SUBMITTED, ComponentState.PENDING) for c in comps):
                continue
            first, *rest = sorted(self._held.pop(job_id), key=lambda g: g.source.het_component)
            self.counts["granted"] += len(rest)
            await self._put(CapacityGranted(first.source, first.gpu_sets, also=tuple(rest)))

    async def _put(self, event: CapacityGranted | CapacityReclaimed) -> None:
        if isinstance(event, CapacityGranted):
            self.counts["granted"] += 1
        else:
            self.counts["reclaimed"] += 1
        await self.queue.put(event)

    def _signals(self, now: float) -> list[CapacityReclaimed]:
        out = []
        for path in sorted(self.dir.glob("*.signal")):
            job_id = path.stem
            path.rename(path.with_suffix(".signal-seen"))
            self.on_event("signal", {"job": job_id})
            for comp in list(self.manager.live()):
                if comp.source.job_id == job_id:
                    event = self.manager.signalled(comp.source, now)
                    if event is not None:
                        out.append(event)
        return out

    # ----------------------------------------------------------------- workers
    async def attach(
        self, gpu_ids: tuple[str, ...], key: str, timeout_s: float
    ) -> RankWorker | None:
        """The engine socket of the rank that holds ``gpu_ids``, once it joined the world
        (None: not GPUs of an elastic job; a base engine rank's)."""
        source = source_of_gpus(gpu_ids)
        if source is None:
            return None

        def ended() -> str | None:
            comp = self.manager.components.get(source.tag)
            if comp is None or comp.state is GONE:
                return f"see {self.dir}/job-{source.job_id}.out"
            return None

        return await attach_rank(
            self.members,
            gpu_ids,
            key,
            timeout_s,
            tag=source.tag,
            ended=ended,
            release=lambda: self.release(source),
        )
