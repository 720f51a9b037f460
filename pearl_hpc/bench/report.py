"""``pearl-hpc bench --report [FILE] [--check]``: docs/benchmarks.md's generated tables
from the newest record of each bench in FILE (default ``docs/bench.jsonl``).

A generated table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; the
text around it is written by hand. ``--check`` changes nothing and exits 1 when a table
differs from what its record gives (the suite runs it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pearl_hpc.bench import record

DOC = record.SOURCE / "docs" / "benchmarks.md"
COMMANDS = {
    "decision": "pearl-hpc bench",
    "sim": "pearl-hpc bench --sim",
    "local": "pearl-hpc bench --local",
}


def _decision(rows: list[dict[str, Any]]) -> list[str]:
    by = {(r["workers"], r["event"]): r for r in rows}
    out = [
        "| workers | cold start (plan adds all) | grow by N/8 | shrink (reclaim N/8) | "
        "decide only | scalar-loop baseline |",
        "|---|---|---|---|---|---|",
    ]
    for n in sorted({r["workers"] for r in rows}):
        cells = [f"{by[n, e]['median_ms']:.3f}" for e in ("cold", "grow", "shrink", "decide-only")]
        base = by[n, "decide-only"]
        cells.append(f"{base['baseline_loop_ms']:.3f} ({base['speedup']:.1f}x slower)")
        out.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return out


def _sim(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| case | wall s | us/event | events | trajectories |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['case']} | {r['wall_s']:.2f} | {r['us_per_event']:.1f} | {r['events']:,} | "
            f"{r['trajectories']:,} |"
        )
    return out


def _local(results: dict[str, Any]) -> list[str]:
    from pearl_hpc.bench.local_run import format_results

    return format_results(results).splitlines()


TABLES: dict[str, Callable[[Any], list[str]]] = {
    "decision": _decision,
    "sim": _sim,
    "local": _local,
}


def block(rec: dict[str, Any]) -> str:
    """A bench's generated block: where it was measured, its table, its ratios."""
    dirty = "+" if rec["dirty"] else ""
    lines = [
        f"> commit `{rec['commit']}{dirty}` · {rec['date']} · {rec['machine']} · "
        f"`{COMMANDS[rec['bench']]}`",
        "",
        *TABLES[rec["bench"]](rec["result"]),
    ]
    if rec["ratios"]:
        lines += ["", "Ratios: " + "; ".join(f"{k} {v:g}" for k, v in rec["ratios"].items())]
    return "\n".join(lines)


def render(text: str, records: dict[str, dict[str, Any]]) -> str:
    """``text`` with each generated block replaced from its bench's record (a block
    whose bench has none is left as it is)."""

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in records:
            return m.group(0)
        return f"<!-- bench:{name} -->\n{block(records[name])}\n<!-- /bench:{name} -->"

    return re.sub(r"<!-- bench:(\w+) -->\n.*?<!-- /bench:\1 -->", fill, text, flags=re.S)


def main(path: str, check: bool = False, doc: Path = DOC) -> int:
    lines = Path(path)
    if not lines.exists() or not doc.exists():
        missing = lines if not lines.exists() else doc
        print(f"bench --report: {missing} not found (run it in a source checkout)", file=sys.stderr)
        return 2
    records = {k: v for k, v in record.newest(lines).items() if k in TABLES}
    text = doc.read_text()
    new = render(text, records)
    if check:
        if new != text:
            print(f"bench --report --check: {doc} differs from {lines}: run "
                  f"`pearl-hpc bench --report {path}`", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    doc.write_text(new)
    print(f"{doc}: {', '.join(sorted(records))} from {lines}")
    return 0
