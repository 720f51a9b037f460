"""The built-in ``synthetic`` environment: a stand-in with controlled shape, for benchmarks.

``reset(seed)`` draws from ``random.Random(seed)`` the number of turns (``num_turns``,
fixed or a uniform inclusive range), the words of the prompt and of each observation
(``observation_words``, fixed or a range) and a target length ``L`` in characters
(uniform in ``target_chars``). Each step first waits ``await sleep_fn(latency)`` with
the latency drawn from ``latency`` (see :class:`Latency`) by a second generator seeded
from the same seed, then rewards the response length::

    reward = max(0, 1 - |len(action) - L| / L) / num_turns

so a trajectory's reward is in ``[0, 1]`` and depends only on the seed and the actions.
A ``run.tasks`` row is ignored but for its ``"id"`` (the seed still draws the shape).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs.base import (
    EnvStep,
    Task,
    check_option_names,
    require_int,
    require_number,
)

SleepFn = Callable[[float], Awaitable[Any]]

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
            require_number("latency", name, getattr(self, name))
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
        require_int("synthetic", "prompt_words", self.prompt_words, minimum=0)
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
        check_option_names("synthetic", options, [*valid, "sleep_fn"])
        sleep_fn = options.pop("sleep_fn", asyncio.sleep)
        if "latency" in options:
            options["latency"] = Latency.parse(options["latency"])
        for name in ("num_turns", "observation_words", "target_chars"):
            if isinstance(options.get(name), list):
                options[name] = tuple(options[name])
        return cls(SyntheticConfig(**options), sleep_fn=sleep_fn)

    async def reset(self, seed: int, task: Task | None = None) -> str:
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


def _require_count_or_range(name: str, value: object, minimum: int) -> None:
    if isinstance(value, tuple) and len(value) == 2:
        low, high = value
        require_int("synthetic", f"{name}[0]", low, minimum)
        require_int("synthetic", f"{name}[1]", high, minimum)
        if low > high:
            raise ConfigError(f"synthetic.{name}=({low}, {high}): low exceeds high; swap them")
        return
    if isinstance(value, tuple):
        raise ConfigError(f"synthetic.{name} must be an int or a (low, high) pair, got {value!r}")
    require_int("synthetic", name, value, minimum)
