"""The cluster config (``configs/clusters/*.yaml``): where the base job runs, which
elastic jobs the master may submit, and the run's workload. Strict: an unknown key or a
bad value is an error naming the field (see :mod:`pearl_hpc.core.schema`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pearl_hpc.config import REPO_CONFIGS, load_yaml
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.schema import from_mapping, spec_field
from pearl_hpc.errors import ConfigError
from pearl_hpc.slurm.scripts import HetComponent


@dataclass(frozen=True)
class BaseJobConfig:
    partition: str = spec_field("partition of the base job", default="normal")
    nodes: int = spec_field("nodes of the base job", default=1, ge=1)
    gpus_per_node: int = spec_field("GPUs per node (0: none requested)", default=8, ge=0)
    gpus_per_worker: int = spec_field("GPUs of one worker (its TP size)", default=2, ge=1)
    num_training_workers: int = spec_field("ranks that train (one GPU set each)", default=1, ge=1)
    num_rollout_workers: int = spec_field("reserved rollout ranks of the base job", default=1, ge=0)
    cpus_per_task: int = spec_field("CPUs per rank", default=1, ge=1)
    time_limit: str = spec_field("Slurm time limit of the base job", default="01:00:00")

    @property
    def num_tasks(self) -> int:
        return 1 + self.num_training_workers + self.num_rollout_workers


@dataclass(frozen=True)
class ComponentConfig:
    shape: str = spec_field("what the component is for: prefill | decode | any", default="any")
    partition: str = spec_field("partition (usually the preemptible one)", default="elastic")
    nodes: int = spec_field("nodes", default=1, ge=1)
    gpus_per_node: int = spec_field("GPUs per node", default=8, ge=1)
    time_limit: str = spec_field("Slurm time limit", default="01:00:00")

    def __post_init__(self) -> None:
        if self.shape not in ("prefill", "decode", "any"):
            raise ConfigError(f"shape {self.shape!r}: use prefill, decode or any")


def _check_data_plane(value: str) -> None:
    if value not in ("off", "auto", "gloo", "nccl"):
        raise ConfigError(f"run.data_plane {value!r}: use off, auto, gloo or nccl")


@dataclass(frozen=True)
class ReleaseConfig:
    component: int = spec_field("component index (0 = first) to give back", ge=0)
    at_step: int = spec_field("training step at whose start it is given back", ge=0)


@dataclass(frozen=True)
class RequestConfig:
    at_step: int = spec_field("training step at whose start the job is submitted", ge=0)
    components: list[ComponentConfig] = spec_field("one per role shape (hetjob)")
    release: list[ReleaseConfig] = spec_field("components given back early", default=[])


@dataclass(frozen=True)
class ElasticConfig:
    pending_timeout_s: float = spec_field(
        "cancel an elastic job still pending after this long", default=600.0, gt=0
    )
    grace_s: float = spec_field(
        "preemption grace time of the elastic partition (GraceTime)", default=20.0, gt=0
    )
    signal: str = spec_field(
        "sbatch --signal of elastic jobs (delivered at preemption)", default="B:USR2@30"
    )
    poll_s: float = spec_field("squeue interval, seconds", default=1.0, gt=0)
    requests: list[RequestConfig] = spec_field("elastic jobs to submit", default=[])


@dataclass(frozen=True)
class RunConfig:
    """The workload. Until the engines exist (issue 5) it is a no-op: a rollout phase
    of ``rollout_s`` and a training step of ``train_s`` per step, with every control
    mechanism (joins, roles, Split, borrowing, release, preemption) real."""

    steps: int = spec_field("training steps", default=3, ge=1)
    rollout_s: float = spec_field("no-op rollout phase per step, seconds", default=5.0, ge=0)
    train_s: float = spec_field("no-op training step, seconds", default=1.0, ge=0)
    data_plane: str = spec_field(
        "torch.distributed groups per plan: off | auto (NCCL with GPUs, else gloo) | gloo | nccl",
        default="auto",
    )
    heartbeat_interval_s: float = spec_field("member heartbeat period", default=0.5, gt=0)
    heartbeat_timeout_s: float = spec_field(
        "a member silent this long is failed", default=5.0, gt=0
    )


@dataclass(frozen=True)
class ClusterConfig:
    name: str = spec_field("cluster name (labels runs)")
    runs_dir: str = spec_field("where run directories go (relative: to the working dir)")
    profile: str = spec_field("workload profile YAML (relative: to configs/)")
    mpi: str = spec_field("srun --mpi plugin for MPI ranks (MPICH: pmi2)", default="pmi2")
    policy: PolicyConfig = spec_field("controller policies", default=PolicyConfig())
    base: BaseJobConfig = spec_field("the base job", default=BaseJobConfig())
    elastic: ElasticConfig = spec_field("elastic capacity", default=ElasticConfig())
    run: RunConfig = spec_field("the workload", default=RunConfig())

    def base_component(self) -> HetComponent:
        b = self.base
        return HetComponent(
            partition=b.partition,
            nodes=b.nodes,
            gpus_per_node=b.gpus_per_node,
            ntasks_per_node=-(-b.num_tasks // b.nodes),
            cpus_per_task=b.cpus_per_task,
            time_limit=b.time_limit,
        )

    def elastic_component(self, comp: ComponentConfig) -> HetComponent:
        per_node = comp.gpus_per_node // self.base.gpus_per_worker
        if per_node < 1 or comp.gpus_per_node % self.base.gpus_per_worker:
            raise ConfigError(
                f"elastic component: gpus_per_node {comp.gpus_per_node} is not a multiple "
                f"of base.gpus_per_worker {self.base.gpus_per_worker}"
            )
        return HetComponent(
            partition=comp.partition,
            nodes=comp.nodes,
            gpus_per_node=comp.gpus_per_node,
            ntasks_per_node=per_node,
            time_limit=comp.time_limit,
        )

    def profile_path(self) -> Path:
        path = Path(self.profile)
        return path if path.is_absolute() else REPO_CONFIGS / path


def load_cluster(path: str | Path) -> ClusterConfig:
    cfg = from_mapping(ClusterConfig, load_yaml(path), where=str(path))
    _check_data_plane(cfg.run.data_plane)
    for i, request in enumerate(cfg.elastic.requests):
        for comp in request.components:
            cfg.elastic_component(comp)
        for rel in request.release:
            if rel.component >= len(request.components):
                raise ConfigError(
                    f"{path}: elastic.requests[{i}].release: component {rel.component} "
                    f"but the request has {len(request.components)}"
                )
    return cfg
