"""``pearl-hpc bench --report [FILE] [--check]``: docs/benchmarks.md's generated tables
and the figures README.md cites, from the newest record of each bench in FILE (default
``docs/bench.jsonl``).

A generated table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``
(NAME: a bench, or BENCH.PART for one of its tables); a cited figure between
``<!-- fig:NAME -->`` and ``<!-- /fig -->``; the text around them is written by hand.
``--check`` changes nothing and exits 1 when either differs from what its record gives
(the suite runs it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pearl_hpc.bench import record

DOC = record.SOURCE / "docs" / "benchmarks.md"
README = record.SOURCE / "README.md"
COMMANDS = {
    "decision": "pearl-hpc bench",
    "sim": "pearl-hpc bench --sim",
    "local": "pearl-hpc bench --local",
    "messages": "pearl-hpc bench --messages",
    "checkpoint": "pearl-hpc bench --checkpoint",
    "train": "pearl-hpc bench --train",
    "weights": "pearl-hpc bench --weights --gib 2",
    "engines": "pearl-hpc bench --engines",
    "plane": "pearl-hpc bench --plane",
    "harvest": "pearl-hpc bench --harvest --speedup 30 --steps 80",
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


def _vs(row: int, text: str, ratio: float, digits: int = 2) -> str:
    """A cell, with its ratio to the first row's (the baseline) after the first row."""
    return text if row == 0 else f"{text} ({ratio:.{digits}f}x)"


def _train_message(result: dict[str, Any]) -> list[str]:
    out = [
        "| encoding | MiB per rank | master: encode for all ranks | one rank: decode |",
        "|---|---:|---:|---:|",
    ]
    for i, r in enumerate(result["train"]):
        enc = _vs(i, f"{r['master_encode_s']:.3f} s", r["encode_vs_pickle"])
        dec = _vs(i, f"{r['rank_decode_s']:.3f} s", r["decode_vs_pickle"])
        out.append(f"| {r['encoding']} | {r['mib_per_rank']:.1f} | {enc} | {dec} |")
    return out


def _trajectory_log(result: dict[str, Any]) -> list[str]:
    out = ["| log | MiB a step | master seconds a step |", "|---|---:|---:|"]
    for i, r in enumerate(result["trajectory_log"]):
        mib = _vs(i, f"{r['mib']:.1f}", r["bytes_vs_whole"], 3)
        sec = _vs(i, f"{r['master_s']:.3f}", r["seconds_vs_whole"])
        out.append(f"| {r['log']} | {mib} | {sec} |")
    return out


def _checkpoint(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model | state GB | before: s a step | after: waits s | written s (background) "
        "| per step s | before / after |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        model = f"{r['model']}, {r['params'] / 1e9:.2f}B" if r["params"] >= 1e8 else r["model"]
        before = "< 0.005" if r["before_s"] < 0.005 else f"{r['before_s']:.2f}"
        state = f"{r['state_bytes'] / 1e9:.{2 if r['state_bytes'] >= 1e8 else 3}f}"
        out.append(
            f"| {model} | {state} | {before} | {r['blocked_s']:.3f} | "
            f"{r['written_s']:.2f} | {r['per_step_s']:.3f} | {r['per_step_ratio']:.1f}x |"
        )
    return out


CASE_NAMES = {
    "checkpointing": "activation checkpointing",
    "chunked": "chunked log-probs",
    "both": "both (the trainer on cuda)",
}


def _train_memory(rows: list[dict[str, Any]]) -> list[str]:
    memory = [r for r in rows if "case" in r]
    base = memory[0]["peak_mib"]
    out = ["| case | peak MiB | vs neither | step s |", "|---|---:|---:|---:|"]
    for r in memory:
        out.append(
            f"| {CASE_NAMES.get(r['case'], r['case'])} | {r['peak_mib']:,.0f} | "
            f"{r['peak_mib'] / base:.2f}x | "
            f"{r['step_s']:.1f} |"
        )
    return out


def _train_packing(rows: list[dict[str, Any]]) -> list[str]:
    layouts = [r for r in rows if "layout" in r]
    out = ["| layout | tokens computed | padding | trajectory tokens/s |", "|---|---:|---:|---:|"]
    for i, r in enumerate(layouts):
        rate = _vs(i, f"{r['tokens_per_s']:,.0f}", r["tokens_per_s"] / layouts[0]["tokens_per_s"])
        out.append(
            f"| {r['layout']} | {r['tokens_computed']:,} | {r['padding_share']:.1%} | {rate} |"
        )
    return out


def _weights(result: dict[str, Any]) -> list[str]:
    from pearl_hpc.bench.weights import format_table

    table = format_table(result).splitlines()
    head, rows, tail = table[0], table[2:-1], table[-1]
    out = [
        head + ":",
        "",
        "| seconds | gloo group (engines on other nodes) | shared memory (trainer 0's node) "
        "| shm / gloo |",
        "|---|---|---|---|",
    ]
    for row in rows:
        key, gloo, shm, ratio = row.split()
        out.append(f"| {key.removesuffix('_s')} | {gloo} | {shm} | {ratio} |")
    return [*out, "", tail[0].upper() + tail[1:]]


def _engines(result: dict[str, Any]) -> list[str]:
    from pearl_hpc.bench.engines import table_rows

    out = ["| what (median of the repeats) | measured |", "|---|---|"]
    return out + [f"| {what} | {value} |" for what, value in table_rows(result)]


def _plane(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| ranks | the master's plane up -> every base hello | loop per plan (`partition`) "
        "| a command to every member -> every ack | longest loop gap over 20 plans |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['ranks']} | {r['start_s']:.2f} s | {r['partition_ms']:.2f} ms "
            f"| {r['fanout_ms']:.1f} ms | {r['plan_gap_ms']:.1f} ms |"
        )
    for r in rows:
        if "burst_s" in r:
            out += [
                "",
                f"A burst of elastic components launched at once (one `mpiexec.gforker -n 1` each) "
                f"beside the {r['ranks']}-rank world: {r['joined']} joined in "
                f"{r['burst_s']:.1f} s; "
                f"go -> proven hello {r['join_ms']:.1f} ms and the pump's `Accept` "
                f"{r['accept_ms']:.1f} ms per join (medians); the master's longest poll "
                f"{r['burst_poll_ms']:.1f} ms of CPU, its longest gap between loop turns "
                f"{r['burst_gap_ms']:.0f} ms.",
            ]
    return out


def _harvest(results: dict[str, dict[str, Any]]) -> list[str]:
    kinds = list(results)

    def spread(s: dict[str, float] | None) -> str:
        return "-" if s is None else f"{s['median']:g} / {s['max']:g}"

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("offered (idle worker-seconds)", lambda r: f"{r['offered_worker_s']:.1f}"),
        ("served (admitted and serving)", lambda r: f"{r['served_worker_s']:.1f}"),
        (
            "**efficiency**",
            lambda r: "-" if r["efficiency"] is None else f"**{r['efficiency']:.2f}**",
        ),
        ("gap: not held (no request running there)", lambda r: f"{r['not_held_worker_s']:.1f}"),
        ("gap: preparing (Slurm start -> admitted)", lambda r: f"{r['preparing_worker_s']:.1f}"),
        ("gap: draining (notice -> released)", lambda r: f"{r['draining_worker_s']:.1f}"),
        ("grants / reclaims (components)", lambda r: f"{r['grants']} / {r['reclaims']}"),
        ("submit -> RUNNING, median / max (s)", lambda r: spread(r["submit_to_running_s"])),
        ("RUNNING -> admitted, median / max (s)", lambda r: spread(r["running_to_admitted_s"])),
        ("steps / lost trajectories", lambda r: f"{r['steps']} / {r['lost_trajectories']}"),
        ("window both ran (s)", lambda r: f"{r['window_s']:.1f}"),
    ]
    out = ["| | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name, cell in rows:
        out.append(f"| {name} | " + " | ".join(cell(results[k]) for k in kinds) + " |")
    return out


# a generated block's name: its bench, or BENCH.PART for one of a bench's tables
TABLES: dict[str, Callable[[Any], list[str]]] = {
    "decision": _decision,
    "sim": _sim,
    "local": _local,
    "messages.train": _train_message,
    "messages.log": _trajectory_log,
    "checkpoint": _checkpoint,
    "train.memory": _train_memory,
    "train.packing": _train_packing,
    "weights": _weights,
    "engines": _engines,
    "plane": _plane,
    "harvest": _harvest,
}


def _ratio(bench: str, key: str, fmt: str) -> Callable[[dict[str, Any]], str]:
    return lambda records: format(records[bench]["ratios"][key], fmt) + "x"


# figures the README cites, each from one ratio of a bench's newest record
FIGURES: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "train-memory": ("train", _ratio("train", "both: peak / neither", ".2f")),
    "train-packing": ("train", _ratio("train", "packed / padded tokens/s", ".1f")),
    "checkpoint-wait": (
        "checkpoint",
        lambda r: format(r["checkpoint"]["result"][-1]["per_step_ratio"], ".0f") + "x",
    ),
}


def block(name: str, rec: dict[str, Any]) -> str:
    """A generated block: where its bench was measured, its table, and (a whole bench's
    block) its ratios."""
    dirty = "+" if rec["dirty"] else ""
    lines = [
        f"> commit `{rec['commit']}{dirty}` · {rec['date']} · {rec['machine']} · "
        f"`{COMMANDS[rec['bench']]}`",
        "",
        *TABLES[name](rec["result"]),
    ]
    if rec["ratios"] and "." not in name:
        lines += ["", "Ratios: " + "; ".join(f"{k} {v:g}" for k, v in rec["ratios"].items())]
    return "\n".join(lines)


def render(text: str, records: dict[str, dict[str, Any]]) -> str:
    """``text`` with each generated block and cited figure replaced from its bench's
    newest record (one whose bench has none is left as it is)."""

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        rec = records.get(name.split(".")[0])
        if rec is None or name not in TABLES:
            return m.group(0)
        return f"<!-- bench:{name} -->\n{block(name, rec)}\n<!-- /bench:{name} -->"

    def figure(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in FIGURES or FIGURES[name][0] not in records:
            return m.group(0)
        return f"<!-- fig:{name} -->{FIGURES[name][1](records)}<!-- /fig -->"

    text = re.sub(r"<!-- bench:([\w.]+) -->\n.*?<!-- /bench:\1 -->", fill, text, flags=re.S)
    return re.sub(r"<!-- fig:([\w-]+) -->(.*?)<!-- /fig -->", figure, text)


def main(path: str, check: bool = False, docs: tuple[Path, ...] = (DOC, README)) -> int:
    lines = Path(path)
    missing = [p for p in (lines, *docs) if not p.exists()]
    if missing:
        print(f"bench --report: {missing[0]} not found (run it in a source checkout)",
              file=sys.stderr)  # fmt: skip
        return 2
    benches = {n.split(".")[0] for n in TABLES} | {b for b, _ in FIGURES.values()}
    records = {k: v for k, v in record.newest(lines).items() if k in benches}
    stale = []
    for doc in docs:
        text = doc.read_text()
        new = render(text, records)
        if new != text:
            stale.append(doc)
            if not check:
                doc.write_text(new)
    if check and stale:
        print(f"bench --report --check: {', '.join(map(str, stale))} differ from {lines}: "
              f"run `pearl-hpc bench --report {path}`", file=sys.stderr)  # fmt: skip
        return 1
    if not check:
        print(f"{', '.join(d.name for d in docs)}: {', '.join(sorted(records))} from {lines}")
    return 0
