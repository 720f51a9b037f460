"""A run config checked against this machine before anything starts or is queued.

:func:`pearl_hpc.config.run.read_run_config` checks the values; this adds what needs the
installed runtimes: the environment and its options build, the task files load, the
dashboards' packages import, the trainer ranks and engines fit their GPUs (the memory
plan, when the trainer is on cuda and the model's shape is known), and (for a run that is
started, not described) Slurm's commands are on PATH. Every problem is one
:class:`~pearl_hpc.errors.ConfigError` line naming the field and the fix.
"""

from __future__ import annotations

import shutil
from importlib.util import find_spec
from pathlib import Path

from pearl_hpc.config.memory import memory_plan, run_shape, trainer_on_gpu
from pearl_hpc.config.run import DashboardSettings, RunConfig, read_run_config
from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs.registry import check_environment
from pearl_hpc.rollout.tasks import load_tasks


def load_run_config(path: str | Path, *, need_slurm: bool = True) -> RunConfig:
    """Read and check a run config for this machine (``need_slurm=False``: a Slurm run
    described, not started, e.g. ``--dry-run``)."""
    cfg = read_run_config(path)
    if need_slurm and cfg.backend == "slurm" and not shutil.which("sbatch"):
        raise ConfigError(
            f"{path}: backend slurm needs the Slurm commands (sbatch not on PATH); run on a "
            "Slurm cluster (slurm/local-cluster.sh up for a local one) or use backend: local"
        )
    problem = dashboards_missing(cfg.dashboards)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    try:
        check_environment(cfg.run)
        load_tasks(cfg.run)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    shape = run_shape(cfg)
    if shape is not None and shape.experts and _engines_on_cpu(cfg):
        raise ConfigError(
            f"{path}: model {cfg.model} is a mixture of experts and the engines run on cpu, "
            "where vLLM's in-place weight reload does not reach its MoE kernels (the "
            "engines would roll out with the initial weights): set engine.device cuda"
        )
    problem = memory_plan(cfg, shape).problem if shape and trainer_on_gpu(cfg) else ""
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return cfg


def _engines_on_cpu(cfg: RunConfig) -> bool:
    """Engines on cpu: set so, or auto on the local backend of a machine without an
    NVIDIA GPU."""
    auto_cpu = cfg.backend == "local" and not Path("/dev/nvidiactl").exists()
    return cfg.engine.device == "cpu" or (cfg.engine.device == "auto" and auto_cpu)


def dashboards_missing(dashboards: DashboardSettings) -> str:
    """The package a configured dashboard needs, when it is not installed ('' if none)."""
    if dashboards.tensorboard and find_spec("tensorboard") is None:
        return "dashboards.tensorboard needs the tensorboard package: pip install tensorboard"
    if dashboards.wandb_project and find_spec("wandb") is None:
        return "dashboards.wandb_project needs the wandb package: pip install wandb"
    return ""
