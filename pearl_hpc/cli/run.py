"""``pearl-hpc run`` (a training run, local or Slurm backend; ``--submit``, ``--resume``),
``status`` and ``report`` of a run directory."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.cli.common import EXIT_USAGE, existing_run_dir, out_dir
from pearl_hpc.config import REPO_CONFIGS
from pearl_hpc.config.cluster import run_config_text
from pearl_hpc.errors import ConfigError


def _cmd_run(args: argparse.Namespace) -> int:
    """Check the config, make the run directory, then run the run's MPI world to its end
    (rank 0, the master, prints a line per step and the summary)."""
    from pearl_hpc.backends.world import container, launch_world, launcher_path
    from pearl_hpc.engine.spec import check_engine_install
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.rundir import RunDir, RunStatus, read_journal

    if args.resume and args.set:
        raise ConfigError(
            "--set with --resume: the run's config is RUN_DIR/config.yaml (what it started "
            "with, resolved); a resume continues that run unchanged"
        )
    if args.resume and (args.dry_run or args.submit):
        raise ConfigError(
            "--resume goes alone (this process runs the resumed world) or with --sbatch "
            "(a batch job runs it)"
        )
    if args.offline and not (args.dry_run or args.sbatch or args.submit):
        raise ConfigError("--offline goes with --dry-run, --sbatch or --submit")
    if args.wait and not args.submit:
        raise ConfigError("--wait goes with --submit")
    if args.dry_run:
        return _dry_run(args)
    if args.submit:
        return _submit_run(args)
    if args.sbatch:
        return _sbatch_run(args)
    if args.resume:
        run = RunDir(Path(args.resume))
        cfg = load_run_config(run.config)
        run.lock().close()  # a live master still there: one line, exit 2
        status = read_journal(run.journal).get("status") if run.journal.exists() else None
        if status == RunStatus.FINISHED:
            print(f"pearl-hpc run: {run.path} has finished; nothing to resume", flush=True)
            return 0
    else:
        cfg = load_run_config(args.config, sets=args.set)
    if not container(cfg).runtime:  # (in an image, vLLM is the image's: each rank checks it)
        check_engine_install(cfg.engine)  # vLLM's version and engine.vllm_args, one line
    launcher_path(cfg)  # no MPI: one clear line before a run directory is made
    if args.resume:  # (a directory made by --sbatch starts there: it has no journal yet)
        resume = status is not None
        print(f"pearl-hpc run: {'resuming ' if resume else ''}{run.path}", flush=True)
    else:
        run = RunDir.new(cfg.runs_dir, cfg.name, run_config_text(args.config, args.set))
        resume = False
        print(f"pearl-hpc run: {run.path}", flush=True)
    return launch_world(cfg, run.path, resume=resume, live=sys.stdout.isatty())


def _dry_run(args: argparse.Namespace) -> int:
    """The dry run's text; the pre-queue checks' problems, one line each, exit 2."""
    from pearl_hpc.backends.checks import prequeue_checks
    from pearl_hpc.cli.dryrun import dry_run
    from pearl_hpc.config.cluster import resolve_run_mapping
    from pearl_hpc.master.preflight import load_run_config

    cfg = load_run_config(args.config, need_slurm=False, sets=args.set)
    origins = resolve_run_mapping(args.config, args.set).origins
    checks = prequeue_checks(
        cfg, slurm=cfg.backend == "slurm", offline=args.offline, queue=False
    )
    print(dry_run(cfg, args.config, origins, checks.lines()), end="", flush=True)
    return _refused(args.config, checks.problems)


def _refused(source: str, problems: Sequence[str], warnings: Sequence[str] = ()) -> int:
    """The pre-queue checks' problems, one line each, and exit 2; without any, their
    warnings (the run is queued all the same) and 0."""
    for problem in problems:
        print(f"pearl-hpc: error: {source}: {problem}", file=sys.stderr)
    for warning in [] if problems else warnings:
        print(f"pearl-hpc: warning: {source}: {warning}", file=sys.stderr)
    return EXIT_USAGE if problems else 0


def _sbatch_run(args: argparse.Namespace) -> int:
    """The run as its base batch job: checked, its directory made, its script (from the
    config's site settings) submitted; a refusal leaves no directory behind. With
    ``--resume RUN_DIR``: a batch job that resumes that run."""
    import shutil

    from pearl_hpc.backends.checks import prequeue_checks
    from pearl_hpc.backends.world import base_job_spec
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.rundir import RunDir
    from pearl_hpc.slurm.client import SlurmClient, SlurmError

    source = str(RunDir(Path(args.resume)).config) if args.resume else args.config
    cfg = load_run_config(source, sets=[] if args.resume else args.set)
    checks = prequeue_checks(cfg, slurm=True, offline=args.offline)
    if _refused(source, checks.problems, checks.warnings):
        return EXIT_USAGE
    if args.resume:
        run_dir = Path(args.resume).resolve()
    else:
        run = RunDir.new(cfg.runs_dir, cfg.name, run_config_text(args.config, args.set))
        run_dir = run.path.resolve()
    try:
        job = SlurmClient().submit(base_job_spec(cfg, run_dir))
    except SlurmError as exc:
        if not args.resume:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise ConfigError(f"{source}: the base job was not queued: {exc}") from None
    RunDir(run_dir).base_job.write_text(f"{job}\n")
    print(f"pearl-hpc run: batch job {job}, run directory {run_dir}", flush=True)
    print(f"its log: {run_dir / f'batch-{job}.out'}; follow it: pearl-hpc status {run_dir}")
    return 0


def _submit_run(args: argparse.Namespace) -> int:
    """The master as a submitit job (requeued on preemption, resumed from its journal),
    checked before it is queued."""
    from pearl_hpc.backends.checks import prequeue_checks
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.master.records import format_summary
    from pearl_hpc.runjob import submit_run

    cfg = load_run_config(args.config, sets=args.set)
    checks = prequeue_checks(cfg, slurm=True, offline=args.offline)
    if _refused(args.config, checks.problems, checks.warnings):
        return EXIT_USAGE
    job, run_dir = submit_run(args.config, args.set)
    print(f"pearl-hpc run: job {job.job_id}, run directory {run_dir}", flush=True)
    print(f"follow it: pearl-hpc status {run_dir}", flush=True)
    if args.wait:
        print(format_summary(job.results()[0]))
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    """Stop a run cleanly: its master checkpoints, drains its workers, cancels its
    elastic jobs and ends (status stopped; ``--resume`` continues it). A batch job that
    has not started is cancelled."""
    import time

    from pearl_hpc.rundir import RunDir, RunStatus, read_journal
    from pearl_hpc.slurm.client import SlurmClient, SlurmError

    run = RunDir(Path(args.run_dir))
    status = read_journal(run.journal).get("status") if run.journal.exists() else None
    if status in (RunStatus.FINISHED, RunStatus.STOPPED):
        print(f"pearl-hpc cancel: {run.path} is {status}; nothing runs")
        return 0
    if not run.lock_held():
        job = run.base_job.read_text().strip() if run.base_job.exists() else ""
        if not job:
            print(f"pearl-hpc cancel: no master runs {run.path} (status: pearl-hpc status)")
            return 0
        try:
            SlurmClient().cancel(job)
        except SlurmError as exc:
            raise ConfigError(f"pearl-hpc cancel: {exc}") from None
        print(f"pearl-hpc cancel: cancelled batch job {job} before its master started")
        return 0
    run.stop_request.write_text(f"{time.time():.0f}\n")
    print(f"pearl-hpc cancel: asked the master of {run.path} to stop (a checkpoint, its "
          "workers drained, its elastic jobs cancelled)", flush=True)  # fmt: skip
    if not args.wait:
        print(f"follow it: pearl-hpc status {run.path}")
        return 0
    deadline = time.monotonic() + args.timeout_s
    while run.lock_held() and time.monotonic() < deadline:
        time.sleep(1.0)
    if run.lock_held():
        raise ConfigError(f"pearl-hpc cancel: the master still runs after {args.timeout_s:g} s")
    print(f"pearl-hpc cancel: stopped; continue it: pearl-hpc run --resume {run.path}")
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
        help="continue the run in RUN_DIR after its master died (config from RUN_DIR; "
        "one --sbatch made and nothing ran in yet starts there)",
    )
    run_p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config value (YAML), e.g. --set run.steps=3 --set "
        "slurm.partition=gpu; the run directory keeps the result",
    )
    run_p.add_argument(
        "--sbatch",
        action="store_true",
        help="check the run against the cluster, then submit it as its batch job (the "
        "script --dry-run prints: the config's slurm: site settings)",
    )
    run_p.add_argument(
        "--offline",
        action="store_true",
        help="with --dry-run or --sbatch: skip the checks against the cluster (Slurm, the "
        "model directory)",
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
    run_p.add_argument("--wait", action="store_true", help="with --submit: wait, print summary")
    run_p.set_defaults(func=_cmd_run)

    cancel_p = sub.add_parser(
        "cancel", help="stop a run cleanly (checkpoint, drain, scancel); --resume continues it"
    )
    cancel_p.add_argument(
        "run_dir", type=existing_run_dir, help="the directory `pearl-hpc run` printed"
    )
    cancel_p.add_argument("--wait", action="store_true", help="until the master has ended")
    cancel_p.add_argument("--timeout-s", type=float, default=600.0, help="with --wait")
    cancel_p.set_defaults(func=_cmd_cancel)

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
