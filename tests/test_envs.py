"""Agent environments: calc runs real sandboxed tool calls; synthetic uses an injected sleep."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs import (
    ENV_NAMES,
    CalcConfig,
    CalcEnv,
    Environment,
    EnvStep,
    Latency,
    SyntheticEnv,
    arithmetic_candidate,
    format_fraction,
    is_calc_expression,
    make_calc_task,
    make_env,
)


def calc_env(seed: int = 0, **options: Any) -> CalcEnv:
    env = make_env("calc", **options)
    assert isinstance(env, CalcEnv)
    asyncio.run(env.reset(seed))
    return env


def step(env: Environment, action: str) -> EnvStep:
    return asyncio.run(env.step(action))


class RecordingSleep:
    """Stands in for asyncio.sleep: records the requested waits and returns at once."""

    def __init__(self) -> None:
        self.waits_s: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits_s.append(seconds)


def synthetic_episode(seed: int, action: str = "x", **options: Any) -> list[EnvStep]:
    async def play() -> list[EnvStep]:
        env = make_env("synthetic", **options)
        await env.reset(seed)
        steps = [await env.step(action)]
        while not steps[-1].done:
            steps.append(await env.step(action))
        return steps

    return asyncio.run(play())


# ---------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert set(ENV_NAMES) == {"calc", "code", "synthetic"}
    for name in ENV_NAMES:
        env = make_env(name)
        assert env.name == name
        assert env.max_turns >= 1


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("chess", {}, "run.env 'chess' is unknown; built-in: calc, code, synthetic; plugins"),
        ("no_such_pkg.mod:make", {}, "cannot import 'no_such_pkg.mod'.*PYTHONPATH"),
        ("pearl_hpc.rollout.envs:nothing", {}, "has no 'nothing'"),
        ("pearl_hpc.rollout.envs:ENV_NAMES", {}, "names tuple, not a factory"),
        ("pearl_hpc.rollout.envs:CalcConfig", {}, "needs an async reset"),
        ("code", {"split": "test"}, "code.split='test' is unknown; valid: train, eval, all"),
        ("calc", {"max_turn": 3}, "unknown option.*max_turn; valid: max_turns"),
        ("calc", {"limits": {"timeout": 1}}, "calc.limits: unknown option.*timeout_s"),
        ("calc", {"max_turns": 0}, "calc.max_turns"),
        ("calc", {"format_weight": -1.0}, "calc.format_weight"),
        ("calc", {"limits": {"timeout_s": 0}}, "SandboxLimits.timeout_s"),
        ("synthetic", {"turns": 3}, "unknown option.*turns; valid: num_turns"),
        ("synthetic", {"num_turns": (5, 2)}, "num_turns.*swap"),
        ("synthetic", {"num_turns": 0}, "num_turns"),
        ("synthetic", {"latency": {"dist": "gamma"}}, "latency.dist='gamma'.*lognormal"),
        ("synthetic", {"latency": {"mean_s": 1.0}}, "latency.dist=None"),
        ("synthetic", {"latency": {"dist": "uniform", "low_s": 1}}, "missing: \\['high_s'\\]"),
        (
            "synthetic",
            {"latency": {"dist": "exponential", "mean_s": 1, "sigma": 1}},
            "unknown: \\['sigma'\\]",
        ),
        ("synthetic", {"latency": {"dist": "exponential", "mean_s": 0}}, "latency.mean_s"),
        ("synthetic", {"latency": {"dist": "uniform", "low_s": 2, "high_s": 1}}, "low_s"),
        ("synthetic", {"latency": "slow"}, "latency must be"),
        ("synthetic", {"latency": -1.0}, "latency.value_s"),
    ],
)
def test_bad_configuration_is_a_config_error(name: str, options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_env(name, **options)


# -------------------------------------------------------------------- calc


def test_calc_reset_is_deterministic_per_seed_and_varies_across_seeds() -> None:
    prompts = [asyncio.run(make_env("calc").reset(seed)) for seed in (7, 7, 8)]
    assert prompts[0] == prompts[1]
    assert prompts[0] != prompts[2]
    assert prompts[0].startswith("What is ")
    assert "<answer>N</answer>" in prompts[0]
    assert len({asyncio.run(make_env("calc").reset(s)) for s in range(50)}) > 40


@given(st.integers(min_value=0, max_value=2**32))
def test_calc_target_is_the_value_of_the_expression(seed: int) -> None:
    task = make_calc_task(seed)
    assert task.target == eval(task.expression)  # our own generated text, digits and + - *


def test_correct_answer_gets_the_bonus_and_ends_the_episode() -> None:
    env = calc_env(seed=3, format_weight=0.5, correct_weight=1.0)
    result = step(env, f"<answer>{env.task.target}</answer>")
    assert result.done and result.observation is None
    assert result.info["correct"]
    # fraction 1.0 over all 3 turn slots (an early answer fills the unused ones) + bonus
    assert result.reward == pytest.approx(0.5 + 1.0)


def test_wrong_answer_gets_no_bonus() -> None:
    env = calc_env(seed=3)
    result = step(env, f"<answer>{env.task.target + 1}</answer>")
    assert result.done
    assert not result.info["correct"]
    assert result.reward == pytest.approx(0.5)


def test_python_tool_call_returns_its_output() -> None:
    result = step(calc_env(), "<python>print(2+3)</python>")
    assert not result.done
    assert result.observation == "5"
    assert result.info["tool"] == "python"


def test_python_error_is_shown_to_the_model() -> None:
    result = step(calc_env(), "<python>print(1/0)</python>")
    assert result.observation == "error: ZeroDivisionError: division by zero"


def test_calc_tag_refuses_non_arithmetic() -> None:
    result = step(calc_env(), "<calc>__import__('os')</calc>")
    assert result.observation is not None and result.observation.startswith("error:")
    assert result.info["sandbox_wall_s"] == 0.0  # rejected before any process started


def test_calc_tag_computing_the_target_is_correct() -> None:
    env = calc_env(seed=11)
    result = step(env, f"let me see <calc>{env.task.expression}</calc>")
    assert result.observation == str(env.task.target)
    assert result.info["correct"]


def test_digit_heavy_text_gets_more_shaping_reward_than_words() -> None:
    digits = step(calc_env(seed=1), "12 + 34 * 5")
    words = step(calc_env(seed=1), "the answer is what")
    assert digits.reward > words.reward
    assert words.reward == 0.0
    assert digits.observation == "12 + 34 * 5 = 182"


def test_bare_arithmetic_in_free_text_runs_and_can_hit_the_target() -> None:
    env = calc_env(seed=5)
    first = step(env, f"think {env.task.expression} ok")
    assert first.info["tool"] == "expression" and first.info["correct"]
    again = step(env, f"think {env.task.expression} ok")
    assert not again.info["correct"]  # the bonus is paid once per episode
    assert again.reward < first.reward


def test_max_turns_ends_the_episode() -> None:
    env = calc_env(max_turns=2)
    assert not step(env, "hello").done
    last = step(env, "hello")
    assert last.done and last.observation is None
    with pytest.raises(RuntimeError, match="after done"):
        step(env, "hello")


def test_step_before_reset_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        step(make_env("calc"), "1+1")


def test_trajectory_reward_stays_in_range() -> None:
    config = CalcConfig(format_weight=0.5, correct_weight=1.0)
    env = CalcEnv(config)
    asyncio.run(env.reset(9))
    actions = ["1+1", f"<calc>{env.task.expression}</calc>", "999999"]
    total = sum(step(env, action).reward for action in actions)
    assert total == pytest.approx(config.format_weight + config.correct_weight)  # the maximum


def test_many_calc_envs_run_concurrently() -> None:
    async def play(seed: int) -> EnvStep:
        env = make_env("calc")
        await env.reset(seed)
        return await env.step("<python>print(6 * 7)</python>")

    async def all_of_them() -> list[EnvStep]:
        return await asyncio.gather(*(play(seed) for seed in range(20)))

    assert [s.observation for s in asyncio.run(all_of_them())] == ["42"] * 20


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("", 0.0),
        ("   ", 0.0),
        ("12+3", 1.0),
        ("<answer>42</answer>", 1.0),
        ("ab12", 0.5),
        ("the end", 0.0),
    ],
)
def test_format_fraction(action: str, expected: float) -> None:
    assert format_fraction(action) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("what is 12 + 3 * 4 ok", "12 + 3 * 4"),
        ("sum 1 + and 22 * 33 -", "22 * 33"),
        ("words only", None),
        ("2 ** 99", None),
        ("(1 + 2", None),
        ("x = 7.", "7"),
    ],
)
def test_arithmetic_candidate(action: str, expected: str | None) -> None:
    assert arithmetic_candidate(action) == expected


@settings(max_examples=200)
@given(st.text(alphabet="0123456789+-*/(). abcxyz<>", max_size=60))
def test_candidate_is_a_valid_substring_and_fraction_in_unit_range(action: str) -> None:
    assert 0.0 <= format_fraction(action) <= 1.0
    expr = arithmetic_candidate(action)
    if expr is not None:
        assert expr in action
        assert is_calc_expression(expr)


# --------------------------------------------------------------- synthetic


def test_synthetic_reset_is_deterministic_per_seed() -> None:
    assert asyncio.run(make_env("synthetic").reset(1)) == asyncio.run(
        make_env("synthetic").reset(1)
    )
    assert asyncio.run(make_env("synthetic").reset(1)) != asyncio.run(
        make_env("synthetic").reset(2)
    )


def test_synthetic_turns_and_observation_words_follow_the_ranges() -> None:
    sleep = RecordingSleep()
    turn_counts = set()
    for seed in range(60):
        steps = synthetic_episode(seed, num_turns=(2, 4), observation_words=(3, 5), sleep_fn=sleep)
        turn_counts.add(len(steps))
        assert all(3 <= len(s.observation.split()) <= 5 for s in steps[:-1] if s.observation)
        assert steps[-1].observation is None
    assert turn_counts == {2, 3, 4}
    assert make_env("synthetic", num_turns=[2, 4]).max_turns == 4


def test_synthetic_reward_peaks_at_the_target_length() -> None:
    sleep = RecordingSleep()
    env = SyntheticEnv(sleep_fn=sleep)
    asyncio.run(env.reset(4))
    target = step(env, "").info["target_chars"]
    exact = synthetic_episode(4, action="y" * target, sleep_fn=sleep)
    off = synthetic_episode(4, action="y" * (target // 2), sleep_fn=sleep)
    assert sum(s.reward for s in exact) == pytest.approx(1.0)
    assert sum(s.reward for s in off) == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize(
    ("latency", "expected_mean_s"),
    [
        ({"dist": "constant", "value_s": 0.25}, 0.25),
        ({"dist": "uniform", "low_s": 0.1, "high_s": 0.5}, 0.3),
        ({"dist": "exponential", "mean_s": 0.4}, 0.4),
        ({"dist": "lognormal", "mean_s": 0.5, "sigma": 0.6}, 0.5),
        (0.125, 0.125),
    ],
)
def test_synthetic_latency_follows_the_distribution(latency: Any, expected_mean_s: float) -> None:
    sleep = RecordingSleep()
    steps = synthetic_episode(
        0, num_turns=4000, observation_words=0, latency=latency, sleep_fn=sleep
    )
    assert len(sleep.waits_s) == 4000
    assert [s.info["latency_s"] for s in steps] == sleep.waits_s
    assert statistics.fmean(sleep.waits_s) == pytest.approx(expected_mean_s, rel=0.05)
    assert Latency.parse(latency).mean_s_expected() == pytest.approx(expected_mean_s)
    assert min(sleep.waits_s) >= 0.0
    if isinstance(latency, dict) and latency["dist"] == "uniform":
        assert min(sleep.waits_s) >= 0.1 and max(sleep.waits_s) <= 0.5
    if isinstance(latency, dict) and latency["dist"] == "lognormal":
        assert statistics.median(sleep.waits_s) < expected_mean_s  # right-skewed


def test_synthetic_latencies_are_seeded() -> None:
    def waits(seed: int) -> list[float]:
        sleep = RecordingSleep()
        latency = {"dist": "exponential", "mean_s": 1.0}
        synthetic_episode(seed, num_turns=5, latency=latency, sleep_fn=sleep)
        return sleep.waits_s

    assert waits(1) == waits(1)
    assert waits(1) != waits(2)


def test_synthetic_really_waits_with_the_default_sleep() -> None:
    async def timed() -> float:
        env = make_env("synthetic", num_turns=1, latency=0.05)
        await env.reset(0)
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        await env.step("x")
        return loop.time() - started_s

    assert asyncio.run(timed()) >= 0.04
