"""Latency of the Slurm + MPI mechanisms on a real cluster (the local one here).

    pearl-hpc bench --slurm [--config configs/clusters/local.yaml] [--runs 2]

Runs the config ``--runs`` times (each: a submitit base job, the configured elastic
hetjobs joining over MPI, re-partitions, a release) and prints each milestone's median
and max over all components and runs. Side by side, the baseline: a plain
``sbatch --wrap true`` on the same partition, submit -> RUNNING, polled the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from pearl_hpc.cluster import load_cluster
from pearl_hpc.config import REPO_CONFIGS
from pearl_hpc.launch import latency_rows, submit, wait_for_run
from pearl_hpc.slurm.client import run_command
from pearl_hpc.slurm.parse import parse_sbatch_parsable


def baseline_submit_to_running(partition: str, poll_s: float) -> float:
    """Seconds from ``sbatch`` of a trivial job to squeue showing it RUNNING."""
    t0 = time.monotonic()
    result = run_command(
        ["sbatch", "--parsable", "-p", partition, "-o", "/dev/null", "--wrap", "sleep 5"]
    )
    if result.returncode:
        raise RuntimeError(f"baseline sbatch failed: {result.stderr.strip()}")
    job = parse_sbatch_parsable(result.stdout)
    try:
        while True:
            state = run_command(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
            if state in ("RUNNING", "COMPLETING", ""):
                return time.monotonic() - t0
            time.sleep(poll_s)
    finally:
        run_command(["scancel", job])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --slurm", description=__doc__)
    parser.add_argument("--config", default=str(REPO_CONFIGS / "clusters/local.yaml"))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = load_cluster(args.config)
    merged: dict[str, list[float]] = {}
    for _ in range(args.runs):
        _, run_dir = submit(args.config)
        wait_for_run(Path(run_dir))
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        for label, values in latency_rows(summary):
            merged.setdefault(label, []).extend(values)
    partition = (
        cfg.elastic.requests[0].components[0].partition if cfg.elastic.requests else "normal"
    )
    baseline = [baseline_submit_to_running(partition, cfg.elastic.poll_s) for _ in range(3)]
    if args.json:
        print(json.dumps({"rows": merged, "baseline_sbatch_to_running": baseline}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.runs} run(s) of {args.config}")
    for column in ("what", "n", "median s", "max s"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for label, values in merged.items():
        table.add_row(label, str(len(values)), f"{statistics.median(values):.3f}",
                      f"{max(values):.3f}")  # fmt: skip
    table.add_row(
        "baseline: plain sbatch -> RUNNING",
        str(len(baseline)),
        f"{statistics.median(baseline):.3f}",
        f"{max(baseline):.3f}",
    )
    Console().print(table)
    return 0
