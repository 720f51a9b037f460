"""The simulator's workload (``configs/workloads/*.yaml``, ``pearl-hpc simulate
--workload``): the shape of SWE-bench-like agentic trajectories that
:class:`pearl_hpc.sim.workload.WorkloadGenerator` draws from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.config.files import load_yaml
from pearl_hpc.core.schema import from_mapping, spec_field


@dataclass(frozen=True)
class WorkloadConfig:
    """Keys of ``configs/workloads/*.yaml``."""

    batch_size: int = spec_field("trajectories per rollout batch (training step)", default=64, gt=0)
    group_size: int = spec_field("trajectories per task (GRPO group)", default=16, gt=0)
    staleness: int = spec_field("max weight versions rollout may lag training", default=1, ge=0)
    max_trajectory_tokens: int = spec_field("context cap of a trajectory", default=32768, gt=0)
    prompt_tokens_median: float = spec_field("task prompt tokens, median", default=2500, gt=0)
    prompt_tokens_sigma: float = spec_field("log-normal sigma of prompt tokens", default=0.4, ge=0)
    turns_median: float = spec_field("turns per trajectory, median", default=24, gt=0)
    turns_sigma: float = spec_field("log-normal sigma of turns", default=0.5, ge=0)
    task_difficulty_sigma: float = spec_field(
        "log-normal sigma of the per-task factor on turns", default=0.3, ge=0
    )
    max_turns: int = spec_field("hard cap on turns", default=100, gt=0)
    obs_tokens_median: float = spec_field("observation tokens per turn, median", default=450, gt=0)
    obs_tokens_sigma: float = spec_field(
        "log-normal sigma of observation tokens", default=1.0, ge=0
    )
    obs_tokens_max: int = spec_field("cap on one observation", default=8192, gt=0)
    gen_tokens_median: float = spec_field(
        "generated tokens per turn (reasoning + answer), median", default=900, gt=0
    )
    gen_tokens_sigma: float = spec_field("log-normal sigma of generated tokens", default=0.6, ge=0)
    gen_tokens_max: int = spec_field("max_tokens of one response", default=4096, gt=0)
    kept_tokens_median: float = spec_field(
        "tokens of a response kept in later context (answer / tool call), median",
        default=150,
        gt=0,
    )
    kept_tokens_sigma: float = spec_field("log-normal sigma of kept tokens", default=0.5, ge=0)
    env_s_median: float = spec_field("environment time per turn, median seconds", default=2.5, gt=0)
    env_s_sigma: float = spec_field("log-normal sigma of environment time", default=1.0, ge=0)
    env_s_max: float = spec_field("cap on one environment step, seconds", default=120.0, gt=0)
    prefix_reuse: bool = spec_field(
        "a turn's prompt extends the previous one (false: the agent rewrites its history "
        "-- truncated or summarised observations -- so every turn prefills its context)",
        default=True,
    )

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "workload") -> WorkloadConfig:
        return from_mapping(cls, data, where=where)

    @classmethod
    def load(cls, path: str | Path) -> WorkloadConfig:
        return cls.from_dict(load_yaml(path), where=str(path))
