"""``pearl-hpc``: the command line.

Errors a user can fix (bad files, bad values, impossible SPECs) print one line and exit
with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pearl_hpc.config import REPO_CONFIGS, load_profile
from pearl_hpc.core.decision import decide
from pearl_hpc.core.orchestrator import CapacityUnit, plan_transition
from pearl_hpc.core.policies import PolicyConfig, gate_borrowing_of, make_policies
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.table import RoleTable
from pearl_hpc.core.types import PDConfig, Role, Status, Zone, parse_spec
from pearl_hpc.errors import ConfigError, PearlError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _number(kind: type, minimum: float) -> Any:
    """An argparse type: ``kind`` (int or float) that must be >= ``minimum`` and finite."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (value >= minimum and value != float("inf")):
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        return value

    return parse


_positive_int = _number(int, 1)
_non_negative_int = _number(int, 0)
_non_negative_float = _number(float, 0.0)


def resolve_profile(name_or_path: str) -> Path:
    """A profile path, or the name of a shipped profile in ``configs/profiles``."""
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        return path
    shipped = REPO_CONFIGS / "profiles" / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in (REPO_CONFIGS / "profiles").glob("*.yaml"))
    raise ConfigError(
        f"--profile {name_or_path!r}: no such file or shipped profile; shipped: {', '.join(names)}"
    )


# --------------------------------------------------------------------------- plan
def build_plan_table(
    current: PDConfig | None, num_overlap_workers: int
) -> tuple[RoleTable, list[int]]:
    """A table with ``current``'s dedicated workers (GPU sets ``d<i>``) and
    ``num_overlap_workers`` idle overlap workers on training GPU sets ``t<i>``."""
    table = RoleTable()
    overlap_ids: list[int] = []
    if num_overlap_workers:
        training = [f"t{i}" for i in range(num_overlap_workers)]
        table.add_worker(training, zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE)
        for gpu in training:
            slot = table.add_worker(
                [gpu], zone=Zone.OVERLAP, role=Role.COLOCATED, status=Status.INACTIVE
            )
            overlap_ids.append(slot.slot_id)
    if current is not None:
        roles = current.roles()
        for i, role in enumerate(roles):
            table.add_worker([f"d{i}"], zone=Zone.DEDICATED, role=role, status=Status.ACTIVE)
    return table, overlap_ids


def run_plan(
    profile: WorkloadProfile,
    *,
    rollout_workers: int,
    current: PDConfig | None,
    borrowable_workers: int = 0,
    toggle_cost_s: float | None = None,
    unfinished: int | None = None,
) -> dict[str, Any]:
    """The dry run behind ``pearl-hpc plan``; returns the JSON document."""
    config = PolicyConfig()
    table, overlap_ids = build_plan_table(current, borrowable_workers)
    num_current = 0 if current is None else current.total
    toggle_s = config.toggle_cost_s if toggle_cost_s is None else toggle_cost_s

    started = time.perf_counter()
    gate = None
    units = [CapacityUnit((f"d{i}",)) for i in range(num_current, rollout_workers)]
    num_workers = rollout_workers
    if borrowable_workers:
        gate = gate_borrowing_of(
            make_policies(config),
            profile,
            num_dedicated=rollout_workers,
            num_lendable=borrowable_workers,
            unfinished=unfinished,
            toggle_cost_s=toggle_s,
        )
        if gate.allow:
            num_workers += borrowable_workers
            units += [
                CapacityUnit(table.get(i).gpu_ids, Zone.OVERLAP, None, i) for i in overlap_ids
            ]
    decision = decide(profile, num_workers, current)
    plan = plan_transition(table, decision.target, units)
    elapsed_s = time.perf_counter() - started

    target = decision.target
    return {
        "mode": target.mode.value,
        "num_prefill": target.num_prefill,
        "num_decode": target.num_decode,
        "num_colocated": target.num_colocated,
        "predicted_makespan_s": decision.predicted_makespan_s,
        "switch": decision.switch,
        "forced": decision.forced,
        "reason": decision.reason,
        "current": None if current is None else current.spec(),
        "rollout_workers": rollout_workers,
        "borrowing": None
        if gate is None
        else {
            "borrowable_workers": borrowable_workers,
            "borrowed_workers": borrowable_workers if gate.allow else 0,
            "allowed": gate.allow,
            "benefit_s": gate.benefit_s,
            "toggle_cost_s": gate.cost_s,
            "reason": gate.reason,
        },
        "candidates": [c.to_dict() for c in decision.candidates],
        "plan": plan.to_dict(),
        "decision_time_s": elapsed_s,
    }


def _print_plan(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    target = PDConfig(doc["num_prefill"], doc["num_decode"], doc["num_colocated"])
    console.print(
        f"[bold]target[/bold] {target.spec()} ({doc['mode']}), predicted makespan "
        f"{doc['predicted_makespan_s']:.1f} s, switch={doc['switch']}"
    )
    console.print(f"[bold]reason[/bold] {doc['reason']}")
    if doc["borrowing"]:
        console.print(f"[bold]borrowing[/bold] {doc['borrowing']['reason']}")
    table = Table(title="candidates")
    for col in ("config", "mode", "feasible", "makespan s", "vs target"):
        table.add_column(col, justify="right" if col in ("makespan s", "vs target") else "left")
    best = doc["predicted_makespan_s"]
    for cand in doc["candidates"]:
        cfg = PDConfig(cand["num_prefill"], cand["num_decode"], cand["num_colocated"])
        mark = "*" if cfg == target else ""
        feasible = "yes" if cand["feasible"] else f"no ({cand['infeasible_reason']})"
        table.add_row(
            f"{cfg.spec()}{mark}",
            cand["mode"],
            feasible,
            f"{cand['predicted_makespan_s']:.1f}",
            f"{100 * (cand['predicted_makespan_s'] / best - 1):+.1f}%",
        )
    console.print(table)
    plan = doc["plan"]
    adds = ", ".join(f"{a['slot_id']}:{a['role']}" for a in plan["add"]) or "-"
    changes = ", ".join(f"{c['slot_id']}->{c['role']}" for c in plan["role_changes"]) or "-"
    console.print(
        f"[bold]plan[/bold] add [{adds}]  remove {plan['remove'] or '-'}  roles [{changes}]"
    )
    console.print(f"decision + plan took {1e3 * doc['decision_time_s']:.3f} ms")


def _cmd_plan(args: argparse.Namespace) -> int:
    profile = load_profile(resolve_profile(args.profile))
    current = parse_spec(args.current) if args.current else None
    doc = run_plan(
        profile,
        rollout_workers=args.rollout_workers,
        current=current,
        borrowable_workers=args.borrowable_workers,
        toggle_cost_s=args.toggle_cost_s,
        unfinished=args.unfinished,
    )
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_plan(doc)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pearl_hpc.sim.report import markdown_table, write_report
    from pearl_hpc.sim.run import SimRequest, simulate

    if args.trace and args.segment is not None:
        raise ConfigError("give either --segment or --trace, not both")
    if args.no_elastic and args.rollout_gpus is None:
        raise ConfigError("--no-elastic needs --rollout-gpus N (the fixed rollout GPUs)")
    if args.rollout_gpus is not None and not args.no_elastic:
        raise ConfigError("--rollout-gpus N means fixed resources: add --no-elastic")
    if args.report:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--report needs matplotlib: pip install -e '.[plots]'") from None
    systems = (
        None if args.systems is None else [s.strip() for s in args.systems.split(",") if s.strip()]
    )
    req = SimRequest(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        systems=systems,
        segment=None if args.trace else (args.segment if args.segment is not None else 2),
        trace_path=args.trace,
        start_s=args.start_s,
        duration_s=args.duration_s,
        rollout_gpus=args.rollout_gpus,
        training_gpus=args.training_gpus,
        batch_size=args.batch_size,
        max_trajectory_tokens=args.max_trajectory_tokens,
        seed=args.seed,
        sweep_static=args.sweep_static,
        router=args.router,
    )
    sims: dict = {}
    show = sys.stderr.isatty() and not args.no_progress
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        transient=True,
        disable=not show,
    ) as bar:
        tasks: dict[str, Any] = {}

        def progress(name: str, sim_s: float, total_s: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(f"simulating {name}", total=total_s)
            bar.update(tasks[name], completed=sim_s)

        doc = simulate(req, progress=progress, keep=sims if args.report else None)
    if args.report:
        written = write_report(args.report, doc, sims)
        print(f"report: {len(written)} files in {args.report}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(markdown_table(doc))
    return 0


def _cmd_calibrate_sim(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from pearl_hpc.sim.calibrate import run

    console = Console(stderr=True)
    figures = run(args.router, progress=None if args.json else console.log)
    if args.json:
        print(json.dumps([f.to_dict() for f in figures], indent=2))
        return 0
    table = Table(title=f"simulator vs PEARL's measurements (router: {args.router})")
    for col in ("figure", "PEARL", "simulator", "tolerance", "within"):
        table.add_column(col)
    for f in figures:
        table.add_row(f.name, f.paper, f.ours, f.tolerance, "yes" if f.ok else "NO")
    Console().print(table)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import os
    from datetime import UTC, datetime

    from pearl_hpc.calibrate import MiB, run_calibration

    return run_calibration(
        out=Path(args.out),
        nccl_dir=None if args.nccl_dir is None else Path(args.nccl_dir),
        gloo_ranks=args.ranks,
        srun=args.srun,
        max_size_bytes=int(args.max_size_mib * MiB),
        timeout_s=args.timeout_s,
        profile=None if args.profile is None else resolve_profile(args.profile),
        profile_out=None if args.profile_out is None else Path(args.profile_out),
        now=datetime.now(UTC),
        env=os.environ,
    )


def _cmd_launch(args: argparse.Namespace) -> int:
    import json

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


def _cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from pearl_hpc.config.run import load_run_config
    from pearl_hpc.master.journal import new_run_dir
    from pearl_hpc.master.loop import run_master
    from pearl_hpc.master.records import format_step, format_summary

    if args.submit:
        return _submit_run(args)
    if args.resume:
        run_dir = Path(args.resume)
        cfg = load_run_config(run_dir / "config.yaml")
        print(f"pearl-hpc run: resuming {run_dir}", flush=True)
    else:
        cfg = load_run_config(args.config)
        run_dir = new_run_dir(cfg.runs_dir, cfg.name, Path(args.config))
        print(f"pearl-hpc run: {run_dir}", flush=True)

    def progress(m: Any) -> None:
        print(format_step(m), flush=True)

    live = _LiveRollout() if sys.stdout.isatty() else None
    try:
        summary = asyncio.run(
            run_master(
                cfg,
                run_dir,
                on_step=progress,  # printed above the live line on a terminal
                resume=bool(args.resume),
                on_progress=live.update if live is not None else None,
            )
        )
    finally:
        if live is not None:
            live.stop()
    print(format_summary(summary))
    print(f"status: pearl-hpc status {run_dir}; plots: pearl-hpc report {run_dir}")
    return 0


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


class _LiveRollout:
    """A live line under the step log on a terminal: the rollout in progress, the
    serving roles, elastic and borrowed workers."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self.live = Live("", console=self.console, refresh_per_second=4, transient=True)
        self.live.start()
        self.finished: set[str] = set()

    def update(self, step: int, traj: Any, batch: int, executor: Any) -> None:
        if traj.done:
            self.finished.add(traj.trajectory_id)
        done = sum(1 for t in self.finished if t.startswith(f"s{step}-"))
        roles = " ".join(
            f"s{w.slot_id}={str(w.role)[0].upper()}"
            for w in executor.workers.values()
            if w.slot_id is not None and w.role is not None
        )
        borrowed = executor.activating_overlap()
        jobs = ""
        if executor.backend.summary() is not None:  # the Slurm backend's elastic components
            live = executor.backend.describe()
            jobs = ", elastic jobs " + (" ".join(c["component"] for c in live) or "none")
        self.live.update(
            f"step {step}: rollout {done}/{batch} trajectories, turns moved "
            f"{executor.counters.moved_turns}, roles {roles or '-'}, "
            f"borrowed {'yes' if borrowed else 'no'}{jobs}"
        )

    def stop(self) -> None:
        self.live.stop()


def _cmd_status(args: argparse.Namespace) -> int:
    from pearl_hpc.runview import format_status, run_status

    doc = run_status(Path(args.run_dir))
    print(json.dumps(doc, indent=1) if args.json else format_status(doc))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pearl_hpc.runview import write_run_report

    for path in write_run_report(Path(args.run_dir), Path(args.out) if args.out else None):
        print(path)
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from pearl_hpc.engine.tinymodel import build_tiny_model, default_model_dir

    print(build_tiny_model(args.out or default_model_dir()))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pearl_hpc.bench import decision_speed, sim_speed

    if args.engines:
        from pearl_hpc.bench import engines

        extra = ["--model", args.model] if args.model else []
        return engines.main(extra + (["--json"] if args.json else []))
    if args.local:
        from pearl_hpc.bench import local_run

        return local_run.main(args.config or str(REPO_CONFIGS / "runs" / "local.yaml"), args.json)
    if args.slurm:
        from pearl_hpc.bench import slurm_latency

        extra = ["--runs", str(args.runs)] + (["--config", args.config] if args.config else [])
        return slurm_latency.main(extra + (["--json"] if args.json else []))
    module = sim_speed if args.sim else decision_speed
    return module.main(["--json"] if args.json else [])


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pearl-hpc",
        description="PEARL (adaptive prefill-decode execution with elasticity for agentic RL) "
        "on Slurm clusters: plan, simulate, calibrate, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser(
        "plan",
        help="dry run: PD decision + minimal-change plan for a workload profile",
        description="Score colocation and every P:D split for N rollout workers, apply "
        "hysteresis against --current, gate borrowing of --borrowable-workers, and print "
        "the decision and its minimal-change transition plan.",
    )
    plan.add_argument(
        "--profile",
        required=True,
        help="profile YAML, or a shipped name (e.g. qwen3-30b-a3b-h800-tp2)",
    )
    plan.add_argument(
        "--rollout-workers",
        type=_positive_int,
        required=True,
        help="dedicated rollout workers available now (N)",
    )
    plan.add_argument("--current", help="current configuration, e.g. 8C or 3P5D")
    plan.add_argument(
        "--borrowable-workers",
        type=_non_negative_int,
        default=0,
        help="idle training-GPU workers that may be borrowed (M)",
    )
    plan.add_argument(
        "--toggle-cost-s",
        type=_non_negative_float,
        default=None,
        help="T_toggle for the borrowing gate (default 9.44 s)",
    )
    plan.add_argument(
        "--unfinished",
        type=_non_negative_int,
        default=None,
        help="unfinished trajectories R for the borrowing gate (default: B)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_cmd_plan)

    sim = sub.add_parser(
        "simulate",
        help="discrete-event simulation of PEARL and the baselines at cluster scale",
        description="Simulate agentic RL rollout + training on a GPU cluster with elastic "
        "capacity from a spot trace, driving the production controller.",
    )
    sim.add_argument("--model", default="qwen3-8b", help="qwen3-8b | qwen3-30b-a3b")
    sim.add_argument("--gpu", default="h800", help="h800 | h100 | a100")
    sim.add_argument("--tp", type=_positive_int, default=2, help="GPUs per rollout worker")
    sim.add_argument(
        "--segment",
        type=int,
        choices=(1, 2, 3),
        default=None,
        help="PEARL trace segment (default 2)",
    )
    sim.add_argument("--trace", help="availability trace CSV (seconds,instances)")
    sim.add_argument(
        "--start-s", type=_non_negative_float, default=0.0, help="window start in --trace"
    )
    sim.add_argument(
        "--duration-s",
        type=_non_negative_float,
        default=None,
        help="simulated seconds (default: the segment, 7200)",
    )
    sim.add_argument(
        "--systems",
        default=None,
        help="comma list of roll, roll-large, rlboost+, pd-only, pd+toggle, pearl, "
        "static-coloc, static-<P>P<D>D (default: roll,roll-large,rlboost+,pearl; with "
        "--sweep-static: pearl and the sweep)",
    )
    sim.add_argument(
        "--rollout-gpus",
        type=_positive_int,
        default=None,
        help="fixed dedicated rollout GPUs (with --no-elastic)",
    )
    sim.add_argument("--no-elastic", action="store_true", help="no trace: fixed resources")
    sim.add_argument("--training-gpus", type=_positive_int, default=16)
    sim.add_argument("--batch-size", type=_positive_int, default=None)
    sim.add_argument("--max-trajectory-tokens", type=_positive_int, default=None)
    sim.add_argument("--seed", type=_non_negative_int, default=0)
    sim.add_argument(
        "--sweep-static",
        action="store_true",
        help="also run every static P:D split and colocation (fixed resources)",
    )
    sim.add_argument(
        "--router",
        choices=("sticky", "least-loaded"),
        default="sticky",
        help="turn routing: back to the worker caching the prefix (default), or "
        "least loaded (ROLL-style, prefix mostly re-prefilled)",
    )
    sim.add_argument("--json", action="store_true", help="print the JSON document")
    sim.add_argument("--report", metavar="DIR", help="write summary.md, results.json, PNG plots")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.set_defaults(func=_cmd_simulate)

    cal = sub.add_parser(
        "calibrate-sim",
        help="compare the simulator with PEARL's published motivation measurements",
    )
    cal.add_argument("--router", choices=("sticky", "least-loaded"), default="sticky")
    cal.add_argument("--json", action="store_true")
    cal.set_defaults(func=_cmd_calibrate_sim)

    calib = sub.add_parser(
        "calibrate",
        help="measure cluster bandwidth (nccl-tests output or gloo) into a cluster YAML",
        description="Write a cluster bandwidth file (configs/clusters/NAME-bandwidth.yaml) "
        "from nccl-tests output "
        "(slurm/nccl-tests.sh run) or from a gloo measurement, and optionally a copy of a "
        "workload profile with the measured transfer_bytes_per_s (sendrecv bandwidth).",
    )
    source = calib.add_mutually_exclusive_group(required=True)
    source.add_argument("--nccl-dir", help="folder of <test>_perf.txt nccl-tests outputs")
    source.add_argument("--gloo", action="store_true", help="measure with torch.distributed gloo")
    calib.add_argument(
        "--ranks", type=_positive_int, default=2, help="local gloo ranks to start (default 2)"
    )
    calib.add_argument(
        "--srun",
        action="store_true",
        help="with --gloo: this process is one srun task (SLURM_PROCID, SLURM_NTASKS, "
        "MASTER_ADDR/MASTER_PORT); rank 0 writes",
    )
    calib.add_argument(
        "--max-size-mib",
        type=_number(float, 1.0),
        default=64.0,
        help="gloo: largest message, MiB (sizes 1, 4, 16, ... MiB; default 64)",
    )
    calib.add_argument(
        "--timeout-s", type=_number(float, 1.0), default=120.0, help="gloo rendezvous/op timeout"
    )
    calib.add_argument("--out", required=True, help="bandwidth YAML to write")
    calib.add_argument("--profile", help="profile YAML or shipped name to copy with the BW")
    calib.add_argument(
        "--profile-out", help="where the profile copy goes (default <profile>-<out name>.yaml)"
    )
    calib.set_defaults(func=_cmd_calibrate)

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
        help="continue the run in RUN_DIR after its master died (config from RUN_DIR)",
    )
    run_p.add_argument(
        "--submit",
        action="store_true",
        help="submit the master as a Slurm job with submitit (requeued and resumed on "
        "preemption or time-out)",
    )
    run_p.add_argument("--partition", help="with --submit: the master's partition")
    run_p.add_argument("--gpus", type=int, default=0, help="with --submit: GPUs of the master")
    run_p.add_argument("--cpus", type=int, default=4, help="with --submit: CPUs of the master")
    run_p.add_argument("--wait", action="store_true", help="with --submit: wait, print summary")
    run_p.set_defaults(func=_cmd_run)

    status_p = sub.add_parser("status", help="state of a running or finished run")
    status_p.add_argument("run_dir", help="the directory `pearl-hpc run` printed")
    status_p.add_argument("--json", action="store_true", help="one JSON object")
    status_p.set_defaults(func=_cmd_status)

    report_p = sub.add_parser(
        "report", help="plots of a run: throughput with the worker budget, roles, prediction"
    )
    report_p.add_argument("run_dir", help="the directory `pearl-hpc run` printed")
    report_p.add_argument("--out", help="output directory (default: RUN_DIR/report)")
    report_p.set_defaults(func=_cmd_report)

    tiny = sub.add_parser(
        "tiny-model", help="build the tiny Qwen3 model + tokenizer locally (no hub access)"
    )
    tiny.add_argument("out", nargs="?", help="directory (default: $PEARL_HPC_CACHE/tiny-qwen3)")
    tiny.set_defaults(func=_cmd_tiny_model)

    bench = sub.add_parser(
        "bench", help="benchmarks: decision + plan speed (64 .. 4096 workers), or --sim"
    )
    bench.add_argument("--sim", action="store_true", help="simulator speed instead")
    bench.add_argument(
        "--slurm",
        action="store_true",
        help="Slurm + MPI latencies on a running cluster (submit, join, Split, release)",
    )
    bench.add_argument(
        "--engines",
        action="store_true",
        help="real vLLM engines: start, role change, weight load, (de)activation, memory, "
        "tokens/s colocated vs disaggregated",
    )
    bench.add_argument(
        "--local",
        action="store_true",
        help="the local training run: pearl vs fixed colocated, reconfiguration latencies, "
        "predicted vs measured rollout",
    )
    bench.add_argument("--model", help="with --engines: model directory (default: tiny model)")
    bench.add_argument(
        "--config",
        help="with --slurm: cluster YAML (default: local.yaml); with --local: run YAML "
        "(default: configs/runs/local.yaml)",
    )
    bench.add_argument("--runs", type=int, default=2, help="with --slurm: runs to merge")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except PearlError as exc:
        print(f"pearl-hpc: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pearl-hpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
