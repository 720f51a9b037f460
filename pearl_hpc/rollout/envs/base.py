"""What every environment is: the protocol the agent loop drives, and the helpers an
environment's options use (one strict check for built-in and plugin environments alike).

The agent loop makes one environment per trajectory with
:func:`~pearl_hpc.rollout.envs.make_env`, then::

    prompt = await env.reset(seed, task)     # the first user message
    loop:  step = await env.step(response)   # after every model turn, until step.done

- ``seed``: the same for every sample of a GRPO group, so they share their task;
- ``task``: the group's row of ``run.tasks`` (a dict, its ``"id"`` included), or None
  when the run has no task file and the environment draws its own task from ``seed``;
- ``step.observation`` is shown to the model as a ``user`` message, or as the chat
  template's ``tool`` message when ``step.role == "tool"`` (a tool's result);
- an environment may set ``tools`` (a list of JSON-schema function specs, as in
  ``tokenizer.apply_chat_template(tools=...)``): the chat template shows them in the
  system prompt and the model calls them as ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`` (:mod:`pearl_hpc.rollout.toolcalls` parses that);
- the trajectory's reward is the sum of the step rewards.

What an environment may and may not do: it is async and shares one event loop with every
other trajectory of the batch, so it awaits its I/O and never blocks the loop (run CPU
work or other programs with ``asyncio.create_subprocess_exec`` or ``asyncio.to_thread``,
and model-written code only through :func:`~pearl_hpc.rollout.sandbox.run_python`); it
keeps its state on the instance (instances share nothing); given the same seed, task and
actions it answers the same (a restarted master replays journaled turns to rebuild it).
An environment that raises, or takes longer than ``run.env_timeout_s`` for one call,
fails its own trajectory with that reason (kept out of training), never the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Protocol, TypeVar

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.sandbox import SandboxLimits, SandboxResult
from pearl_hpc.rollout.tasks import Task  # one row of run.tasks; "id" always set

ROLES = ("user", "tool")


@dataclass(frozen=True, slots=True)
class EnvStep:
    """What the environment answers to one model turn."""

    observation: str | None  # text shown to the model next turn; None when done
    reward: float  # this step's reward; the trajectory reward is the sum
    done: bool
    info: dict[str, Any] = field(default_factory=dict)  # diagnostics, never shown to the model
    role: str = "user"  # "tool": the observation is a tool's result (the template's tool role)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"EnvStep.role must be one of {ROLES}, got {self.role!r}")


class Environment(Protocol):
    """One trajectory's environment; the call order is in the module docstring."""

    name: str
    max_turns: int

    async def reset(self, seed: int, task: Task | None = None) -> str: ...

    async def step(self, action: str) -> EnvStep: ...


C = TypeVar("C")


def options_config(env: str, config_type: type[C], options: Mapping[str, Any]) -> C:
    """``config_type(**options)`` for a dataclass of options, strictly: an unknown name is
    a :class:`ConfigError` listing the valid ones, a wrong type names the field, the
    type wanted and the default. Nested dataclass fields take a mapping."""
    if not is_dataclass(config_type):
        raise TypeError(f"{config_type!r} is not a dataclass")
    by_name = {f.name: f for f in fields(config_type)}
    check_option_names(env, options, list(by_name))
    values: dict[str, Any] = {}
    for name, value in options.items():
        default = by_name[name].default
        if is_dataclass(default) and isinstance(value, Mapping):
            value = options_config(f"{env}.{name}", type(default), value)
        elif default is not MISSING and default is not None and not _same_kind(default, value):
            raise ConfigError(
                f"{env}.{name} must be {type(default).__name__} like its default "
                f"{default!r}, got {value!r}"
            )
        values[name] = value
    return config_type(**values)


def _same_kind(default: object, value: object) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, int | float):
        return isinstance(value, int | float)
    if isinstance(default, tuple | list):
        return isinstance(value, tuple | list | int)  # a count or a (low, high) range
    return isinstance(value, type(default))


def describe_output(result: SandboxResult) -> str:
    """Tool output as the model sees it: stdout, then the error line if the call failed."""
    parts = [result.stdout.strip()] if result.stdout.strip() else []
    if result.timed_out:
        parts.append("error: timed out")
    elif not result.ok:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        parts.append(f"error: {lines[-1].strip() if lines else f'exit code {result.exit_code}'}")
    return "\n".join(parts) or "(no output)"


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, the cut marked with ``...``."""
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


# --------------------------------------------------------------------- validation


def check_option_names(env: str, options: Mapping[str, Any], valid: list[str]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"{env}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}"
        )


def require_int(env: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{env}.{name} must be an integer >= {minimum}, got {value!r}")


def require_number(env: str, name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{env}.{name} must be a finite number >= 0, got {value!r}")


def require_limits(env: str, value: object) -> None:
    if not isinstance(value, SandboxLimits):
        raise ConfigError(
            f"{env}.limits must be SandboxLimits or a mapping of its fields, got {value!r}"
        )


def require_choice(env: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{env}.{name}={value!r} is unknown; valid: {', '.join(choices)}")
