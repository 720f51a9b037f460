"""A run config checked against this machine before anything starts or is queued.

:func:`pearl_hpc.config.run.read_run_config` checks the values; this adds what needs the
installed runtimes: the environment and its options build, the task files load, the
dashboards' packages import, the trainer ranks and engines fit their GPUs (the memory
plan, when the trainer is on cuda and the model's shape is known), and (for a run that is
started, not described) Slurm's commands are on PATH. Every problem is one
:class:`~pearl_hpc.errors.ConfigError` line naming the field and the fix.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

from pearl_hpc.config.memory import memory_plan, run_shape, trainer_on_gpu
from pearl_hpc.config.run import DashboardSettings, RunConfig, read_run_config
from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs.registry import check_environment
from pearl_hpc.rollout.tasks import load_tasks


def load_run_config(
    path: str | Path, *, need_slurm: bool = True, sets: Sequence[str] = ()
) -> RunConfig:
    """Read and check a run config for this machine (``need_slurm=False``: a run
    described, not started, e.g. ``--dry-run``: neither Slurm's commands nor the model
    directory are looked for); ``sets``: ``--set key.path=value`` overrides."""
    cfg = read_run_config(path, sets)
    problem = model_problem(cfg.model) if need_slurm else ""
    if problem:
        raise ConfigError(f"{path}: {problem}")
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


def model_problem(model: str) -> str:
    """What keeps ``model`` from loading on a compute node ('' if nothing): a model
    directory with its config, tokenizer and weights; a hub id is not downloaded there."""
    if model == "tiny":
        return ""
    path = Path(model)
    if not path.is_dir():
        where = "" if path.is_absolute() else " (beside the config file)"
        if _HUB_ID.fullmatch(model):
            return (
                f"model {model}: no such directory{where}; set model to a model directory "
                "(a Hugging Face hub id is not downloaded on compute nodes: on a login "
                f"node, `huggingface-cli download {model} --local-dir DIR`, then model: DIR)"
            )
        return f"model {model}: no such directory{where}; set model to a model directory"
    missing = [
        what for what, names in _MODEL_FILES if not any(any(path.glob(name)) for name in names)
    ]
    if missing:
        return (
            f"model {model}: the directory has no {', '.join(missing)}; point model at a "
            "whole Hugging Face model directory (config, tokenizer, weights)"
        )
    return ""


_HUB_ID = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")
_MODEL_FILES = (
    ("config.json", ("config.json",)),
    ("tokenizer (tokenizer.json)", ("tokenizer.json", "tokenizer.model", "vocab.json")),
    ("weights (*.safetensors)", ("*.safetensors", "*.bin")),
)


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
