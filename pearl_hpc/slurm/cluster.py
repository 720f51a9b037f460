"""What the live cluster has (``sinfo``), and what a run or a cluster's file asks that
it does not: checked before anything is queued.

    sinfo -h -o '%P|%D|%G|%c|%m|%a'   one line per group of like nodes of a partition
    base_problems(cfg, groups, job)   the base job's partition, GPUs (and their type),
    pool_problems(cfg, groups)        CPUs and nodes, and each pool's, against them
    shape_problems(cluster, groups)   a cluster file's node shapes against them

Problems are ``(key, message)``: the dotted key of the config that asks it (so a
cluster file's check names its line) and one line with the fix. Pure but for
:func:`read_sinfo`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pearl_hpc.config.cluster import ClusterFile
from pearl_hpc.config.run import RunConfig
from pearl_hpc.slurm.client import Runner, run_command
from pearl_hpc.slurm.scripts import JobSpec, render_sbatch

SINFO_FORMAT = "%P|%D|%G|%c|%m|%a"
_GPU = re.compile(r"gpu(?::([A-Za-z0-9_.-]+))?:(\d+)")


@dataclass(frozen=True)
class NodeGroup:
    """One ``sinfo`` line: nodes of a partition alike in GPUs, CPUs and memory."""

    partition: str
    default: bool  # the cluster's default partition
    nodes: int
    gpus: int
    gpu_type: str  # '' when the GRES is untyped
    cpus: int
    memory_mb: int
    up: bool


def parse_sinfo(text: str) -> list[NodeGroup]:
    """``sinfo -h -o SINFO_FORMAT`` lines (pure)."""
    groups = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 6:
            continue
        name, nodes, gres, cpus, mem, avail = parts
        gpus = gres_gpus(gres)
        groups.append(
            NodeGroup(
                partition=name.rstrip("*"),
                default=name.endswith("*"),
                nodes=_number(nodes),
                gpus=sum(n for _, n in gpus),
                gpu_type=gpus[0][0] if gpus else "",
                cpus=_number(cpus),
                memory_mb=_number(mem),
                up=avail == "up",
            )
        )
    return groups


def gres_gpus(gres: str) -> list[tuple[str, int]]:
    """The GPUs of a node's GRES as sinfo prints it (``gpu:a100:8(S:0-1),gpu:v100:4``):
    ``(type, count)`` each, type '' where untyped (pure)."""
    return [(m.group(1) or "", int(m.group(2))) for m in _GPU.finditer(gres)]


def _number(text: str) -> int:
    digits = re.match(r"\d+", text)
    return int(digits.group()) if digits else 0


def read_sinfo(run: Runner = run_command) -> list[NodeGroup] | str:
    """The cluster's node groups, or why Slurm did not answer (one line)."""
    result = run(["sinfo", "-h", "-o", SINFO_FORMAT], None)
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        return f"sinfo: {why}"
    return parse_sinfo(result.stdout)


def test_only(spec: JobSpec, run: Runner = run_command) -> str:
    """Why ``sbatch --test-only`` refuses ``spec`` ('' when it would take it)."""
    result = run(["sbatch", "--test-only"], render_sbatch(spec))
    if result.returncode == 0:
        return ""
    return (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]


def _partition(groups: list[NodeGroup], name: str) -> list[NodeGroup]:
    return [g for g in groups if (g.partition == name if name else g.default)]


def _missing(key: str, name: str, groups: list[NodeGroup]) -> tuple[str, str]:
    known = sorted({g.partition for g in groups})
    return key, f"{key} {name!r}: no such partition (sinfo has {', '.join(known)}); use one"


def _fit(key: str, what: str, asked: int, have: int, where: str) -> tuple[str, str] | None:
    if asked <= have:
        return None
    return key, f"{key}: {asked} {what}, but the nodes of {where} have at most {have}; lower it"


def base_problems(cfg: RunConfig, groups: list[NodeGroup], job: JobSpec) -> list[tuple[str, str]]:
    """The base job (``job``: its components' nodes, GPUs and CPUs a node; the node
    memory the layout names) against its partition."""
    s, parts = cfg.slurm, job.components
    nodes, gpus = sum(c.nodes for c in parts), max(c.gpus_per_node for c in parts)
    if nodes > 1:  # the layout's nodes hold layout.gpus_per_node, whatever the job asks
        gpus = max(gpus, cfg.layout.gpus_per_node)
    cpus = max(c.ntasks_per_node * c.cpus_per_task for c in parts)
    mine = _partition(groups, s.partition)
    if not mine:
        if s.partition:
            return [_missing("slurm.partition", s.partition, groups)]
        return [("slurm.partition", "slurm.partition: the cluster has no default; name one")]
    where = f"partition {mine[0].partition}"
    typed = [g for g in mine if not s.gpu_type or g.gpu_type == s.gpu_type]
    if not typed:
        types = sorted({g.gpu_type or "untyped" for g in mine})
        return [("slurm.gpu_type", f"slurm.gpu_type {s.gpu_type!r}: the GPUs of {where} are "
                 f"{', '.join(types)}; use that")]  # fmt: skip
    key = "layout.gpus_per_node" if nodes > 1 else "workers"
    out = [
        _fit(key, "GPUs a node", gpus, max(g.gpus for g in typed), where),
        _fit(
            "layout.cpus_per_rank",
            "CPUs a node (ranks x cpus_per_rank)",
            cpus,
            max(g.cpus for g in typed),
            where,
        ),
    ]
    memory = max(g.memory_mb for g in typed)
    if memory and cfg.layout.host_memory_gb * 1e9 / 2**20 > memory:  # (Slurm's MB: MiB)
        out.append(("layout.host_memory_gb", f"layout.host_memory_gb: "
                    f"{cfg.layout.host_memory_gb:g} GB, but the nodes of {where} have "
                    f"{memory} MB; lower it"))  # fmt: skip
    if nodes > sum(g.nodes for g in typed):
        have = sum(g.nodes for g in typed)
        out.append(("layout", f"layout: {nodes} nodes, but {where} has {have}; fewer nodes"))
    if not any(g.up for g in mine):
        out.append(("slurm.partition", f"slurm.partition: {where} is not up (sinfo)"))
    return [p for p in out if p]


def pool_problems(cfg: RunConfig, groups: list[NodeGroup]) -> list[tuple[str, str]]:
    """Each elastic pool's partition, and one worker's GPUs and CPUs, against the
    cluster."""
    out: list[tuple[str, str]] = []
    for i, pool in enumerate(cfg.elastic.pools if cfg.backend == "slurm" else []):
        key = f"elastic.pools.{i}"
        asks = [("gpus_per_worker", "GPUs", pool.gpus_per_worker, "gpus"),
                ("cpus_per_worker", "CPUs", pool.cpus_per_worker, "cpus")]  # fmt: skip
        out += _node_fits(key, f"{key}.partition", pool.partition, asks, groups)
    return out


def shape_problems(cluster: ClusterFile, groups: list[NodeGroup]) -> list[tuple[str, str]]:
    """A cluster file's node shapes against what ``sinfo`` reports."""
    out: list[tuple[str, str]] = []
    for i, shape in enumerate(cluster.nodes):
        asks = [("gpus", "GPUs", shape.gpus, "gpus"), ("cpus", "CPUs", shape.cpus, "cpus"),
                ("memory_mb", "MB", shape.memory_mb, "memory_mb")]  # fmt: skip
        for j, name in enumerate(shape.partitions):
            out += _node_fits(f"nodes.{i}", f"nodes.{i}.partitions.{j}", name, asks, groups)
            types = {g.gpu_type for g in _partition(groups, name)}
            if types and shape.gpu_type and shape.gpu_type not in types:
                have = ", ".join(sorted(t or "untyped" for t in types))
                why = f"nodes.{i}.gpu_type {shape.gpu_type!r}: partition {name}'s GPUs are {have}"
                out.append((f"nodes.{i}.gpu_type", why))
    return out


def _node_fits(
    prefix: str,
    name_key: str,
    name: str,
    asks: list[tuple[str, str, int, str]],
    groups: list[NodeGroup],
) -> list[tuple[str, str]]:
    """Partition ``name`` (set at ``name_key``) exists, and its nodes have what one node
    is asked: ``(field under prefix, what, asked, NodeGroup attribute)`` each."""
    mine = _partition(groups, name)
    if not mine:
        return [_missing(name_key, name, groups)]
    found = [
        _fit(f"{prefix}.{field}", what, asked, max(getattr(g, attr) for g in mine),
             f"partition {name}")
        for field, what, asked, attr in asks
    ]  # fmt: skip
    return [p for p in found if p]
