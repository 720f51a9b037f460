"""A benchmark's result as one JSON line: what it measured, its ratios, where and when.

    {"bench": "decision", "commit": "5744e65", "dirty": false, "date": "2026-12-05",
     "machine": "2 CPUs (x86_64)", "args": {...}, "result": ..., "ratios": {...}}

Every ``pearl-hpc bench`` appends its line to ``--record FILE`` (default ``bench.jsonl``
in the working directory, as runs go to its ``runs/``). The figures in
``docs/benchmarks.md`` come from ``docs/bench.jsonl``: ``pearl-hpc bench --report``
writes each reported bench's table there from its newest line (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT = "bench.jsonl"
SOURCE = Path(__file__).resolve().parents[2]  # the checkout (commit: unknown elsewhere)


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record",
        metavar="FILE",
        default=DEFAULT,
        help="append the result as one JSON line: commit, machine, arguments, result, "
        f"ratios (default: {DEFAULT} here; '' for none)",
    )


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(SOURCE), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _portable(value: Any) -> Any:
    """A path inside the checkout as relative to it (a record names no machine's path)."""
    if isinstance(value, str) and value.startswith(f"{SOURCE}{os.sep}"):
        return os.path.relpath(value, SOURCE)
    return value


def line(
    bench: str, result: Any, ratios: Mapping[str, float], args: Mapping[str, Any]
) -> dict[str, Any]:
    """The record of one run of ``bench``."""
    commit = _git("rev-parse", "--short", "HEAD")
    return {
        "bench": bench,
        "commit": commit or "unknown",
        # the measured code changed since the commit (its package, not the docs)
        "dirty": bool(commit) and bool(_git("status", "--porcelain", "--", "pearl_hpc")),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()})",
        "args": {k: _portable(v) for k, v in args.items() if k not in ("record", "json")},
        "result": result,
        "ratios": {k: round(float(v), 4) for k, v in ratios.items()},
    }


def append(
    path: str,
    bench: str,
    result: Any,
    ratios: Mapping[str, float] | None = None,
    args: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Append ``bench``'s record to ``path`` (nothing when ``path`` is empty)."""
    record = line(bench, result, ratios or {}, args or {})
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    return record


def newest(path: Path) -> dict[str, dict[str, Any]]:
    """The newest record of each bench in ``path``."""
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        for text in path.read_text().splitlines():
            if text.strip():
                record = json.loads(text)
                out[record["bench"]] = record
    return out
