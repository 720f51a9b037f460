"""The generated parts of ``docs/``: the configuration reference, from the config schemas
(the ``spec_field`` docs), and the run directory's table in ``docs/running.md``, from
:data:`pearl_hpc.rundir.FILES`.

    python -m pearl_hpc.cli.docs            # write them
    python -m pearl_hpc.cli.docs --check    # exit 1, one line, if one is stale

The configuration reference has one table per section (a dataclass of the schema: YAML
key path, type, default, meaning, bounds), headed by the class docstring; nested
dataclasses get their own section after their parent's. :func:`render` is pure: the same
schema gives the same page.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from pearl_hpc.config import files
from pearl_hpc.config import run as run_config
from pearl_hpc.config.workload import WorkloadConfig
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.rundir import files_table

COMMAND = "python -m pearl_hpc.cli.docs"
RUNDIR_BEGIN, RUNDIR_END = "<!-- rundir:begin -->\n", "<!-- rundir:end -->"

# (heading, the files it describes, the schema)
SCHEMAS: tuple[tuple[str, str, type], ...] = (
    ("Run config", "`configs/runs/*.yaml` (`pearl-hpc run`)", run_config.RunConfig),
    ("Workload profile", "`configs/profiles/*.yaml` (`run.profile`, `pearl-hpc plan --profile`)",
     WorkloadProfile),
    ("Controller policies", "`configs/controller.yaml`", PolicyConfig),
    ("Simulator workload", "`configs/workloads/*.yaml` (`pearl-hpc simulate --workload`)",
     WorkloadConfig),
)


def prose(text: str | None) -> str:
    """A docstring as markdown: dedented, Sphinx roles and RST literals as code."""
    text = inspect.cleandoc(text or "")
    text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"`\1`", text)
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def class_doc(cls: type) -> str:
    """The class docstring (none for the one dataclasses makes up from the signature)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else prose(doc)


def yaml_value(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, str):
        return f"'{value}'" if value == "" or value != value.strip() else value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 1800.0 as 1800
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def nested(hint: Any) -> tuple[type | None, bool]:
    """The dataclass a field holds (or a list of), and whether it is a list."""
    is_list = typing.get_origin(hint) is list
    inner = typing.get_args(hint)[0] if is_list else hint
    return (inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None,
            is_list)


def type_name(hint: Any) -> str:
    """The YAML type of a field."""
    if typing.get_origin(hint) is list:
        inner = type_name(typing.get_args(hint)[0])
        return "list of mappings" if inner == "mapping" else f"list of {inner}"
    if typing.get_origin(hint) is dict or dataclasses.is_dataclass(hint):
        return "mapping"
    if isinstance(hint, types.UnionType):  # X | None
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(map(type_name, inner)) + " or null"
    return "str" if isinstance(hint, type) and issubclass(hint, Enum) else str(hint.__name__)


def default_text(f: dataclasses.Field[Any]) -> str:
    """The default as YAML (``required`` when there is none)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(below)"
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return f"{len(value)} with the defaults below"
    return f"`{yaml_value(value)}`"


def bounds_text(f: dataclasses.Field[Any], hint: Any) -> str:
    """The range :func:`~pearl_hpc.core.schema.from_mapping` checks, and an enum's values."""
    ops = (("gt", ">"), ("ge", ">="), ("le", "<="))
    parts = [f"{op} {yaml_value(f.metadata[k])}" for k, op in ops if f.metadata.get(k) is not None]
    if isinstance(hint, type) and issubclass(hint, Enum):
        parts.append("one of " + ", ".join(f"`{m.value}`" for m in hint))
    return ", ".join(parts)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def sections(cls: type, path: str, seen: dict[type, str]) -> list[str]:
    """The section of ``cls`` at key ``path`` ('' = the file's top level), then its
    nested dataclasses' sections, depth first in field order."""
    hints = typing.get_type_hints(cls)
    out = [f"### `{path}`", ""] if path else []
    if class_doc(cls):
        out += [class_doc(cls), ""]
    out += ["| key | type | default | meaning | bounds |", "|---|---|---|---|---|"]
    children: list[tuple[type, str]] = []
    for f in dataclasses.fields(cls):
        if not f.init or "doc" not in f.metadata:
            continue
        key = f"{path}.{f.name}" if path else f.name
        child, is_list = nested(hints[f.name])
        meaning = str(f.metadata["doc"])
        if child is not None:
            key_path = key + ("[]" if is_list else "")
            link = seen.get(child) or anchor(f"`{key_path}`")
            meaning += f" ([keys](#{link}))"
            if child not in seen:
                children.append((child, key_path))
                seen[child] = link
        row = (f"`{key}`", type_name(hints[f.name]), default_text(f), meaning,
               bounds_text(f, hints[f.name]))
        out.append("| " + " | ".join(cell(c) for c in row) + " |")
    out.append("")
    for child, key_path in children:
        out += sections(child, key_path, seen)
    return out


def render() -> str:
    """The whole page."""
    out = [
        "# Configuration reference", "",
        f"<!-- Generated by `{COMMAND}`; do not edit by hand. -->", "",
        f"This page is generated from the config schemas (`spec_field` in "
        f"`pearl_hpc/core/schema.py`) by `{COMMAND}`; edit the schema, then run that "
        "command. Every key is checked when the file is read: an unknown key lists the "
        "valid ones, and a wrong type or a value out of bounds is one line naming the "
        "field and the fix (exit status 2).", "",
        "## Reading rules", "", prose(files.__doc__).partition("\n\n")[2], "",
    ]
    seen: dict[type, str] = {}
    for heading, where, cls in SCHEMAS:
        spec = f"{cls.__module__}:{cls.__qualname__}"
        out += [f"## {heading}", "", f"Files: {where}. Schema: `{spec}`.", ""]
        if cls in seen:
            out += [f"The keys of [this section](#{seen[cls]}), at the top of the file.", ""]
            continue
        seen[cls] = anchor(heading)
        intro = prose(run_config.__doc__) if cls is run_config.RunConfig else ""
        out += [intro, ""] if intro else []
        out += sections(cls, "", seen)
    return "\n".join(out).rstrip("\n") + "\n"


def with_run_dir_table(page: str) -> str:
    """``docs/running.md`` with the run directory's table (between its markers) current."""
    head, begin, rest = page.partition(RUNDIR_BEGIN)
    _, end, tail = rest.partition(RUNDIR_END)
    if not begin or not end:
        raise SystemExit(f"docs/running.md: no {RUNDIR_BEGIN.strip()} ... {RUNDIR_END} block")
    return head + begin + files_table() + end + tail


def main(argv: Sequence[str] | None = None) -> int:
    """Write the generated pages, or (``--check``) say in one line which is stale, exit 1."""
    parser = argparse.ArgumentParser(prog=f"{COMMAND}", description=__doc__)
    parser.add_argument("--docs", default=Path("docs"), type=Path, help="the docs folder")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated page differs")
    args = parser.parse_args(argv)
    running = args.docs / "running.md"
    pages = {
        args.docs / "configuration.md": render(),
        running: with_run_dir_table(running.read_text()),
    }
    for path, text in pages.items():
        if args.check:
            if (path.read_text() if path.is_file() else None) != text:
                print(f"{path} is out of date with the code; run: {COMMAND}", file=sys.stderr)
                return 1
        else:
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
