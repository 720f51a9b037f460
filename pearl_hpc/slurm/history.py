"""A cluster's own history as an availability trace: the GPUs of a partition's nodes that
no job held, over a window of the past, from Slurm's accounting.

    sinfo -N -h -p PARTITION -o '%N|%c|%G'      the partition's nodes, CPUs and GPUs
    sacct -a -X -D -n -P -S SINCE -E UNTIL -o JobID,JobName,Start,End,NodeList,NCPUS,AllocTRES
                                                every job that held any node then
    (``sacct -c``: the job completion log, where a cluster keeps no accounting database)

A GPU is idle while no job holds it and its node has a CPU no job holds: an exclusive job
takes every CPU, so its node's GPUs count as held even where its record names no GPU.
Where a record names none (the completion log never does; accounting does where
``AccountingStorageTRES`` has ``gres/gpu``), a job that shares its node holds no GPU
here. pearl_hpc's own elastic jobs (job name ``pearl-elastic``) count as idle: that
capacity was there for the run to take. The trace's count is idle GPUs, its time seconds
since the window's start: ``pearl-hpc simulate --trace`` reads it as the preemptible
rollout GPUs (spread over nodes however the jobs left them).

Pure but for :func:`read_history`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from pearl_hpc.config.traces import AvailabilityTrace
from pearl_hpc.slurm.client import CommandResult, Runner, run_command
from pearl_hpc.slurm.cluster import gres_gpus
from pearl_hpc.slurm.parse import expand_hostlist, slurm_time

SACCT_FIELDS = ("JobID", "JobName", "Start", "End", "NodeList", "NCPUS", "AllocTRES")
NODE_FORMAT = "%N|%c|%G"
OWN_JOB_NAME = "pearl-elastic"
_TRES_GPU = re.compile(r"(?:^|,)gres/gpu=(\d+)")


@dataclass(frozen=True)
class Node:
    """A node of the partition: what it has to hold."""

    cpus: int
    gpus: int


@dataclass(frozen=True)
class Hold:
    """One job's (or heterogeneous component's) hold on its nodes, epoch seconds."""

    job: str
    start_s: float
    end_s: float | None  # None: still running
    nodes: tuple[str, ...]
    cpus: int
    gpus: int | None  # None: its record names no GPU count
    own: bool  # a pearl_hpc elastic job


@dataclass(frozen=True)
class History:
    """What the trace was built from."""

    trace: AvailabilityTrace
    source: str  # "accounting" | "the job completion log"
    jobs: int  # other jobs' holds on the partition's nodes within the window
    nodes: int
    gpus: int


def parse_nodes(text: str) -> dict[str, Node]:
    """``sinfo -N -h -o NODE_FORMAT`` lines (a node listed twice, once per partition, is
    one node)."""
    nodes: dict[str, Node] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        name, cpus, gres = parts
        nodes[name] = Node(int(cpus), sum(n for _, n in gres_gpus(gres)))
    return nodes


def parse_sacct(text: str) -> list[Hold]:
    """``sacct -n -P -o SACCT_FIELDS`` lines: the jobs that started (a pending or
    never-started job holds nothing)."""
    holds = []
    for line in text.splitlines():
        parts = line.rstrip("\n").split("|")
        if len(parts) != len(SACCT_FIELDS):
            continue
        job, name, start, end, nodelist, cpus, tres = parts
        start_s = slurm_time(start)
        if start_s is None or not nodelist or nodelist.startswith("None"):
            continue
        gpus = _TRES_GPU.search(tres)
        holds.append(
            Hold(
                job=job,
                start_s=start_s,
                end_s=slurm_time(end),
                nodes=tuple(expand_hostlist(nodelist)),
                cpus=int(cpus) if cpus.isdigit() else 0,
                gpus=int(gpus.group(1)) if gpus else None,
                own=name == OWN_JOB_NAME,
            )
        )
    return holds


def idle_trace(
    holds: list[Hold], nodes: dict[str, Node], since_s: float, until_s: float, name: str
) -> tuple[AvailabilityTrace, int]:
    """Idle GPUs of ``nodes`` over ``[since_s, until_s]`` (the trace, at 0 = ``since_s``),
    and how many holds touched them then. Each hold is spread evenly over its nodes."""
    # (time, +1 taken / -1 given back, node, cpus, gpus): gives back before takes at a time
    changes: list[tuple[float, int, str, float, float]] = []
    touched = 0
    for h in holds:
        mine = [n for n in h.nodes if n in nodes]
        start, end = max(h.start_s, since_s), min(h.end_s or until_s, until_s)
        if h.own or not mine or end <= start:
            continue
        touched += 1
        share = len(h.nodes)
        for n in mine:
            cpus = h.cpus / share
            gpus = (h.gpus or 0) / share
            changes += [(start, 1, n, cpus, gpus), (end, -1, n, cpus, gpus)]
    changes.sort(key=lambda c: (c[0], c[1]))
    used = {n: [0.0, 0.0] for n in nodes}  # cpus, gpus held

    def idle(n: str) -> int:
        cpus, gpus = used[n]
        if cpus >= nodes[n].cpus - 1e-9:
            return 0
        return max(0, round(nodes[n].gpus - gpus))

    total = sum(idle(n) for n in nodes)
    times, counts = [0.0], [total]
    for t, sign, n, cpus, gpus in changes:
        if t >= until_s:  # what ends with the window: the last point keeps what held
            break
        before = idle(n)
        used[n][0] += sign * cpus
        used[n][1] += sign * gpus
        total += idle(n) - before
        at = t - since_s
        if at == times[-1]:
            counts[-1] = total
        elif total != counts[-1]:
            times.append(at)
            counts.append(total)
    if until_s - since_s > times[-1]:
        times.append(until_s - since_s)
        counts.append(counts[-1])
    return AvailabilityTrace(name, tuple(times), tuple(counts)), touched


def _sacct_time(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s).strftime("%Y-%m-%dT%H:%M:%S")


def _why(command: str, result: CommandResult) -> str:
    stderr = result.stderr.strip().splitlines()
    why = stderr[-1] if stderr else f"exit {result.returncode}"
    return why if why.startswith(command) else f"{command}: {why}"


def read_history(
    partition: str, since_s: float, until_s: float, run: Runner = run_command
) -> History | str:
    """The idle GPUs of ``partition`` over the window, from ``sinfo`` and ``sacct``
    (accounting, else the job completion log), or why not (one line with the fix)."""
    nodes_out = run(["sinfo", "-N", "-h", "-p", partition, "-o", NODE_FORMAT], None)
    if nodes_out.returncode != 0:
        return _why("sinfo", nodes_out)
    nodes = parse_nodes(nodes_out.stdout)
    if not nodes:
        return f"partition {partition!r} has no nodes (sinfo -p {partition}): name one sinfo lists"
    argv = [
        "sacct", "-a", "-X", "-D", "-n", "-P", "-S", _sacct_time(since_s),
        "-E", _sacct_time(until_s), "-o", ",".join(SACCT_FIELDS),
    ]  # fmt: skip
    source = "accounting"
    out = run(argv, None)
    if out.returncode != 0 and "accounting storage is disabled" in out.stderr:
        source = "the job completion log"
        out = run([*argv[:1], "-c", *argv[1:]], None)
    if out.returncode != 0:
        if "completion is disabled" in out.stderr:
            return (
                "sacct: this cluster keeps no job history (neither slurmdbd accounting nor "
                "JobCompType=jobcomp/filetxt in slurm.conf): ask its admins for one"
            )
        return _why("sacct", out)
    holds = parse_sacct(out.stdout)
    name = f"{partition}-idle"
    trace, touched = idle_trace(holds, nodes, since_s, until_s, name)
    return History(trace, source, touched, len(nodes), sum(n.gpus for n in nodes.values()))


def trace_csv(trace: AvailabilityTrace) -> str:
    """The trace as ``time_s,count`` lines (what :func:`~pearl_hpc.config.traces.load_trace`
    reads)."""
    rows = [f"{t:g},{c}" for t, c in zip(trace.times_s, trace.counts, strict=True)]
    return "\n".join(rows) + "\n"
