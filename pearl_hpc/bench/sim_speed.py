"""Simulator speed: wall time of the four default systems over a 2-hour segment, and how
cost grows with simulated time, with trajectories per batch and with the cluster (256 and
1,024 GPUs, fixed).

Run: ``pearl-hpc bench --sim`` (or ``python -m pearl_hpc.bench.sim_speed``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from pearl_hpc.bench import record
from pearl_hpc.sim.run import SimRequest, simulate

SYSTEMS = ("roll", "roll-large", "rlboost+", "pearl")


def _run(**kwargs: Any) -> dict[str, Any]:
    started = time.perf_counter()
    doc = simulate(SimRequest(**kwargs))
    wall = time.perf_counter() - started
    events = sum(r["events"] for r in doc["systems"].values())
    trajectories = sum(r["trajectories_started"] for r in doc["systems"].values())
    return {
        "wall_s": round(wall, 2),
        "events": events,
        "trajectories": trajectories,
        "us_per_event": round(1e6 * wall / max(1, events), 1),
    }


def run(smallest: bool = False) -> list[dict[str, Any]]:
    """Every case, or (``smallest``) the cheapest one: pearl on segment 2 for 3600 s."""
    if smallest:
        row = _run(model="qwen3-8b", segment=2, duration_s=3600.0, systems=("pearl",))
        return [{"case": "pearl, segment 2, 3600 s", **row}]
    rows = []
    for model in ("qwen3-8b", "qwen3-30b-a3b"):
        for segment in (1, 2, 3):
            row = _run(model=model, segment=segment, systems=SYSTEMS)
            rows.append({"case": f"{model} segment {segment}, 4 systems, 7200 s", **row})
    for duration in (3600.0, 7200.0):
        row = _run(model="qwen3-8b", segment=2, duration_s=duration, systems=("pearl",))
        rows.append({"case": f"pearl, segment 2, {duration:.0f} s", **row})
    for batch in (64, 128):
        row = _run(model="qwen3-8b", segment=2, batch_size=batch, systems=("pearl",))
        rows.append({"case": f"pearl, segment 2, batch {batch}", **row})
    for half, batch in ((128, 512), (512, 2048)):  # fixed clusters: cost per event by size
        row = _run(
            model="qwen3-8b", segment=2, rollout_gpus=half, training_gpus=half,
            batch_size=batch, duration_s=600.0, systems=("pearl",),
        )  # fmt: skip
        rows.append({"case": f"pearl, {2 * half} GPUs, batch {batch}, 600 s", **row})
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The cost per event of each fixed cluster over PEARL's 32 GPUs (the six segment
    runs): what an event costs more as the cluster grows."""
    base = [r["us_per_event"] for r in rows if "segment" in r["case"] and "4 systems" in r["case"]]
    if not base:
        return {}
    per = sum(base) / len(base)
    return {
        f"{r['case'].split(',')[1].strip()} / 32 GPUs, us/event": r["us_per_event"] / per
        for r in rows
        if "GPUs" in r["case"]
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smallest", action="store_true", help="the cheapest case only")
    record.add_argument(parser)
    args = parser.parse_args(argv)
    rows = run(args.smallest)
    record.append(args.record, "sim", rows, ratios(rows), vars(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="simulator speed (wall seconds on this machine)")
    for col in ("case", "wall s", "events", "trajectories", "us/event"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        table.add_row(
            r["case"],
            f"{r['wall_s']:.2f}",
            str(r["events"]),
            str(r["trajectories"]),
            f"{r['us_per_event']:.1f}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
