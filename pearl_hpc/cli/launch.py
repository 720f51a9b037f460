"""``pearl-hpc launch``: the MPI control plane's base job with the no-op workload."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _cmd_launch(args: argparse.Namespace) -> int:

    from rich.console import Console

    from pearl_hpc import launch

    if args.sbatch:
        job_id, run_dir = launch.submit_sbatch(args.config)
    else:
        job, run_dir = launch.submit(args.config)
        job_id = job.job_id
    print(f"submitted base job {job_id}; run directory {run_dir}")
    if not args.wait:
        print(f"follow it with: tail -f {run_dir}/events.jsonl")
        return 0
    launch.wait_for_run(run_dir, timeout_s=args.timeout_s)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        print(f"pearl-hpc: the run ended without a summary; see {run_dir}", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    Console().print(launch.summary_table(summary))
    for error in summary["errors"]:
        print(f"error during the run: {error}", file=sys.stderr)
    return 0


def add_parsers(sub: Any) -> None:
    launch_p = sub.add_parser(
        "launch",
        help="start a run's base job on Slurm (submitit, or --sbatch)",
        description="Submit the base job described by a cluster YAML (configs/clusters/). "
        "Rank 0 becomes the master: it submits and cancels elastic heterogeneous jobs, "
        "their ranks join over MPI. Needs pip install -e .[slurm] and a Slurm cluster "
        "(slurm/local-cluster.sh up for a local one).",
    )
    launch_p.add_argument("config", help="cluster YAML, e.g. configs/clusters/local.yaml")
    launch_p.add_argument("--sbatch", action="store_true", help="plain sbatch, not submitit")
    launch_p.add_argument("--wait", action="store_true", help="wait and print the summary")
    launch_p.add_argument("--timeout-s", type=float, default=3600.0, help="with --wait")
    launch_p.set_defaults(func=_cmd_launch)
