"""Standard tool calls: the format Qwen3 (and Hermes-style chat templates) emit.

An environment lists its tools as JSON-schema function specs (:func:`function_spec`);
the chat template renders them into the system prompt (``apply_chat_template(tools=)``)
and the model answers with one or more blocks::

    <tool_call>
    {"name": "run_python", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

:func:`parse_tool_calls` reads them back. A malformed block is an error the environment
shows the model (which learns the format from it), never an exception; ``arguments``
given as a JSON string (some models do) is decoded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    """The well-formed calls of a response, in order, and what was wrong with the rest."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every ``<tool_call>`` block of ``text``; an unclosed last block (the turn's token
    budget ran out inside it) is an error too."""
    parsed = ParsedCalls()
    for match in _BLOCK.finditer(text):
        call, error = _one_call(match.group(1).strip())
        if call is not None:
            parsed.calls.append(call)
        else:
            parsed.errors.append(error)
    tail = _BLOCK.sub("", text)
    if _OPEN in tail:
        parsed.errors.append("a <tool_call> is not closed with </tool_call>")
    return parsed


def _one_call(body: str) -> tuple[ToolCall | None, str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"a <tool_call> is not JSON ({e.msg} at char {e.pos})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None, 'a <tool_call> must be a JSON object with a "name" string'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, f'{data["name"]}: "arguments" must be a JSON object'
    if not isinstance(arguments, dict):
        return None, f'{data["name"]}: "arguments" must be a JSON object'
    return ToolCall(data["name"], arguments), ""


def strip_tool_calls(text: str, keep_arguments: bool = False) -> str:
    """``text`` without its ``<tool_call>`` blocks; ``keep_arguments``: each well-formed
    block replaced by its argument values (space-separated), a malformed one dropped."""

    def replace(match: re.Match[str]) -> str:
        call, _ = _one_call(match.group(1).strip())
        if not keep_arguments or call is None:
            return " "
        return " ".join(str(v) for v in call.arguments.values())

    return _BLOCK.sub(replace, text)


def function_spec(
    name: str, description: str, parameters: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    """An OpenAI-style function spec, every parameter required: ``parameters`` maps a
    name to its (JSON type, description)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    key: {"type": kind, "description": text}
                    for key, (kind, text) in parameters.items()
                },
                "required": list(parameters),
            },
        },
    }


def argument(call: ToolCall, name: str) -> str | None:
    """A string argument of ``call`` (None when missing or not a string)."""
    value = call.arguments.get(name)
    return value if isinstance(value, str) else None
