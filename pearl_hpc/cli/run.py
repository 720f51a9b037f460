"""``pearl-hpc run`` (a training run, local or Slurm backend; ``--submit``, ``--resume``),
``status`` and ``report`` of a run directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pearl_hpc.cli.common import existing_run_dir, out_dir
from pearl_hpc.config import REPO_CONFIGS


def _cmd_run(args: argparse.Namespace) -> int:
    """Check the config, make the run directory, then run the run's MPI world to its end
    (rank 0, the master, prints a line per step and the summary)."""
    from pearl_hpc.backends.world import launch_world
    from pearl_hpc.comm.mpiexec import mpiexec_path
    from pearl_hpc.engine.spec import check_engine_install
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.rundir import RunDir

    if args.dry_run:
        from pearl_hpc.cli.dryrun import dry_run

        print(dry_run(load_run_config(args.config, need_slurm=False), args.config), end="")
        return 0
    if args.submit:
        return _submit_run(args)
    if args.resume:
        run_dir = Path(args.resume)
        cfg = load_run_config(RunDir(run_dir).config)
        RunDir(run_dir).lock().close()  # a live master still there: one line, exit 2
    else:
        cfg = load_run_config(args.config)
    check_engine_install(cfg.engine)  # vLLM's version and engine.vllm_args, one line
    mpiexec_path()  # no MPI: one clear line before a run directory is made
    if args.resume:
        print(f"pearl-hpc run: resuming {run_dir}", flush=True)
    else:
        run_dir = RunDir.new(cfg.runs_dir, cfg.name, Path(args.config)).path
        print(f"pearl-hpc run: {run_dir}", flush=True)
    return launch_world(cfg, run_dir, resume=bool(args.resume), live=sys.stdout.isatty())


def _submit_run(args: argparse.Namespace) -> int:
    """The master as a submitit job (requeued on preemption, resumed from its journal)."""
    from pearl_hpc.master.records import format_summary
    from pearl_hpc.runjob import submit_run

    job, run_dir = submit_run(args.config, partition=args.partition, gpus=args.gpus, cpus=args.cpus)
    print(f"pearl-hpc run: job {job.job_id}, run directory {run_dir}", flush=True)
    print(f"follow it: pearl-hpc status {run_dir}", flush=True)
    if args.wait:
        print(format_summary(job.result()))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from pearl_hpc.cli.view import format_status, run_status

    doc = run_status(Path(args.run_dir))
    print(json.dumps(doc, indent=1) if args.json else format_status(doc))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pearl_hpc.cli.view import write_run_report

    for path in write_run_report(Path(args.run_dir), Path(args.out) if args.out else None):
        print(path)
    return 0


def add_parsers(sub: Any) -> None:
    run_p = sub.add_parser(
        "run", help="a training run: controller + vLLM engines + GRPO (local or Slurm backend)"
    )
    run_p.add_argument(
        "config",
        nargs="?",
        default=str(REPO_CONFIGS / "runs" / "local.yaml"),
        help="run YAML (default: configs/runs/local.yaml, the embedded local default)",
    )
    run_p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        type=existing_run_dir,
        help="continue the run in RUN_DIR after its master died (config from RUN_DIR)",
    )
    run_p.add_argument(
        "--submit",
        action="store_true",
        help="submit the master as a Slurm job with submitit (requeued and resumed on "
        "preemption or time-out)",
    )
    run_p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config and print the base job, which rank runs what where, the "
        "elastic job and the controller's first decision; start nothing",
    )
    run_p.add_argument("--partition", help="with --submit: the master's partition")
    run_p.add_argument("--gpus", type=int, default=0, help="with --submit: GPUs of the master")
    run_p.add_argument("--cpus", type=int, default=4, help="with --submit: CPUs of the master")
    run_p.add_argument("--wait", action="store_true", help="with --submit: wait, print summary")
    run_p.set_defaults(func=_cmd_run)

    status_p = sub.add_parser("status", help="state of a running or finished run")
    status_p.add_argument(
        "run_dir", type=existing_run_dir, help="the directory `pearl-hpc run` printed"
    )
    status_p.add_argument("--json", action="store_true", help="one JSON object")
    status_p.set_defaults(func=_cmd_status)

    report_p = sub.add_parser(
        "report", help="plots of a run: throughput with the worker budget, roles, prediction"
    )
    report_p.add_argument(
        "run_dir", type=existing_run_dir, help="the directory `pearl-hpc run` printed"
    )
    report_p.add_argument("--out", type=out_dir, help="output directory (default: RUN_DIR/report)")
    report_p.set_defaults(func=_cmd_report)
