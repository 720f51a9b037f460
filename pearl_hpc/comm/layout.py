"""The run's base ranks (pure): which rank runs what, on which node and GPUs, and which
die together.

Computed once per launch from the run config (:func:`base_layout`); every rank, the
launcher and the master read the same list. Failure domains: the master alone is the
base MPI world (:func:`world_of`); the trainer ranks are one launch (they die together:
FSDP's collectives), every engine rank another, each joining the master like an
elastic rank as group :func:`domain_group` (the domain, and which launch of it:
``trainers-0``, ``rank3-1``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pearl_hpc.config.run import LayoutConfig, WorkersConfig

_ONE_NODE = LayoutConfig()

MASTER, TRAINER, ENGINE = "master", "trainer", "engine"


@dataclass(frozen=True)
class RankSpec:
    """One process of the run's base MPI world."""

    rank: int
    kind: str  # MASTER | TRAINER | ENGINE
    gpu_ids: tuple[str, ...]  # the GPUs it runs on, as the role table names them
    index: int  # among the ranks of its kind
    node: int = 0  # which node of the base job (0: the first; the local backend: this one)
    devices: tuple[int, ...] = ()  # its GPUs' device numbers on that node
    overlap: bool = False  # an engine rank on training GPUs (time-shared with the trainers)


def base_layout(workers: WorkersConfig, layout: LayoutConfig = _ONE_NODE) -> list[RankSpec]:
    """The base world (pure): rank 0 the master (on the first node, no GPU), then one
    trainer rank per training GPU (filling the training nodes in order), then the
    reserved engines (on the rollout nodes, or the training nodes' spare GPUs), then the
    overlap engines (on the training GPUs, ``gpus_per_worker`` each); ranks are then
    numbered node by node, so each node runs a contiguous block of ranks (what the
    hostfile places)."""
    gpn, gpw = layout.gpus_per_node, layout.gpus_per_worker

    def place(first: int) -> tuple[int, tuple[int, ...]]:  # a flat GPU index -> node, devices
        return first // gpn, tuple(range(first % gpn, first % gpn + gpw))

    ranks = [RankSpec(0, MASTER, (), 0)]
    for i in range(workers.training_gpus):
        ranks.append(RankSpec(len(ranks), TRAINER, (f"train:{i}",), i, i // gpn, (i % gpn,)))
    base = layout.training_nodes * gpn if layout.rollout_nodes else workers.training_gpus
    for j in range(workers.reserved_rollout):
        node, devices = place(base + j * gpw)
        gpu_ids = tuple(f"rsv:{j * gpw + k}" for k in range(gpw))
        ranks.append(RankSpec(len(ranks), ENGINE, gpu_ids, j, node, devices))
    for k in range(workers.overlap):
        node, devices = place(k * gpw)
        gpu_ids = tuple(f"train:{k * gpw + d}" for d in range(gpw))
        index = workers.reserved_rollout + k
        ranks.append(RankSpec(len(ranks), ENGINE, gpu_ids, index, node, devices, overlap=True))
    by_node = sorted(ranks, key=lambda r: r.node)  # stable: rank 0 stays first
    return [replace(r, rank=i) for i, r in enumerate(by_node)]


TRAINERS = "trainers"  # the trainer ranks' failure domain


def world_of(layout: list[RankSpec]) -> list[RankSpec]:
    """The ranks of the base MPI world (pure): the master alone. The trainer ranks and
    each engine rank are launched apart (:func:`domains_of`)."""
    return [r for r in layout if r.kind == MASTER]


def trainers_of(layout: list[RankSpec]) -> list[RankSpec]:
    """The trainer ranks, in their launch's rank order (pure)."""
    return [r for r in layout if r.kind == TRAINER]


@dataclass(frozen=True)
class Domain:
    """Base ranks launched together, that die together: the trainer ranks, or one
    engine rank."""

    name: str  # trainers | rankR
    ranks: tuple[RankSpec, ...]

    @property
    def vital(self) -> bool:
        """The run cannot go on without it (the trainer ranks)."""
        return self.name == TRAINERS


def domains_of(layout: list[RankSpec]) -> list[Domain]:
    """The launches besides the world's (pure): the trainer ranks, then each engine rank."""
    engines = [Domain(domain_name(r), (r,)) for r in layout if r.kind == ENGINE]
    return [Domain(TRAINERS, tuple(trainers_of(layout))), *engines]


def domain_name(spec: RankSpec) -> str:
    """The failure domain a base rank belongs to (pure): ``trainers``, or ``rankR`` for
    engine rank R."""
    return TRAINERS if spec.kind == TRAINER else f"rank{spec.rank}"


def domain_group(name: str, attempt: int) -> str:
    """The control plane's group of launch ``attempt`` (0: the first) of domain ``name``
    (pure): ``trainers-0``, ``rank3-1``."""
    return f"{name}-{attempt}"


def domain_of(group: str) -> tuple[str, int] | None:
    """The domain a group is a launch of, and which launch (None: not one -- an elastic
    component's; pure)."""
    name, _, attempt = group.rpartition("-")
    is_rank = name.startswith("rank") and name[4:].isdigit()
    if (is_rank or name == TRAINERS) and attempt.isdigit():
        return name, int(attempt)
    return None


def ranks_per_node(layout: list[RankSpec]) -> list[int]:
    """How many ranks each node of the base job runs (pure)."""
    counts = [0] * (1 + max(r.node for r in layout))
    for r in layout:
        counts[r.node] += 1
    return counts


def gpus_per_node(layout: list[RankSpec]) -> list[int]:
    """How many GPUs each node of the base job has its ranks use (pure): its highest
    device number, plus one (devices are numbered from 0 on every node)."""
    used = [0] * (1 + max(r.node for r in layout))
    for r in layout:
        used[r.node] = max([used[r.node], *(d + 1 for d in r.devices)])
    return used


@dataclass(frozen=True)
class NodeGroup:
    """Consecutive nodes of the base job asked for alike: one component of its
    (heterogeneous) batch job."""

    first: int  # its first node's index
    nodes: int
    gpus: int  # GPUs a node
    tasks: int  # ranks a node (the busiest of its nodes)


def node_groups(layout: list[RankSpec]) -> list[NodeGroup]:
    """The base job's components (pure): runs of consecutive nodes that use as many GPUs,
    the trainer ranks' nodes all in the first (one ``srun`` step holds them: a node they
    use in part asks the most any of them uses)."""
    used, tasks = gpus_per_node(layout), ranks_per_node(layout)
    training = 1 + max(r.node for r in trainers_of(layout))
    spans = [(0, training, max(used[:training]))]
    for node in range(training, len(used)):
        first, count, gpus = spans[-1]
        if gpus == used[node]:
            spans[-1] = (first, count + 1, gpus)
        else:
            spans.append((node, 1, used[node]))
    return [NodeGroup(f, n, g, max(tasks[f : f + n])) for f, n, g in spans]


def cpu_threads(layout: list[RankSpec], rank: int, cpus: int) -> int:
    """A rank's share of its node's ``cpus`` (its compute threads; pure): the node's CPUs
    split evenly among the node's ranks, at least one."""
    return max(1, cpus // ranks_per_node(layout)[layout[rank].node])
