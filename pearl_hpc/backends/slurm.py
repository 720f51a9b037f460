"""The Slurm backend: elastic engine workers harvested from Slurm as standing requests.

    pearl-hpc run configs/runs/slurm-local.yaml --sbatch     # the master as a batch job

The base job is the run's MPI world (:mod:`pearl_hpc.backends.world`). Elastic capacity
is asked of Slurm, not scripted: the controller's demand (:meth:`want`, the expansion
gate at request time) says how many workers are worth having, and the backend keeps that
many held or requested. A request (``--comment=pearl:<run tag>``) is one job per worker
(``elastic.request: single``, to the pool ``sbatch --test-only`` says starts it soonest)
or one heterogeneous job of every pool's ``hetjob_workers`` components (``hetjob``,
started together). It waits PENDING until
Slurm finds the GPUs idle; its batch step (:mod:`pearl_hpc.backends.slurm_job`) runs one
engine rank per component in its own ``srun --mpi=pmi2 --het-group=K`` step, which joins
the world (Connect + Merge, see :mod:`pearl_hpc.comm.members`). Reclaims are Slurm's::

    squeue (watch task) ──RUNNING──> CapacityGranted     the job's --signal: preemption,
    component gone ──────────> CapacityReclaimed         or signal_lead_s before its time
    pending_timeout_s ───────> cancelled, asked again    limit ──> JOB.signal ──>
    demand lower ────────────> pending requests withdrawn   CapacityReclaimed (grace_s)

The controller drains the component's workers (their partial turns finish elsewhere),
releases them and calls ``release_capacity``: the component's rank leaves the world
(LEAVE + Disconnect), then ``scancel JOB+K``. Every Slurm command runs in the watch
task, in a thread: a slurmctld outage delays requests and grants, never the master's
loop (a failed squeue keeps the last known state).

Every process of an elastic job ends with the master: the job's launcher watches the
master's lease file (``RUN_DIR/elastic/master.lease``, touched every second) and ends its
steps once it goes stale. A resumed master adopts the jobs of its run it finds by tag:
running ones' batch steps start their ranks again, which join the new world (no cancel,
no resubmission); pending ones stay requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.backends.lease import MasterLease
from pearl_hpc.backends.ranks import RankWorker, attach_rank
from pearl_hpc.comm.members import LEAVE_TIMEOUT_S
from pearl_hpc.comm.membership import MemberState
from pearl_hpc.config.run import ElasticConfig, PoolConfig
from pearl_hpc.config.slurm import (
    SlurmSettings,
    container_srun_options,
    in_container,
    job_env,
    site_options,
)
from pearl_hpc.core.controller import CapacityGranted, CapacityReclaimed
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.core.types import Role
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.capacity import BackendContext
from pearl_hpc.rundir import RunDir
from pearl_hpc.slurm.capacity import CapacityManager, Component, ComponentState
from pearl_hpc.slurm.client import SlurmClient, SlurmError
from pearl_hpc.slurm.scripts import HetComponent, JobSpec

log = logging.getLogger(__name__)

GONE = ComponentState.GONE
_SHOWN = {  # a component's state as status and the live view show it
    ComponentState.SUBMITTED: "requested",
    ComponentState.PENDING: "pending",
    ComponentState.RUNNING: "running",
    ComponentState.RELEASING: "draining",
    ComponentState.GONE: "gone",
}
LIVE = {MemberState.MEMBER, MemberState.LEAVING}
SUBMIT_RETRY_S = 5.0  # a submission that met an unreachable slurmctld is retried after
ESTIMATE_RENEW_S = 30.0  # a kept start estimate (no request pending) is asked again after
# what sbatch says when the controller could not be reached (retried; anything else, e.g.
# a bad partition, is reported and not retried)
TRANSIENT_SLURM_ERRORS = ("Unable to contact slurm controller", "Socket timed out", "no answer",
                          "could not run")  # fmt: skip


def run_tag_of(run_dir: Path) -> str:
    """A run's Slurm tag (``--comment=pearl:<tag>``): its directory name, stable across
    resumes."""
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in run_dir.resolve().name)


def pool_component(pool: PoolConfig, site: SlurmSettings) -> HetComponent:
    """One elastic worker's component of a request to ``pool`` (pure): the run's site
    options (``slurm:``), the pool's own where it sets them."""
    site_opts = site_options(
        site, qos=pool.qos, account=pool.account, constraint=pool.constraint, mem=pool.mem
    )
    return HetComponent(
        partition=pool.partition,
        gpus_per_node=pool.gpus_per_worker,
        cpus_per_task=pool.cpus_per_worker,
        time_limit=pool.time_limit,
        extra=(*site_opts, *pool.sbatch_extra),
        site=site,
    )


def request_pools(elastic: ElasticConfig, turn: int) -> list[int]:
    """The pools of one request's components (pure): ``single``, the pool whose turn it
    is; ``hetjob``, every pool's ``hetjob_workers`` (one component each)."""
    if elastic.request == "single":
        return [turn % len(elastic.pools)]
    return [i for i, pool in enumerate(elastic.pools) for _ in range(pool.hetjob_workers)]


def earliest_pool(starts: Mapping[int, float | None], order: Sequence[int]) -> int:
    """``single`` requests over several pools: the pool Slurm would start a worker in
    soonest (``starts``: seconds, from ``sbatch --test-only``); a pool without an estimate
    comes after every pool with one; ties go to the earlier pool in ``order`` (the turn)
    (pure)."""
    return min(order, key=lambda i: (starts.get(i) is None, starts.get(i) or 0.0, order.index(i)))


def elastic_job_spec(
    elastic: ElasticConfig,
    pools: list[int],
    s: SlurmSettings,
    run_tag: str,
    elastic_dir: Path,
    model_dir: str,
    python: str,
) -> JobSpec:
    """One request: a job of one component per worker (heterogeneous when more than
    one), one engine rank each, whose batch step is :mod:`pearl_hpc.backends.slurm_job`
    (pure). Every component is signalled ``signal_lead_s`` before a preemption or its
    time limit (the first pool's lead: Slurm takes one --signal per job). The site's
    ``env`` and ``setup`` lines run first; its steps are ``srun --mpi=`` the site's, in
    the run's container if it has one."""
    chosen = [elastic.pools[i] for i in pools]
    engine_args = [
        f"--run-dir={elastic_dir.parent}",
        f"--model={model_dir}",
        f"--lease-timeout-s={s.lease_timeout_s:g}",
        "--gpus=" + ",".join(str(p.gpus_per_worker) for p in chosen),
        f"--mpi={s.mpi}",
        *[f"--srun-option={o}" for o in (*s.srun_extra, *container_srun_options(s.container))],
        *[f"--rank-command={w}" for w in in_container(s.container, [s.container.python])
          if s.container.runtime],
    ]  # fmt: skip
    return JobSpec(
        name="pearl-elastic",
        run_tag=run_tag,
        components=tuple(pool_component(p, s) for p in chosen),
        command=[python, "-m", "pearl_hpc.backends.slurm_job", *engine_args],
        signal=f"B:USR2@{min(p.signal_lead_s for p in chosen)}",
        output=str(elastic_dir / "job-%j.out"),
        env=tuple(job_env(s).items()),
        setup=tuple(s.setup),
    )


class SlurmBackend:
    """This run's standing requests for elastic workers (a :class:`~.base.CapacityBackend`):
    submitted and withdrawn to follow the controller's demand, granted when Slurm starts
    them, reclaimed when Slurm signals or ends them, released, all cancelled at the end.
    Every Slurm command runs in the watch task, off the master's loop."""

    def __init__(self, ctx: BackendContext) -> None:
        settings, elastic, run_dir = ctx.cfg.slurm, ctx.cfg.elastic, ctx.run_dir
        self.settings = settings
        self.elastic = elastic
        self.model_dir = ctx.model_dir
        self.resume = ctx.resume
        self.members = ctx.members  # the world the elastic ranks join
        self.dir = RunDir(run_dir).elastic
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tag = run_tag_of(run_dir)
        self.client = SlurmClient(min_backoff_s=settings.poll_s)
        self.manager = CapacityManager(
            self.tag, pending_timeout_s=elastic.pending_timeout_s, grace_s=elastic.grace_s
        )
        self.queue = ctx.queue
        self.clock = ctx.clock
        self.on_event = ctx.on_event
        self.jobs: list[str] = []  # submitted or adopted, oldest first
        self.pool_of: dict[str, int] = {}  # component tag -> its pool
        self.counts = {"granted": 0, "reclaimed": 0}
        self.target = 0  # the controller's demand
        self.errors: list[str] = []  # submissions that failed, for the summary
        self.refused: dict[int, str] = {}  # pools Slurm refused for good, and why
        self._turn = 0  # the pool the next single request goes to
        self._retry_at: float | None = None
        self._expected_start: float | None = None  # Slurm's last start estimate (epoch s)
        self._estimated_at = 0.0  # when it was made (monotonic)
        self.released: set[str] = set()  # components the controller gave back
        self._held: dict[str, list[CapacityGranted]] = {}  # grants of a partly started job
        # scancel targets waiting for their component's rank to leave the world
        self._cancels: dict[str, tuple[tuple[str, int | None], float]] = {}
        self._watch_stop = asyncio.Event()
        self._wake = asyncio.Event()  # the demand changed: act before the next poll
        self._watch: asyncio.Task[None] | None = None
        self._lease = MasterLease(RunDir(run_dir).lease)

    # ---------------------------------------------------------------- lifetime

    async def start(self) -> None:
        """Watch squeue and the jobs' signals; a resumed master first adopts the elastic
        jobs the dead one left (:meth:`adopt_leftovers`)."""
        if self.resume:
            await self.adopt_leftovers()
        self._watch = asyncio.create_task(self.watch(self._watch_stop))

    async def adopt_leftovers(self) -> list[str]:
        """Take over the elastic jobs of this run a dead master left (found by tag):
        running ones' batch steps start their ranks again once this master holds the
        lease, and the ranks join this world (granted when squeue shows them running,
        like a job of this master's); pending ones stay requests."""
        rows = (await asyncio.to_thread(self.client.poll, None)).values()
        mine = [r for r in rows if r.comment == f"pearl:{self.tag}"]
        partitions = [p.partition for p in self.elastic.pools]
        for row in mine:
            pool = partitions.index(row.partition) if row.partition in partitions else 0
            gpus = self.elastic.pools[pool].gpus_per_worker
            self.manager.adopt([row], gpus, gpus, self.clock())
            self.pool_of[ElasticSource(row.job_id, row.component or 0).tag] = pool
        jobs = sorted({r.job_id for r in mine})
        self.jobs.extend(jobs)
        if jobs:
            tags = sorted(ElasticSource(r.job_id, r.component or 0).tag for r in mine)
            self.on_event("adopted", {"jobs": jobs, "components": tags})
        return jobs

    async def before_rollout(self, step: int, spawn: Callable[[Awaitable[None]], None]) -> None:
        """Slurm decides what starts when: nothing to offer before a rollout. With
        ``elastic.strict``, a pool Slurm refused ends the run here (one line naming it)."""
        if self.elastic.strict and self.refused:
            i, why = next(iter(self.refused.items()))
            raise ConfigError(
                f"elastic.pools[{i}] ({self.elastic.pools[i].partition}): Slurm refuses its "
                f"requests ({why}); fix the pool, or set elastic.strict: false to run "
                "without it"
            )

    async def follow_trace(self, stop: asyncio.Event) -> None:
        """No trace on Slurm (slurm/replay-load replays one as other users' load)."""

    async def close(self) -> None:
        """Cancel every elastic job of the run and see them leave squeue."""
        self._watch_stop.set()
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await self._watch
        self._lease.stop()
        for job_id in self.jobs:
            with contextlib.suppress(SlurmError):
                await asyncio.to_thread(self.client.cancel, job_id)
        await self._wait_gone(60.0)

    async def _wait_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = await asyncio.to_thread(self.client.poll, None)
            if not any(r.comment == f"pearl:{self.tag}" for r in rows.values()):
                return
            await asyncio.sleep(self.settings.poll_s)
        log.error("jobs tagged pearl:%s are still in squeue after %.0f s", self.tag, timeout_s)

    # ---------------------------------------------------------------- capacity
    def describe(self) -> list[dict[str, Any]]:
        """The run's live elastic components, for the journal and ``pearl-hpc status``:
        requested (submitted, pending), running, draining (signalled or given back); a
        pending one with Slurm's expected start has ``starts_in_s``."""
        out = []
        for c in self.manager.live():
            row: dict[str, Any] = {
                "component": c.source.tag,
                "state": _SHOWN[c.state],
                "pool": self.elastic.pools[self.pool_of.get(c.source.tag, 0)].partition,
                "nodes": list(c.nodes),
            }
            if c.state is ComponentState.PENDING and c.expected_start is not None:
                row["starts_in_s"] = round(max(0.0, c.expected_start - time.time()))
            out.append(row)
        for i, why in self.refused.items():  # shown where the run's workers are
            pool = self.elastic.pools[i].partition
            out.append({"component": f"pool {i}", "state": "refused", "pool": pool,
                        "nodes": [], "error": why})  # fmt: skip
        return out

    def _counted(self) -> list[Component]:
        """Workers held or asked for: not given back, not being reclaimed."""
        return [c for c in self.manager.live() if c.state is not ComponentState.RELEASING]

    def live_workers(self) -> int:
        return sum(1 for c in self._counted() if c.state is ComponentState.RUNNING)

    def starts_in_s(self) -> float:
        """When Slurm would start a request made now, from now: the soonest expected
        start of the run's pending requests (squeue's ``%S``), else the last estimate
        seen (a withdrawn request's, ``sbatch --test-only``'s, renewed every
        ESTIMATE_RENEW_S: :meth:`_renew_estimate`); 0 when none is known or a request
        started since."""
        pending = [
            c.expected_start
            for c in self.manager.live()
            if c.state is ComponentState.PENDING and c.expected_start is not None
        ]
        if pending:
            self._expected_start = min(pending)
            self._estimated_at = time.monotonic()
        if self._expected_start is None:
            return 0.0
        return max(0.0, self._expected_start - time.time())

    def summary(self) -> dict[str, Any]:
        ran = [c for c in self.manager.components.values() if c.running_s is not None]
        return {
            "jobs": self.jobs,
            "errors": self.errors,
            "refused_pools": {
                self.elastic.pools[i].partition: why for i, why in self.refused.items()
            },
            "poll_failures": self.client.poll_failures,  # squeue calls that failed
            "requested": len(self.manager.components),
            "granted": len(ran),
            # submit -> RUNNING of the components this master submitted
            "pending_s": sorted(
                round(c.running_s - c.submitted_s, 2)
                for c in ran
                if c.running_s is not None and not c.adopted
            ),
            "worker_s": round(sum(c.held_s(self.clock()) for c in ran), 1),
        }

    def want(self, workers: int) -> None:
        """The controller's demand: the watch keeps that many workers held or requested."""
        self.target = workers
        self._wake.set()

    async def _request(self) -> None:
        """Standing requests follow the demand: submit while fewer workers are held or
        requested than wanted; withdraw requests not started while more are (newest
        first; running workers stay until the controller gives them back)."""
        if self._retry_at is not None and time.monotonic() < self._retry_at:
            return
        self._retry_at = None
        counted = self._counted()
        while len(counted) < self.target and len(self.refused) < len(self.elastic.pools):
            if not await self._try_submit():
                return
            counted = self._counted()
        excess = len(counted) - self.target
        for job_id in reversed(self.jobs):
            job = [c for c in counted if c.source.job_id == job_id]
            if excess <= 0:
                break
            if not job or len(job) > excess or any(c.state is ComponentState.RUNNING for c in job):
                continue
            for comp in job:
                self.manager.release(comp.source)
            with contextlib.suppress(SlurmError):
                await asyncio.to_thread(self.client.cancel, job_id)
            self.on_event("withdrawn", {"job": job_id, "components": len(job)})
            excess -= len(job)

    async def _try_submit(self) -> bool:
        """Submit one request, or report why not: an unreachable slurmctld is retried
        SUBMIT_RETRY_S later; a pool that refuses (e.g. no such partition) is not asked
        again, and the run goes on without it."""
        while self._turn % len(self.elastic.pools) in self.refused:
            self._turn += 1
        pools = request_pools(self.elastic, self._turn)
        self._turn += 1
        starts: dict[int, float | None] = {}
        if self.elastic.request == "single" and len(self.elastic.pools) > 1:
            pools, starts = await self._soonest(pools[0])
        try:
            await self.submit(pools, starts)
            return True
        except SlurmError as exc:
            retry = any(t in str(exc) for t in TRANSIENT_SLURM_ERRORS)
            self.errors.append(str(exc)[:300])
            self.on_event("submit_failed", {"error": str(exc)[:300], "retry": retry})
            if retry:
                self._retry_at = time.monotonic() + SUBMIT_RETRY_S
            else:
                self.refused.update({i: str(exc)[:300] for i in pools})
            return False

    async def _soonest(self, turn_pool: int) -> tuple[list[int], dict[int, float | None]]:
        """A single request goes to the pool Slurm would start it in soonest (``sbatch
        --test-only`` per pool, nothing submitted), the turn's pool on a tie: a busy
        first pool does not hold the run's capacity back while another has idle GPUs."""
        n = len(self.elastic.pools)
        order = [(turn_pool + k) % n for k in range(n)]
        order = [i for i in order if i not in self.refused]
        starts: dict[int, float | None] = {}
        for i in order:
            spec = self._spec([i])
            starts[i] = await asyncio.to_thread(self.client.start_estimate, spec)
        known = [t for t in starts.values() if t is not None]
        if known:
            self._expected_start = time.time() + min(known)
            self._estimated_at = time.monotonic()
        return [earliest_pool(starts, order)], starts

    async def _renew_estimate(self) -> None:
        """The kept start estimate, asked of Slurm again (``sbatch --test-only``: nothing
        submitted) once it is ESTIMATE_RENEW_S old and no request of the run is pending
        to carry a fresh one. It was the scheduler's plan when made, from the time limits
        of the jobs then running, which often end sooner: kept for good, a far estimate
        holds the demand at 0 while nodes go idle."""
        if self._expected_start is None or self._expected_start <= time.time():
            return
        if time.monotonic() - self._estimated_at < ESTIMATE_RENEW_S:
            return
        if any(c.state is ComponentState.PENDING for c in self.manager.live()):
            return
        pools = [i for i in range(len(self.elastic.pools)) if i not in self.refused]
        if self.elastic.request == "hetjob":
            specs = [self._spec(request_pools(self.elastic, self._turn))] if pools else []
        else:
            specs = [self._spec([i]) for i in pools]
        starts = [await asyncio.to_thread(self.client.start_estimate, s) for s in specs]
        known = [t for t in starts if t is not None]
        self._expected_start = time.time() + min(known) if known else None
        self._estimated_at = time.monotonic()

    def _spec(self, pools: list[int]) -> JobSpec:
        return elastic_job_spec(
            self.elastic, pools, self.settings, self.tag, self.dir.resolve(), self.model_dir,
            self.settings.python or sys.executable,
        )  # fmt: skip

    async def submit(
        self, pools: list[int], starts: Mapping[int, float | None] | None = None
    ) -> str:
        job = self._spec(pools)
        job_id = await asyncio.to_thread(self.client.submit, job)
        gpus = [self.elastic.pools[i].gpus_per_worker for i in pools]
        self.manager.submitted(job_id, job, gpus, self.clock())
        for k, pool in enumerate(pools):
            self.pool_of[ElasticSource(job_id, k).tag] = pool
        self.jobs.append(job_id)
        partitions = [self.elastic.pools[i].partition for i in pools]
        event: dict[str, Any] = {"job": job_id, "components": len(pools), "pools": partitions}
        if starts:  # [pool, partition, sbatch --test-only's seconds to start (None: none)]
            event["start_estimates"] = [
                [i, self.elastic.pools[i].partition, None if t is None else round(t, 1)]
                for i, t in starts.items()
            ]
        self.on_event("submitted", event)
        return job_id

    def release(self, source: ElasticSource) -> None:
        """The controller gives a component back: its rank leaves the world, then
        ``scancel JOB+K`` (a signalled one too: it is RELEASING already and is cancelled
        all the same), once the rank acked or after ``LEAVE_TIMEOUT_S``.

        Component 0 runs the job's batch step, and cancelling it ends every component:
        while others serve, its allocation is kept (its rank has left) and given back
        with the last of them."""
        self.manager.release(source, self.clock())
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
        """The scancels whose component's rank has left the world (or took too long). A
        started component whose rank has not joined yet is waited for too: killed while
        it connects, it would leave the master in ``Accept``; once it joins it is sent
        away (:meth:`Members.leave`)."""
        for tag, (target, by) in list(self._cancels.items()):
            comp = self.manager.components.get(tag)
            if self.members.group_state(tag):
                done = self.members.left(tag)
            else:  # not joined: no rank to wait for unless the component runs
                done = comp is None or comp.running_s is None or comp.state is GONE
            if not (done or time.monotonic() > by):
                continue
            del self._cancels[tag]
            try:
                await asyncio.to_thread(self.client.cancel, *target)
            except SlurmError as exc:  # already gone: nothing to give back
                log.info("scancel %s: %s", tag, exc)
            self.on_event("scancel", {"target": "+".join(str(t) for t in target if t is not None)})

    async def watch(self, stop: asyncio.Event) -> None:
        """squeue, the jobs' signal files and the demand -> capacity events and Slurm
        commands, until ``stop``; a poll that fails is logged (``watch_error``) and the
        next one tried."""
        while not stop.is_set():
            try:
                await self._watch_once()
            except Exception as exc:  # the watch must outlive any one bad poll
                log.exception("elastic job watch")
                self.on_event("watch_error", {"error": f"{type(exc).__name__}: {exc}"[:300]})
            self._wake.clear()
            waits = [asyncio.ensure_future(e.wait()) for e in (stop, self._wake)]
            await asyncio.wait(waits, timeout=self.settings.poll_s, return_when="FIRST_COMPLETED")
            for w in waits:
                w.cancel()

    async def _watch_once(self) -> None:
        """One squeue poll and the signal files, folded into capacity events; then the
        scancels due and the requests the demand asks for."""
        rows = await asyncio.to_thread(self.client.poll, self.tag)
        now = self.clock()
        reclaimed = False
        for reclaim in self._signals(now):
            reclaimed = True
            # Slurm kills the component after its grace: its rank leaves the world now,
            # its engine drains
            self.members.leave(reclaim.source.tag)
            await self._put(reclaim)
        actions = self.manager.observe(rows, now)
        for comp in self.manager.components.values():  # ended under its rank: dead
            if comp.state is GONE and self.members.group_state(comp.source.tag) & LIVE:
                for member in self.members.membership.group(comp.source.tag):
                    self.members.fail(member.member_id, "its job component ended")
        for job_id, component in actions.cancel:
            with contextlib.suppress(SlurmError):
                await asyncio.to_thread(self.client.cancel, job_id, component)
        for source in actions.timed_out:
            self.on_event("pending_timeout", {"component": source.tag})
        for event in actions.events:
            if isinstance(event, CapacityGranted):
                self._held.setdefault(event.source.job_id, []).append(event)
                self._expected_start = None  # Slurm starts requests now
            else:
                reclaimed = True
                await self._put(event)
        await self._release_grants()
        await self._cancel_left()
        await self._renew_estimate()
        if not reclaimed:  # (a reclaim changes the demand: asked at the next round)
            await self._request()

    async def _release_grants(self) -> None:
        """Grants of a heterogeneous job go to the controller as one event, once every
        component runs (Slurm starts them together; squeue may show them one by one)."""
        for job_id in list(self._held):
            comps = [c for c in self.manager.live() if c.source.job_id == job_id]
            if any(c.state in (ComponentState.SUBMITTED, ComponentState.PENDING) for c in comps):
                continue
            first, *rest = [
                dataclasses.replace(g, role=self._pool_role(g.source))
                for g in sorted(self._held.pop(job_id), key=lambda g: g.source.het_component)
            ]
            self.counts["granted"] += len(rest)
            await self._put(dataclasses.replace(first, also=tuple(rest)))

    def _pool_role(self, source: ElasticSource) -> Role | None:
        """The role the component's pool is shaped for (None: any)."""
        role = self.elastic.pools[self.pool_of.get(source.tag, 0)].role
        return None if role == "any" else Role(role)

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
        self, source: ElasticSource, gpu_ids: tuple[str, ...], key: str, timeout_s: float
    ) -> RankWorker | None:
        """The engine socket of ``source``'s rank on ``gpu_ids``, once it joined the
        world."""

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
