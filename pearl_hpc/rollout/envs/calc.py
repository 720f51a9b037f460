"""The built-in ``calc`` environment.

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

With ``tool_format: hermes`` the tools are the chat template's (``python(code)`` and
``calc(expression)``, called as ``<tool_call>`` JSON, their results shown in the tool
role) in place of the tags of step 2; a malformed call is reported to the model; the
format fraction counts each call's argument values in place of its JSON. A ``run.tasks``
row ``{"expression": "3 * 4 + 2", "target": 14}`` (target optional) replaces the task
drawn from the seed.
"""

from __future__ import annotations

import ast
import math
import random
import re
from dataclasses import dataclass
from typing import Any

from pearl_hpc.rollout.envs.base import (
    EnvStep,
    Task,
    clip,
    describe_output,
    options_config,
    require_choice,
    require_int,
    require_limits,
    require_number,
)
from pearl_hpc.rollout.sandbox import (
    DEFAULT_LIMITS,
    SandboxLimits,
    SandboxResult,
    require_sandbox,
    run_python,
)
from pearl_hpc.rollout.toolcalls import (
    ToolCall,
    argument,
    function_spec,
    parse_tool_calls,
    strip_tool_calls,
)

TOOL_FORMATS = ("tags", "hermes")
CALC_SYMBOLS = frozenset("+-*/().")  # what <calc> accepts besides digits and spaces
_TAG_MARKUP = re.compile(r"</?(?:python|calc|answer)>")
_TOOL_CALL = re.compile(r"<(python|calc)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARITHMETIC_RUN = re.compile(r"[0-9+\-*/(). ]+")
_NO_TOOL_HINT = (
    "no arithmetic found; compute with <calc>EXPR</calc> or <python>CODE</python>, "
    "then reply <answer>N</answer>"
)
_NO_CALL_HINT = (
    "no arithmetic found; call the python or calc tool in a <tool_call>, then reply "
    "<answer>N</answer>"
)
CALC_TOOLS = [
    function_spec(
        "python",
        "Run Python code; returns what it prints.",
        {"code": ("string", "the program; print the result")},
    ),
    function_spec(
        "calc",
        "Evaluate an arithmetic expression (digits, + - * / ( ) .).",
        {"expression": ("string", "e.g. 37 * 4 + 12")},
    ),
]


@dataclass(frozen=True, slots=True)
class CalcConfig:
    """Options of the ``"calc"`` environment (``make_env("calc", **options)``)."""

    max_turns: int = 3  # steps before the episode ends without an <answer>
    format_weight: float = 0.5  # weight of the dense format fraction (see module doc)
    correct_weight: float = 1.0  # paid once, when a value first equals the target
    max_operand: int = 99  # operands are drawn from [2, max_operand]
    max_observation_chars: int = 256  # tool output shown to the model is cut to this
    limits: SandboxLimits = DEFAULT_LIMITS  # per tool call; a mapping of its fields works
    tool_format: str = "tags"  # tags: <python>/<calc>; hermes: <tool_call> JSON (Qwen3's)

    def __post_init__(self) -> None:
        require_int("calc", "max_turns", self.max_turns, minimum=1)
        require_int("calc", "max_operand", self.max_operand, minimum=2)
        require_int("calc", "max_observation_chars", self.max_observation_chars, minimum=16)
        require_number("calc", "format_weight", self.format_weight)
        require_number("calc", "correct_weight", self.correct_weight)
        require_choice("calc", "tool_format", self.tool_format, TOOL_FORMATS)
        require_limits("calc", self.limits)


@dataclass(frozen=True, slots=True)
class CalcTask:
    """One arithmetic question and its answer."""

    expression: str  # e.g. "37 * 4 + 12"
    target: float


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


def calc_task_of(task: Task) -> CalcTask:
    """A row of ``run.tasks`` for calc: ``{"expression": "3 * 4 + 2", "target": 14}``
    (the target may be left out: it is the expression's value)."""
    expression = task.get("expression")
    if not isinstance(expression, str) or not is_calc_expression(expression.strip()):
        raise ValueError(
            f"calc task {task.get('id')!r}: 'expression' must be an arithmetic expression "
            f"(digits, spaces, + - * / ( ) .), got {expression!r}"
        )
    target = task.get("target", eval(expression, {"__builtins__": {}}))  # checked above
    if isinstance(target, bool) or not isinstance(target, int | float):
        raise ValueError(f"calc task {task.get('id')!r}: 'target' must be a number")
    return CalcTask(expression.strip(), target)


def calc_prompt(task: CalcTask, tool_format: str = "tags") -> str:
    if tool_format == "hermes":
        return (
            f"What is {task.expression}? Use the tools to compute, then reply <answer>N</answer>."
        )
    return (
        f"What is {task.expression}? Use <python>...</python> or <calc>...</calc> to "
        "compute, then reply <answer>N</answer>."
    )


def format_fraction(action: str, tool_format: str = "tags") -> float:
    """Share of the non-space characters (tag markup removed; hermes: each tool call
    replaced by its argument values) that are digits or calculator symbols; 0.0 for an
    action with none."""
    if tool_format == "hermes":
        action = strip_tool_calls(action, keep_arguments=True)
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


def _matches(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= 1e-6 * max(1.0, abs(target))


def _stdout_value(result: SandboxResult) -> float | None:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return parse_number(lines[-1]) if result.ok and lines else None


@dataclass(slots=True)
class _ToolOutcome:
    tool: str | None  # "python", "calc", "expression" or None (nothing to run)
    observation: str
    value: float | None
    sandbox_wall_s: float = 0.0
    role: str = "user"  # "tool": the answer to a <tool_call>


class CalcEnv:
    """The ``"calc"`` environment; reward and rules are in the module docstring."""

    name = "calc"

    def __init__(self, config: CalcConfig | None = None) -> None:
        require_sandbox()  # no bubblewrap: one line saying what to install
        self.config = config or CalcConfig()
        self.max_turns = self.config.max_turns
        self.tools = CALC_TOOLS if self.config.tool_format == "hermes" else None
        self._task: CalcTask | None = None
        self._turn = 0
        self._solved = False
        self._done = False

    @classmethod
    def from_options(cls, **options: Any) -> CalcEnv:
        """Strict options (a ``limits`` mapping becomes :class:`SandboxLimits`)."""
        return cls(options_config("calc", CalcConfig, options))

    @property
    def task(self) -> CalcTask:
        if self._task is None:
            raise RuntimeError("calc environment: call reset(seed) before using it")
        return self._task

    async def reset(self, seed: int, task: Task | None = None) -> str:
        if task is None:
            self._task = make_calc_task(seed, self.config.max_operand)
        else:
            self._task = calc_task_of(task)
        self._turn, self._solved, self._done = 0, False, False
        return calc_prompt(self._task, self.config.tool_format)

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
        fraction = format_fraction(action, self.config.tool_format)
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
        reward = format_reward + correct_reward
        return EnvStep(observation, reward, self._done, info, role=outcome.role)

    async def _run_tool(self, action: str) -> _ToolOutcome:
        if self.config.tool_format == "hermes":
            return await self._run_call(action)
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
        return await self._free_text(action, _NO_TOOL_HINT)

    async def _run_call(self, action: str) -> _ToolOutcome:
        """hermes: the first <tool_call> runs (python: its code; calc: print(expression));
        a malformed call is reported; no call at all falls back to the free text."""
        parsed = parse_tool_calls(action)
        if not parsed.calls and parsed.errors:
            return _ToolOutcome("tool_call", f"error: {parsed.errors[0]}", None, role="tool")
        if not parsed.calls:
            return await self._free_text(strip_tool_calls(action), _NO_CALL_HINT)
        call: ToolCall = parsed.calls[0]
        code = argument(call, "code") if call.name == "python" else None
        expr = argument(call, "expression") if call.name == "calc" else None
        if code is not None:
            outcome = await self._execute("python", code, prefix="")
        elif expr is not None and is_calc_expression(expr.strip()):
            outcome = await self._execute("calc", f"print({expr.strip()})", prefix="")
        elif call.name in ("python", "calc"):
            wanted = "code" if call.name == "python" else "expression (digits, + - * / ( ) .)"
            refused = f"error: {call.name} takes a string {wanted}"
            outcome = _ToolOutcome(call.name, refused, None)
        else:
            outcome = _ToolOutcome(
                "tool_call", f"error: no tool {call.name!r}; use python or calc", None
            )
        outcome.role = "tool"
        return outcome

    async def _free_text(self, action: str, hint: str) -> _ToolOutcome:
        expr = arithmetic_candidate(action)
        if expr is None:
            return _ToolOutcome(None, hint, None)
        literal = _literal_value(expr)
        if literal is not None:  # nothing to compute: no process for a bare number
            observation = clip(f"{expr} = {expr}", self.config.max_observation_chars)
            return _ToolOutcome("expression", observation, literal)
        return await self._execute("expression", f"print({expr})", prefix=f"{expr} = ")

    async def _execute(self, tool: str, code: str, prefix: str) -> _ToolOutcome:
        result = await run_python(code, self.config.limits)
        observation = clip(prefix + describe_output(result), self.config.max_observation_chars)
        return _ToolOutcome(tool, observation, _stdout_value(result), result.wall_s)
