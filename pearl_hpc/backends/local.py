"""The local backend: elastic capacity as ranks this machine starts, joining the world.

    offer(N)  the trace's availability (the machine has no scheduler to ask)
    want(M)   the controller's demand (the expansion gate at request time)
      more than held, up to min(N, M): a "job" elJ of one component per new worker, each
        a launch `mpiexec.gforker -n 1 python -m pearl_hpc.rank join --group elJ+K --gpu-ids
        elJ+K:gpu0` (its rank Connects + Merges like a hetjob component's)
        ──> CapacityGranted
      fewer than held offered: the last granted ──> CapacityReclaimed (grace_s)
    release(source) ─ its rank leaves the world (LEAVE + Disconnect), then its launch is
                  ended; one whose rank died while still offered and wanted is replaced
    attach(gpu_ids) ─ the joined rank's engine socket (:func:`~.ranks.attach_rank`)

GPU ids are names: on CPU they only identify which worker runs where. The master ends
its launches at the end of the run; one whose master died is SIGTERMed by the kernel
(``setpriv --pdeathsig``), and its rank ends itself once the master's lease
(:mod:`.lease`) goes stale or a resumed master takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.backends.lease import MasterLease
from pearl_hpc.backends.ranks import RankWorker, attach_rank
from pearl_hpc.backends.trace import TraceDriver
from pearl_hpc.comm.layout import base_layout
from pearl_hpc.comm.members import LEAVE_TIMEOUT_S
from pearl_hpc.comm.membership import MemberState
from pearl_hpc.comm.mpiexec import gforker_path, one_node
from pearl_hpc.core.controller import CapacityGranted, CapacityReclaimed
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.master.capacity import BackendContext
from pearl_hpc.rundir import RunDir
from pearl_hpc.slurm.client import FORK_LOCK

END_TIMEOUT_S = 10.0  # a launch not gone this long after SIGTERM is killed


@dataclass
class _Launch:
    """One elastic component: its rank's launch (gforker) and GPUs."""

    source: ElasticSource
    gpu_ids: tuple[str, ...]
    devices: tuple[int, ...]  # the node's GPU numbers it runs on
    proc: subprocess.Popen[bytes]
    log_path: Path
    counted: bool = True  # available (not reclaimed, not given back)
    ended_early: bool = False  # ended before its rank joined: not replaced (it would again)


def join_argv(
    run_dir: Path,
    model_dir: str,
    group: str,
    gpu_ids: tuple[str, ...],
    devices: tuple[int, ...],
    gforker: str,
    setpriv: str | None = None,
) -> list[str]:
    """The launch of one local elastic rank on the node's GPUs ``devices`` (pure); with
    util-linux's ``setpriv`` it is SIGTERMed when the master dies (else its rank ends on
    the stale lease)."""
    return [
        *([setpriv, "--pdeathsig", "SIGTERM"] if setpriv else []),
        *one_node(1, gforker),
        sys.executable, "-m", "pearl_hpc.rank", "join", "--run-dir", str(run_dir),
        "--model-dir", model_dir, "--group", group, "--gpu-ids", ",".join(gpu_ids),
        "--devices", ",".join(map(str, devices)),
    ]  # fmt: skip


def free_devices(gpus: int, taken: set[int], count: int) -> tuple[int, ...]:
    """The lowest ``count`` GPU numbers of a node of ``gpus`` that are not ``taken``
    (pure); past the node's GPUs when it has too few free (such a rank refuses to start
    where the node has GPUs, naming them; on a CPU device it takes none)."""
    free = [d for d in range(gpus) if d not in taken]
    beyond = max([gpus - 1, *taken]) + 1
    free += range(beyond, beyond + count)
    return tuple(free[:count])


class LocalBackend:
    """Elastic ranks on this machine (a :class:`~.base.CapacityBackend`): the trace of
    the run config stands in for a scheduler (what is available), the controller's
    demand says how much of it to take."""

    def __init__(self, ctx: BackendContext) -> None:
        run_dir = ctx.run_dir
        self.run_dir = run_dir
        self.model_dir = ctx.model_dir
        self.members = ctx.members
        self.queue = ctx.queue
        self.clock = ctx.clock
        self.grace_s = ctx.cfg.elastic.grace_s
        self.on_event = ctx.on_event
        self.trace = TraceDriver(
            ctx.cfg.elastic,
            self.offer,
            first_step=ctx.first_step,
            resume=ctx.resume,
            clock=ctx.clock,
            on_event=ctx.on_event,
            decide_now=ctx.decide_now,
        )
        self.dir = RunDir(run_dir).elastic
        self._lease = MasterLease(RunDir(run_dir).lease)
        self.gforker = gforker_path()
        self.setpriv = shutil.which("setpriv")
        self.launches: dict[str, _Launch] = {}  # by component tag, in grant order
        self.offered = 0  # elastic workers the trace makes available
        self.wanted = 0  # ... and the controller's demand (the expansion gate)
        self.counts = {"granted": 0, "reclaimed": 0}
        self.gpus = ctx.cfg.layout.gpus_per_node  # this node's, the base ranks' first
        self.gpus_per_worker = ctx.cfg.layout.gpus_per_worker
        self.base_devices = {
            d for r in base_layout(ctx.cfg.workers, ctx.cfg.layout) for d in r.devices
        }
        self._ending: list[_Launch] = []  # given back, their processes not yet gone
        self._jobs = 0
        self._tasks: set[asyncio.Task[None]] = set()  # launches ending, replacements

    async def start(self) -> None:
        """Nothing to adopt: a dead master's ranks end once this one takes the lease."""

    async def before_rollout(self, step: int, spawn: Callable[[Awaitable[None]], None]) -> None:
        """The trace's point for ``step`` (``elastic.trace``)."""
        await self.trace.before_rollout(step, spawn)

    async def follow_trace(self, stop: asyncio.Event) -> None:
        """``elastic.replay`` over the run's clock, until ``stop`` (none: returns)."""
        if self.trace.elastic.replay.enabled:
            await self.trace.replay(stop)

    # ---------------------------------------------------------------- capacity
    def _counted(self) -> list[_Launch]:
        return [launch for launch in self.launches.values() if launch.counted]

    def live_workers(self) -> int:
        return len(self._counted())

    def starts_in_s(self) -> float:
        """The trace grants at once: a request starts now."""
        return 0.0

    def want(self, workers: int) -> None:
        """The controller's demand: granted as far as the trace offers."""
        self.wanted = workers
        self._spawn(self._follow(regrant=False))

    async def offer(self, workers: int, *, regrant: bool = False) -> None:
        """The trace's availability (``regrant``: what a dead master had, not growth):
        granted as far as the controller wants it; fewer than the run holds reclaims the
        last granted."""
        self.offered = workers
        await self._follow(regrant=regrant)

    async def _follow(self, *, regrant: bool) -> None:
        missing = min(self.offered, self.wanted) - len(self._counted())
        if missing > 0:
            await self._grant(missing, growth=not regrant)
        # what is held beyond the offer, read after the grant and marked before any
        # await (want and offer may follow at once): the last granted, first reclaimed
        reclaimed = list(reversed(self._counted()[self.offered :]))
        for launch in reclaimed:
            launch.counted = False
            self.counts["reclaimed"] += 1
        deadline = self.clock() + self.grace_s
        for launch in reclaimed:
            await self.queue.put(CapacityReclaimed(launch.source, deadline, launch.gpu_ids))

    async def _grant(self, workers: int, *, growth: bool) -> None:
        """One job of ``workers`` components, each one rank's launch; granted at once
        (the controller's start of a worker there waits for its rank to join)."""
        self._jobs += 1
        grants = []
        for k in range(workers):
            source = ElasticSource(f"el{self._jobs}", k)
            gpu_ids = tuple(f"{source.tag}:gpu{i}" for i in range(self.gpus_per_worker))
            self.launches[source.tag] = self._launch(source, gpu_ids)
            grants.append(CapacityGranted(source, (gpu_ids,)))
        if growth:
            self.counts["granted"] += workers
        self.on_event("launched", {"job": f"el{self._jobs}", "components": workers})
        first, *rest = grants
        await self.queue.put(CapacityGranted(first.source, first.gpu_sets, also=tuple(rest)))

    def _launch(self, source: ElasticSource, gpu_ids: tuple[str, ...]) -> _Launch:
        """One rank's launch, on GPUs of this node that neither a base rank nor another
        elastic rank (live, or given back and not yet ended) holds."""
        log_path = self.dir / f"{source.tag}.out"
        self._ending = [x for x in self._ending if x.proc.poll() is None]
        held = [*self.launches.values(), *self._ending]
        taken = self.base_devices | {d for x in held for d in x.devices}
        devices = free_devices(self.gpus, taken, len(gpu_ids))
        argv = join_argv(
            self.run_dir, self.model_dir, source.tag, gpu_ids, devices, self.gforker,
            self.setpriv,
        )  # fmt: skip
        with log_path.open("ab") as out, FORK_LOCK:  # no fork while MPI accepts a join
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return _Launch(source, gpu_ids, devices, proc, log_path)

    def release(self, source: ElasticSource) -> None:
        """Given back: its rank leaves the world, then its launch ends. A component whose
        rank died after joining, while the trace offers it and the controller wants it,
        is replaced by a new launch (one that never joined is not: its replacement would
        fail the same way)."""
        launch = self.launches.pop(source.tag, None)
        if launch is None:
            return  # given back already
        died = (
            MemberState.FAILED in self.members.group_state(source.tag)
            or launch.proc.poll() is not None
        )
        self.members.leave(source.tag)
        self._ending.append(launch)
        self._spawn(self._end(launch))
        missing = min(self.offered, self.wanted) - len(self._counted())
        if died and launch.counted and not launch.ended_early and missing > 0:
            self.on_event("replace", {"component": source.tag})
            self._spawn(self._grant(missing, growth=False))

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` as a task of the backend (awaited by :meth:`close`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end(self, launch: _Launch) -> None:
        """Its rank has left the world (or took ``LEAVE_TIMEOUT_S``): SIGTERM the launch,
        SIGKILL it after ``END_TIMEOUT_S``."""
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while not self.members.left(launch.source.tag) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.to_thread(_end_process, launch.proc)

    async def attach(
        self, source: ElasticSource, gpu_ids: tuple[str, ...], key: str, timeout_s: float
    ) -> RankWorker | None:
        tag = source.tag
        launch = self.launches.get(tag)
        if launch is None:
            return None  # given back already

        def ended() -> str | None:
            code = launch.proc.poll()
            if code is None:
                return None
            launch.ended_early = True
            return f"exit {code}; see {launch.log_path}"

        return await attach_rank(
            self.members,
            gpu_ids,
            key,
            timeout_s,
            tag=tag,
            ended=ended,
            release=lambda: self.release(source),
        )

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"component": tag, "state": "running" if launch.counted else "releasing",
             "pid": launch.proc.pid}
            for tag, launch in self.launches.items()
        ]  # fmt: skip

    def summary(self) -> dict[str, Any] | None:
        return None

    async def close(self) -> None:
        """Every launch ended (their ranks left the world before: ``leave_all``)."""
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        launches = list(self.launches.values())
        self.launches.clear()
        await asyncio.gather(*[asyncio.to_thread(_end_process, x.proc) for x in launches])
        self._lease.stop()


def _end_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launch's process group (gforker and its rank), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(END_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
