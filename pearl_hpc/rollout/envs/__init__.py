"""Agent environments: what a trajectory talks to between model turns.

- :mod:`.base`: the :class:`Environment` protocol, :class:`EnvStep`, option checks;
- :mod:`.registry`: ``run.env`` -> a factory (built-in, entry-point plugin, import path);
- built-ins: :mod:`.calc` (arithmetic with a sandboxed tool), :mod:`.code` (HumanEval
  with tests as the reward), :mod:`.synthetic` (controlled shape, for benchmarks).
"""

from pearl_hpc.rollout.envs.base import Environment, EnvStep, Task, options_config
from pearl_hpc.rollout.envs.calc import (
    CALC_SYMBOLS,
    CalcConfig,
    CalcEnv,
    CalcTask,
    arithmetic_candidate,
    calc_prompt,
    format_fraction,
    is_calc_expression,
    make_calc_task,
    parse_number,
)
from pearl_hpc.rollout.envs.registry import ENTRY_POINT_GROUP, ENV_NAMES, make_env, resolve
from pearl_hpc.rollout.envs.synthetic import Latency, SyntheticConfig, SyntheticEnv

__all__ = [
    "CALC_SYMBOLS",
    "ENTRY_POINT_GROUP",
    "ENV_NAMES",
    "CalcConfig",
    "CalcEnv",
    "CalcTask",
    "EnvStep",
    "Environment",
    "Latency",
    "SyntheticConfig",
    "SyntheticEnv",
    "Task",
    "arithmetic_candidate",
    "calc_prompt",
    "format_fraction",
    "is_calc_expression",
    "make_calc_task",
    "make_env",
    "options_config",
    "parse_number",
    "resolve",
]
