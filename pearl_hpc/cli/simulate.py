"""``pearl-hpc simulate`` (the paper-scale simulator) and ``calibrate-sim`` (where it
lands on PEARL's motivation measurements)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pearl_hpc.cli.common import (
    MAX_BATCH,
    existing_run_dir,
    non_negative_float,
    non_negative_int,
    number,
    out_dir,
    positive_int,
    resolve_profile,
    resolve_workload,
)
from pearl_hpc.config.run import MAX_STALENESS
from pearl_hpc.errors import ConfigError
from pearl_hpc.sim.systems import ROUTERS


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
        trace_scale=args.trace_scale,
        duration_s=args.duration_s,
        rollout_gpus=args.rollout_gpus,
        training_gpus=args.training_gpus,
        batch_size=args.batch_size,
        max_trajectory_tokens=args.max_trajectory_tokens,
        max_staleness=args.max_staleness,
        seed=args.seed,
        sweep_static=args.sweep_static,
        router=args.router,
        workload_path=resolve_workload(args.workload),
        kv_bandwidth_from=None
        if args.kv_bandwidth_from is None
        else resolve_profile(args.kv_bandwidth_from, "--kv-bandwidth-from"),
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

    from pearl_hpc.sim.validation import run

    console = Console(stderr=True)
    workload = resolve_workload(args.workload)
    figures = run(args.router, workload, progress=None if args.json else console.log)
    if args.json:
        print(json.dumps([f.to_dict() for f in figures], indent=2))
        return 0
    table = Table(
        title=f"simulator vs PEARL's measurements (router: {args.router}, "
        f"workload: {args.workload})"
    )
    for col in ("figure", "PEARL", "simulator", "tolerance", "within"):
        table.add_column(col)
    for f in figures:
        table.add_row(f.name, f.paper, f.ours, f.tolerance, "yes" if f.ok else "NO")
    Console().print(table)
    return 0


def _cmd_validate_sim(args: argparse.Namespace) -> int:
    from pearl_hpc.sim.counterfactual import (
        NOT_MODELLED,
        counterfactual,
        format_inputs,
        format_validation,
    )
    from pearl_hpc.sim.replay import load_run

    doc = counterfactual(load_run(args.run_dir))
    if args.json:
        print(json.dumps({k: doc[k] for k in ("run", "inputs", "measured", "validation")}))
        return 0
    print(f"{doc['run']}: the simulator replays the run from its own inputs")
    print(f"inputs: {format_inputs(doc)}")
    print(format_validation(doc))
    print(f"not modelled: {NOT_MODELLED}")
    return 0


def add_parsers(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate",
        help="discrete-event simulation of PEARL and the baselines at cluster scale",
        description="Simulate agentic RL rollout + training on a GPU cluster with elastic "
        "capacity from a spot trace, driving the production controller.",
    )
    sim.add_argument("--model", default="qwen3-8b", help="qwen3-8b | qwen3-30b-a3b")
    sim.add_argument("--gpu", default="h800", help="h800 | h100 | a100")
    sim.add_argument("--tp", type=number(int, 1, 64), default=2, help="GPUs per rollout worker")
    sim.add_argument(
        "--segment",
        type=int,
        choices=(1, 2, 3),
        default=None,
        help="PEARL trace segment (default 2)",
    )
    sim.add_argument("--trace", help="availability trace CSV (seconds,instances)")
    sim.add_argument(
        "--start-s", type=non_negative_float, default=0.0, help="window start in --trace"
    )
    sim.add_argument(
        "--trace-scale",
        type=number(float, 0.01, 10_000),
        default=1.0,
        help="GPUs per instance of the trace or segment: scales a spot pool to a larger "
        "cluster (42 turns PEARL's 0-12 instances into 0-504 GPUs)",
    )
    sim.add_argument(
        "--duration-s",
        type=non_negative_float,
        default=None,
        help="simulated seconds (default: the segment, 7200)",
    )
    sim.add_argument(
        "--systems",
        default=None,
        help="comma list of roll, roll-large, rlboost+, pd-only, pd+toggle, pearl, "
        "static-coloc, static-<P>P<D>D (default: roll,roll-large,rlboost+,pearl; with "
        "--sweep-static: pd-only and the sweep)",
    )
    sim.add_argument(
        "--rollout-gpus",
        type=positive_int,
        default=None,
        help="fixed dedicated rollout GPUs (with --no-elastic)",
    )
    sim.add_argument("--no-elastic", action="store_true", help="no trace: fixed resources")
    sim.add_argument("--training-gpus", type=number(int, 1, 1 << 16), default=16)
    sim.add_argument("--batch-size", type=number(int, 1, MAX_BATCH), default=None)
    sim.add_argument("--max-trajectory-tokens", type=number(int, 1, 1 << 22), default=None)
    sim.add_argument(
        "--max-staleness",
        type=number(int, 0, MAX_STALENESS),
        default=None,
        help="weight versions a batch may lag the trainer (default: the workload's, 1)",
    )
    sim.add_argument("--seed", type=non_negative_int, default=0)
    sim.add_argument(
        "--sweep-static",
        action="store_true",
        help="also run every static P:D split and colocation (fixed resources)",
    )
    sim.add_argument(
        "--workload",
        default="swe-bench",
        help="a shipped workload (configs/workloads: swe-bench, swe-bench-pearl-mix) or a "
        "workload YAML path",
    )
    sim.add_argument(
        "--router",
        choices=ROUTERS,
        default="own",
        help="turn routing: each system's own (default: shortest-queue for rlboost+, sticky "
        "for the others), or one for all: sticky (back to the worker caching the prefix) or "
        "shortest-queue (least loaded; prefixes mostly re-prefilled)",
    )
    sim.add_argument(
        "--kv-bandwidth-from",
        metavar="PROFILE",
        help="take the per-worker KV transfer bandwidth from a profile (one that "
        "`pearl-hpc calibrate --profile-out` wrote from nccl-tests); default: the GPU's "
        "data-sheet link at 50%%",
    )
    sim.add_argument("--json", action="store_true", help="print the JSON document")
    sim.add_argument(
        "--report", metavar="DIR", type=out_dir, help="write summary.md, results.json, PNG plots"
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.set_defaults(func=_cmd_simulate)

    cal = sub.add_parser(
        "calibrate-sim",
        help="compare the simulator with PEARL's published motivation measurements",
    )
    cal.add_argument("--router", choices=ROUTERS, default="own")
    cal.add_argument(
        "--workload",
        default="swe-bench",
        help="swe-bench | swe-bench-pearl-mix (calibrated to PEARL's token mix) | a YAML path",
    )
    cal.add_argument("--json", action="store_true")
    cal.set_defaults(func=_cmd_calibrate_sim)

    val = sub.add_parser(
        "validate-sim",
        help="replay a finished run in the simulator from its own inputs: the error per step",
    )
    val.add_argument("run_dir", type=existing_run_dir, help="the directory `pearl-hpc run` printed")
    val.add_argument("--json", action="store_true", help="one JSON object")
    val.set_defaults(func=_cmd_validate_sim)
