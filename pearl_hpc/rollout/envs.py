"""Agent environments: what a trajectory talks to between model turns.

The agent loop makes one environment per trajectory with :func:`make_env`, calls
``reset(seed)`` for the first user message, then ``step(response_text)`` after every
model turn until ``done``. Instances share no state, so dozens live in one event loop.
The trajectory reward is the sum of the step rewards.

``"calc"`` — arithmetic with a real tool and a verifiable reward
-------------------------------------------------------------------
``reset(seed)`` asks for the value of an integer expression such as ``37 * 4 + 12``
(2-3 operands in ``[2, max_operand]``, operators ``+ - *``; same seed, same task).
Each ``step(action)`` does exactly one of:

1. ``<answer>N</answer>`` present: the episode ends; N is the value.
2. else the first ``<python>CODE</python>`` or ``<calc>EXPR</calc>``: CODE, or
   ``print(EXPR)`` when EXPR uses only digits, spaces and ``+ - * / ( ) .``, runs in the
   sandbox (:func:`~pearl_hpc.rollout.sandbox.run_python`); the observation is its
   output; the value is the last line of stdout when it is a number.
3. else the longest run of the action made of digits, spaces and ``+ - * / ( ) .``
   that is a valid expression (``**`` refused) runs as in ``<calc>``; the observation
   reports ``EXPR = RESULT``. This is what a random policy, which never writes tags,
   gets feedback and reward from.

Without ``<answer>`` the episode ends after ``max_turns`` steps. With
``T = max_turns``, ``t`` the 1-based turn of this step and ``f`` the *format
fraction* — of the action's non-space characters, once the tag markup
``<python> </python> <calc> </calc> <answer> </answer>`` is removed, the share that are
digits or ``+ - * / ( ) .`` (0 for an empty action) — the step reward is exactly::

    reward = format_weight * f * slots / T  +  correct_weight * first_hit

where ``slots`` is 1, or ``T - t + 1`` for an ``<answer>`` step (an early answer fills
the turns it leaves unused, so answering early never loses format reward), and
``first_hit`` is 1 when this step's value equals the target (within 1e-6 relative) and
no earlier step of the episode had hit it, else 0. A trajectory's reward is therefore
``format_weight * (mean f over the T turn slots) + correct_weight * [target reached]``,
in ``[0, format_weight + correct_weight]``, and a step's reward is determined by the
action, the turn and whether the target was already reached.

``"synthetic"`` — a stand-in with controlled shape, for benchmarks
-----------------------------------------------------------------
``reset(seed)`` draws from ``random.Random(seed)`` the number of turns (``num_turns``,
fixed or a uniform inclusive range), the words of the prompt and of each observation
(``observation_words``, fixed or a range) and a target length ``L`` in characters
(uniform in ``target_chars``). Each step first waits ``await sleep_fn(latency)`` with
the latency drawn from ``latency`` (see :class:`Latency`) by a second generator seeded
from the same seed, then rewards the response length::

    reward = max(0, 1 - |len(action) - L| / L) / num_turns

so a trajectory's reward is in ``[0, 1]`` and depends only on the seed and the actions.
"""

from __future__ import annotations

import ast
import asyncio
import math
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.sandbox import (
    DEFAULT_LIMITS,
    SandboxLimits,
    SandboxResult,
    require_sandbox,
    run_python,
)

SleepFn = Callable[[float], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class EnvStep:
    """What the environment answers to one model turn."""

    observation: str | None  # text shown to the model next turn; None when done
    reward: float  # this step's reward; the trajectory reward is the sum
    done: bool
    info: dict[str, Any] = field(default_factory=dict)  # diagnostics, never shown to the model


class Environment(Protocol):
    """One trajectory's environment; see the module docstring for the call order."""

    name: str
    max_turns: int

    async def reset(self, seed: int) -> str: ...

    async def step(self, action: str) -> EnvStep: ...


# --------------------------------------------------------------------------- calc

CALC_SYMBOLS = frozenset("+-*/().")  # what <calc> accepts besides digits and spaces
_TAG_MARKUP = re.compile(r"</?(?:python|calc|answer)>")
_TOOL_CALL = re.compile(r"<(python|calc)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARITHMETIC_RUN = re.compile(r"[0-9+\-*/(). ]+")
_NO_TOOL_HINT = (
    "no arithmetic found; compute with <calc>EXPR</calc> or <python>CODE</python>, "
    "then reply <answer>N</answer>"
)


@dataclass(frozen=True, slots=True)
class CalcConfig:
    """Options of the ``"calc"`` environment (``make_env("calc", **options)``)."""

    max_turns: int = 3  # steps before the episode ends without an <answer>
    format_weight: float = 0.5  # weight of the dense format fraction (see module doc)
    correct_weight: float = 1.0  # paid once, when a value first equals the target
    max_operand: int = 99  # operands are drawn from [2, max_operand]
    max_observation_chars: int = 256  # tool output shown to the model is cut to this
    limits: SandboxLimits = DEFAULT_LIMITS  # per tool call; a mapping of its fields works

    def __post_init__(self) -> None:
        _require_int("calc", "max_turns", self.max_turns, minimum=1)
        _require_int("calc", "max_operand", self.max_operand, minimum=2)
        _require_int("calc", "max_observation_chars", self.max_observation_chars, minimum=16)
        _require_number("calc", "format_weight", self.format_weight)
        _require_number("calc", "correct_weight", self.correct_weight)
        if not isinstance(self.limits, SandboxLimits):
            raise ConfigError(
                f"calc.limits must be SandboxLimits or a mapping of its fields, got {self.limits!r}"
            )


@dataclass(frozen=True, slots=True)
class CalcTask:
    """One arithmetic question and its answer."""

    expression: str  # e.g. "37 * 4 + 12"
    target: int


def make_calc_task(seed: int, max_operand: int = 99) -> CalcTask:
    """2-3 operands joined by ``+ - *``; the target follows the usual precedence."""
    rng = random.Random(seed)
    operands = [rng.randint(2, max_operand) for _ in range(rng.choice((2, 3)))]
    operators = [rng.choice("+-*") for _ in operands[1:]]
    expression = str(operands[0])
    for op, x in zip(operators, operands[1:], strict=True):
        expression += f" {op} {x}"
    return CalcTask(expression, _integer_value(operands, operators))


def _integer_value(operands: list[int], operators: list[str]) -> int:
    """Products bind first, then the signed terms are summed."""
    terms = [operands[0]]
    for op, x in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x if op == "+" else -x)
    return sum(terms)


def calc_prompt(task: CalcTask) -> str:
    return (
        f"What is {task.expression}? Use <python>...</python> or <calc>...</calc> to "
        "compute, then reply <answer>N</answer>."
    )


def format_fraction(action: str) -> float:
    """Share of the non-space characters (tag markup removed) that are digits or
    calculator symbols; 0.0 for an action with none."""
    chars = [c for c in _TAG_MARKUP.sub("", action) if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c.isdigit() or c in CALC_SYMBOLS for c in chars) / len(chars)


def is_calc_expression(expr: str) -> bool:
    """Digits, spaces and ``+ - * / ( ) .`` only, at least one digit, no ``**`` (powers
    would let a short expression run for minutes), and valid Python syntax."""
    if not any(c.isdigit() for c in expr) or "**" in expr:
        return False
    if any(not (c.isdigit() or c == " " or c in CALC_SYMBOLS) for c in expr):
        return False
    try:
        ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def arithmetic_candidate(action: str) -> str | None:
    """The longest valid calculator expression in free text (first one on ties).

    Each maximal run of calculator characters is trimmed of spaces, leading ``* / )``
    and trailing ``+ - * / ( .`` before it is checked.
    """
    best: str | None = None
    for run in _ARITHMETIC_RUN.findall(action):
        expr = run.strip(" ").lstrip("*/) ").rstrip("+-*/(. ")
        if is_calc_expression(expr) and (best is None or len(expr) > len(best)):
            best = expr
    return best


def parse_number(text: str) -> float | None:
    """A finite number written in ``text`` (surrounding spaces allowed), else None."""
    try:
        value = float(text.strip())
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _literal_value(expr: str) -> float | None:
    """The value of a plain number literal (parsed, not executed), else None."""
    body = ast.parse(expr, mode="eval").body
    if not isinstance(body, ast.Constant) or not isinstance(body.value, int | float):
        return None
    try:
        return float(body.value)
    except OverflowError:  # a huge literal: let the sandbox print it
        return None


def _matches(value: float | None, target: int) -> bool:
    return value is not None and abs(value - target) <= 1e-6 * max(1.0, abs(target))


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


def _stdout_value(result: SandboxResult) -> float | None:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return parse_number(lines[-1]) if result.ok and lines else None


@dataclass(slots=True)
class _ToolOutcome:
    tool: str | None  # "python", "calc", "expression" or None (nothing to run)
    observation: str
    value: float | None
    sandbox_wall_s: float = 0.0


class CalcEnv:
    """The ``"calc"`` environment; reward and rules are in the module docstring."""

    name = "calc"

    def __init__(self, config: CalcConfig | None = None) -> None:
        require_sandbox()  # no bubblewrap: one line saying what to install
        self.config = config or CalcConfig()
        self.max_turns = self.config.max_turns
        self._task: CalcTask | None = None
        self._turn = 0
        self._solved = False
        self._done = False

    @classmethod
    def from_options(cls, **options: Any) -> CalcEnv:
        _check_option_names("calc", options, [f.name for f in fields(CalcConfig)])
        if isinstance(options.get("limits"), Mapping):
            options["limits"] = _limits_from_mapping(options["limits"])
        return cls(CalcConfig(**options))

    @property
    def task(self) -> CalcTask:
        if self._task is None:
            raise RuntimeError("calc environment: call reset(seed) before using it")
        return self._task

    async def reset(self, seed: int) -> str:
        self._task = make_calc_task(seed, self.config.max_operand)
        self._turn, self._solved, self._done = 0, False, False
        return calc_prompt(self._task)

    async def step(self, action: str) -> EnvStep:
        task = self.task
        if self._done:
            raise RuntimeError("calc environment: step() after done; reset() first")
        self._turn += 1
        answer = _ANSWER.search(action)
        if answer is not None:
            outcome = _ToolOutcome("answer", "", parse_number(answer.group(1)))
        else:
            outcome = await self._run_tool(action)
        self._done = answer is not None or self._turn >= self.max_turns
        first_hit = _matches(outcome.value, task.target) and not self._solved
        self._solved = self._solved or first_hit
        fraction = format_fraction(action)
        slots = self.max_turns - self._turn + 1 if answer is not None else 1
        format_reward = self.config.format_weight * fraction * slots / self.max_turns
        correct_reward = self.config.correct_weight if first_hit else 0.0
        info = {
            "turn": self._turn,
            "tool": outcome.tool,
            "tool_output": outcome.observation,
            "value": outcome.value,
            "target": task.target,
            "correct": first_hit,
            "solved": self._solved,
            "format_fraction": fraction,
            "format_reward": format_reward,
            "correct_reward": correct_reward,
            "sandbox_wall_s": outcome.sandbox_wall_s,
        }
        observation = None if self._done else outcome.observation
        return EnvStep(observation, format_reward + correct_reward, self._done, info)

    async def _run_tool(self, action: str) -> _ToolOutcome:
        call = _TOOL_CALL.search(action)
        if call is not None and call.group(1) == "python":
            return await self._execute("python", call.group(2), prefix="")
        if call is not None:
            expr = call.group(2).strip()
            if not is_calc_expression(expr):
                return _ToolOutcome(
                    "calc",
                    "error: <calc> takes digits, spaces and + - * / ( ) . only "
                    "(no **), as a valid expression",
                    None,
                )
            return await self._execute("calc", f"print({expr})", prefix="")
        expr = arithmetic_candidate(action)
        if expr is None:
            return _ToolOutcome(None, _NO_TOOL_HINT, None)
        literal = _literal_value(expr)
        if literal is not None:  # nothing to compute: no process for a bare number
            observation = clip(f"{expr} = {expr}", self.config.max_observation_chars)
            return _ToolOutcome("expression", observation, literal)
        return await self._execute("expression", f"print({expr})", prefix=f"{expr} = ")

    async def _execute(self, tool: str, code: str, prefix: str) -> _ToolOutcome:
        result = await run_python(code, self.config.limits)
        observation = clip(prefix + describe_output(result), self.config.max_observation_chars)
        return _ToolOutcome(tool, observation, _stdout_value(result), result.wall_s)


def _limits_from_mapping(raw: Mapping[str, Any]) -> SandboxLimits:
    valid = [f.name for f in fields(SandboxLimits)]
    _check_option_names("calc.limits", dict(raw), valid)
    return SandboxLimits(**raw)


# ---------------------------------------------------------------------- synthetic

LATENCY_PARAMS: dict[str, tuple[str, ...]] = {
    "constant": ("value_s",),
    "uniform": ("low_s", "high_s"),
    "exponential": ("mean_s",),
    "lognormal": ("mean_s", "sigma"),
}


@dataclass(frozen=True, slots=True)
class Latency:
    """How long one environment step takes, in seconds.

    - ``constant``: always ``value_s``;
    - ``uniform``: uniform in ``[low_s, high_s]``;
    - ``exponential``: mean ``mean_s``;
    - ``lognormal``: mean ``mean_s`` (of the latency, not of its log) and log-space
      standard deviation ``sigma``, i.e. ``exp(N(ln(mean_s) - sigma**2 / 2, sigma))``,
      the heavy-tailed shape of real tool calls.

    Given as a number (constant seconds) or a mapping such as
    ``{"dist": "lognormal", "mean_s": 0.5, "sigma": 0.6}``; see :meth:`parse`.
    """

    dist: str = "constant"
    value_s: float = 0.0
    low_s: float = 0.0
    high_s: float = 0.0
    mean_s: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.dist not in LATENCY_PARAMS:
            raise ConfigError(
                f"latency.dist={self.dist!r} is unknown; valid: {', '.join(LATENCY_PARAMS)}"
            )
        for name in ("value_s", "low_s", "high_s", "mean_s", "sigma"):
            _require_number("latency", name, getattr(self, name))
        if self.dist == "uniform" and self.low_s > self.high_s:
            raise ConfigError(
                f"latency.low_s={self.low_s} exceeds latency.high_s={self.high_s}; swap them"
            )
        if self.dist in ("exponential", "lognormal") and self.mean_s <= 0:
            raise ConfigError(
                f"latency.mean_s must be > 0 for the {self.dist} distribution, got "
                f"{self.mean_s}; use 'constant' with value_s 0 for no latency"
            )

    @classmethod
    def parse(cls, spec: Latency | Mapping[str, Any] | float) -> Latency:
        """A number is a constant latency; a mapping needs ``dist`` and exactly the
        parameters of that distribution (see :data:`LATENCY_PARAMS`)."""
        if isinstance(spec, Latency):
            return spec
        if isinstance(spec, int | float) and not isinstance(spec, bool):
            return cls("constant", value_s=float(spec))
        if not isinstance(spec, Mapping):
            raise ConfigError(
                f"latency must be a number of seconds or a mapping with 'dist', got {spec!r}"
            )
        dist = spec.get("dist")
        if dist not in LATENCY_PARAMS:
            raise ConfigError(
                f"latency.dist={dist!r} is unknown; valid: {', '.join(LATENCY_PARAMS)}"
            )
        params = {k: v for k, v in spec.items() if k != "dist"}
        expected = LATENCY_PARAMS[dist]
        unknown = sorted(set(params) - set(expected))
        missing = [p for p in expected if p not in params]
        if unknown or missing:
            raise ConfigError(
                f"latency with dist={dist!r} takes exactly {', '.join(expected)}; "
                f"unknown: {unknown or 'none'}, missing: {missing or 'none'}"
            )
        return cls(dist, **params)

    def sample_s(self, rng: random.Random) -> float:
        if self.dist == "constant":
            return self.value_s
        if self.dist == "uniform":
            return rng.uniform(self.low_s, self.high_s)
        if self.dist == "exponential":
            return rng.expovariate(1.0 / self.mean_s)
        return rng.lognormvariate(math.log(self.mean_s) - self.sigma**2 / 2, self.sigma)

    def mean_s_expected(self) -> float:
        """The distribution's mean, for reports and tests."""
        if self.dist == "constant":
            return self.value_s
        if self.dist == "uniform":
            return (self.low_s + self.high_s) / 2
        return self.mean_s


IntRange = tuple[int, int]


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """Options of the ``"synthetic"`` environment (``make_env("synthetic", **options)``).

    A count given as ``(low, high)`` (or a 2-item list) is drawn uniformly, inclusive,
    per reset; an int is fixed.
    """

    num_turns: int | IntRange = 3  # model turns per episode
    observation_words: int | IntRange = 32  # words in each observation
    prompt_words: int = 32  # words of filler in the first user message
    target_chars: int | IntRange = (16, 256)  # range of the rewarded response length L
    latency: Latency = field(default_factory=Latency)  # per step; a number or mapping works

    def __post_init__(self) -> None:
        _require_count_or_range("num_turns", self.num_turns, minimum=1)
        _require_count_or_range("observation_words", self.observation_words, minimum=0)
        _require_int("synthetic", "prompt_words", self.prompt_words, minimum=0)
        _require_count_or_range("target_chars", self.target_chars, minimum=1)
        if not isinstance(self.latency, Latency):
            raise ConfigError(
                f"synthetic.latency must be a Latency, number or mapping, got {self.latency!r}"
            )


_WORDS = (  # filler vocabulary the tiny model's tokenizer knows
    *("the", "tool", "returned", "value", "result", "number", "step", "output", "ok"),
    *("status", "done", "compute", "sum", "product", "observation", "answer", "error"),
    *("retry", "page", "row", "field", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"),
)


class SyntheticEnv:
    """The ``"synthetic"`` environment; rules and reward are in the module docstring."""

    name = "synthetic"

    def __init__(self, config: SyntheticConfig | None = None, sleep_fn: SleepFn = asyncio.sleep):
        self.config = config or SyntheticConfig()
        self.max_turns = _upper(self.config.num_turns)
        self._sleep_fn = sleep_fn
        self._rng: random.Random | None = None
        self._latency_rng = random.Random(0)
        self._num_turns = 0
        self._target_chars = 1
        self._turn = 0

    @classmethod
    def from_options(cls, **options: Any) -> SyntheticEnv:
        valid = [f.name for f in fields(SyntheticConfig)]
        _check_option_names("synthetic", options, [*valid, "sleep_fn"])
        sleep_fn = options.pop("sleep_fn", asyncio.sleep)
        if "latency" in options:
            options["latency"] = Latency.parse(options["latency"])
        for name in ("num_turns", "observation_words", "target_chars"):
            if isinstance(options.get(name), list):
                options[name] = tuple(options[name])
        return cls(SyntheticConfig(**options), sleep_fn=sleep_fn)

    async def reset(self, seed: int) -> str:
        self._rng = random.Random(seed)
        self._latency_rng = random.Random(f"latency:{seed}")  # str seeds are stable
        self._num_turns = _draw(self._rng, self.config.num_turns)
        self._target_chars = _draw(self._rng, self.config.target_chars)
        self._turn = 0
        filler = _words(self._rng, self.config.prompt_words)
        return f"Task {seed}: reply with about {self._target_chars} characters. {filler}".strip()

    async def step(self, action: str) -> EnvStep:
        if self._rng is None:
            raise RuntimeError("synthetic environment: call reset(seed) before step()")
        if self._turn >= self._num_turns:
            raise RuntimeError("synthetic environment: step() after done; reset() first")
        self._turn += 1
        latency_s = self.config.latency.sample_s(self._latency_rng)
        await self._sleep_fn(latency_s)
        closeness = 1.0 - abs(len(action) - self._target_chars) / self._target_chars
        reward = max(0.0, closeness) / self._num_turns
        done = self._turn >= self._num_turns
        observation = None
        if not done:
            observation = _words(self._rng, _draw(self._rng, self.config.observation_words))
        info = {"turn": self._turn, "latency_s": latency_s, "target_chars": self._target_chars}
        return EnvStep(observation, reward, done, info)


def _draw(rng: random.Random, count: int | IntRange) -> int:
    return count if isinstance(count, int) else rng.randint(count[0], count[1])


def _upper(count: int | IntRange) -> int:
    return count if isinstance(count, int) else count[1]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


# ----------------------------------------------------------------------- registry

_FACTORIES: dict[str, Callable[..., Environment]] = {
    "calc": CalcEnv.from_options,
    "synthetic": SyntheticEnv.from_options,
}
ENV_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def make_env(name: str, **options: Any) -> Environment:
    """A fresh environment for one trajectory; options are the fields of its config."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown environment {name!r}; valid: {', '.join(ENV_NAMES)}")
    return factory(**options)


def default_options(name: str) -> dict[str, Any]:
    """The options an environment takes, with their defaults (for help and docs)."""
    defaults: dict[str, CalcConfig | SyntheticConfig] = {
        "calc": CalcConfig(),
        "synthetic": SyntheticConfig(),
    }
    config = defaults.get(name)
    if config is None:
        raise ConfigError(f"unknown environment {name!r}; valid: {', '.join(ENV_NAMES)}")
    return {f.name: getattr(config, f.name) for f in fields(config)}


# --------------------------------------------------------------------- validation


def _check_option_names(env: str, options: Mapping[str, Any], valid: list[str]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"{env}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}"
        )


def _require_int(env: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{env}.{name} must be an integer >= {minimum}, got {value!r}")


def _require_number(env: str, name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{env}.{name} must be a finite number >= 0, got {value!r}")


def _require_count_or_range(name: str, value: object, minimum: int) -> None:
    if isinstance(value, tuple) and len(value) == 2:
        low, high = value
        _require_int("synthetic", f"{name}[0]", low, minimum)
        _require_int("synthetic", f"{name}[1]", high, minimum)
        if low > high:
            raise ConfigError(f"synthetic.{name}=({low}, {high}): low exceeds high; swap them")
        return
    if isinstance(value, tuple):
        raise ConfigError(f"synthetic.{name} must be an int or a (low, high) pair, got {value!r}")
    _require_int("synthetic", name, value, minimum)
