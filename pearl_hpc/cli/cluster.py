"""``pearl-hpc cluster check [NAME]``: a cluster's file against the live Slurm.

cluster local (configs/clusters/local.yaml), as sinfo reports it:
  normal (default, up): 4 nodes x 8 GPUs (untyped), 8 CPUs, 16000 MB
every job of a run on it carries: --partition=normal --time=2:00:00 ...
problems, each as FILE:LINE: key: what and the fix (exit 2)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from pearl_hpc.cli.common import EXIT_USAGE, Parser, number, out_file


def _cmd_check(args: argparse.Namespace) -> int:
    from pearl_hpc.backends.world import base_job_spec
    from pearl_hpc.config.cluster import CLUSTER_ENV, find_cluster, key_lines, read_cluster
    from pearl_hpc.config.run import RunConfig, check_cluster_defaults
    from pearl_hpc.config.slurm import container_srun_options
    from pearl_hpc.core.schema import from_mapping
    from pearl_hpc.errors import ConfigError
    from pearl_hpc.slurm.cluster import base_problems, pool_problems, read_sinfo, shape_problems
    from pearl_hpc.slurm.scripts import render_sbatch

    path = find_cluster(args.name, Path.cwd() / "cluster.yaml")
    if path is None:
        raise ConfigError(f"name a cluster (configs/clusters/NAME.yaml) or set ${CLUSTER_ENV}")
    cluster = read_cluster(path)
    check_cluster_defaults(cluster)
    groups = read_sinfo()
    if isinstance(groups, str):
        raise ConfigError(f"cluster {cluster.name}: Slurm did not answer ({groups})")
    print(f"cluster {cluster.name} ({path}), as sinfo reports it:")
    for g in groups:
        kind = g.gpu_type or "untyped"
        state = ("default, " if g.default else "") + ("up" if g.up else "NOT up")
        print(f"  {g.partition} ({state}): {g.nodes} nodes x {g.gpus} GPUs ({kind}), "
              f"{g.cpus} CPUs, {g.memory_mb} MB")  # fmt: skip
    defaults: dict[str, Any] = {"backend": "slurm", **cluster.defaults, "name": "cluster-check"}
    cfg = from_mapping(RunConfig, defaults, where=str(path))
    job = base_job_spec(cfg, Path(tempfile.gettempdir()) / "pearl-check")
    script = render_sbatch(job).splitlines()
    own = ("--job-name", "--signal", "--no-requeue", "--output")  # the run's, not the site's
    options = [
        line.removeprefix("#SBATCH ")
        for line in script
        if line.startswith("#SBATCH --") and not line.startswith(tuple(f"#SBATCH {o}" for o in own))
    ]
    print("a one-node base job of a run on it:", " ".join(options))
    image = cfg.slurm.container
    srun = " ".join([f"--mpi={cfg.slurm.mpi}", *cfg.slurm.srun_extra])
    srun += "".join(f" {o}" for o in container_srun_options(image))
    where = f" (ranks in the {image.runtime} image {image.image})" if image.runtime else ""
    print(f"its elastic steps: srun {srun}{where}")
    for line in script:
        if line.startswith("export ") or line in cfg.slurm.setup:
            print(f"  first, in every job: {line}")
    found = shape_problems(cluster, groups) + base_problems(cfg, groups, job)
    found += pool_problems(cfg, groups)
    lines = key_lines(path)
    for key, message in found:
        print(f"{path}:{_line_of(key, lines)}: {message}", file=sys.stderr)
    if not found:
        print(f"ok: {path} matches the cluster")
    return EXIT_USAGE if found else 0


def _line_of(key: str, lines: dict[str, int]) -> str:
    """The line of ``key``, or of its nearest ancestor the file has ('?': none)."""
    parts = key.split(".")
    while parts:
        if ".".join(parts) in lines:
            return str(lines[".".join(parts)])
        parts.pop()
    return "?"


def _cmd_trace(args: argparse.Namespace) -> int:
    """``pearl-hpc trace --from-sacct PARTITION``: the partition's idle GPUs over a window
    of its past, as an availability trace for ``pearl-hpc simulate --trace``."""
    import time

    from pearl_hpc.errors import ConfigError
    from pearl_hpc.slurm.history import read_history, trace_csv

    until = _when(args.until, "--until") if args.until else time.time()
    since = _when(args.since, "--since") if args.since else until - args.days * 86400
    if since >= until:
        raise ConfigError("--since is not before --until: give a window of the past")
    history = read_history(args.from_sacct, since, until)
    if isinstance(history, str):
        raise ConfigError(history)
    trace = history.trace
    out = args.out or Path(f"{args.from_sacct}-idle.csv")
    out.write_text(trace_csv(trace))
    counts = trace.counts
    print(f"{args.from_sacct}: {history.nodes} nodes, {history.gpus} GPUs; {history.jobs} "
          f"jobs held them over {_span(trace.duration_s)} ({history.source})")  # fmt: skip
    print(f"idle GPUs: mean {trace.mean():.1f}, min {min(counts)}, max {max(counts)}, "
          f"{trace.changes_per_hour:.1f} changes/h")  # fmt: skip
    print(f"wrote {out}: pearl-hpc simulate --trace {out}")
    return 0


def _span(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds:.0f} s"
    return f"{seconds / 3600:.1f} h" if seconds < 2 * 86400 else f"{seconds / 86400:.1f} days"


def _when(text: str, flag: str) -> float:
    """A time as sacct takes one (2026-12-01T08:00[:00], local time) in epoch seconds."""
    from datetime import datetime

    from pearl_hpc.errors import ConfigError

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: a time such as 2026-12-01T08:00") from None


def add_parsers(sub: Any) -> None:
    trace_p = sub.add_parser(
        "trace",
        help="a partition's idle GPUs over its past (sacct), as an availability trace for "
        "pearl-hpc simulate --trace",
    )
    trace_p.add_argument(
        "--from-sacct", metavar="PARTITION", required=True,
        help="the (preemptible) partition whose nodes' idle GPUs make the trace",
    )  # fmt: skip
    trace_p.add_argument(
        "--days", type=number(float, 1e-6, 3650), default=7.0, help="the window: the last N days"
    )
    trace_p.add_argument("--since", help="or from this time (2026-12-01T08:00, local)")
    trace_p.add_argument("--until", help="to this time (default: now)")
    trace_p.add_argument("--out", type=out_file, help="the trace CSV (default: PARTITION-idle.csv)")
    trace_p.set_defaults(func=_cmd_trace)
    cluster_p = sub.add_parser("cluster", help="a cluster's config file, against the live Slurm")
    verbs = cluster_p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    check_p = verbs.add_parser(
        "check",
        help="check a cluster's file against sinfo (partitions, GPUs and their type, CPUs, "
        "memory) and print what a run on it gets",
    )
    check_p.add_argument(
        "name",
        nargs="?",
        default="",
        help="a cluster (configs/clusters/NAME.yaml or one in $PEARL_CLUSTER_CONFIG) or a "
        "file; default: $PEARL_CLUSTER_CONFIG",
    )
    check_p.set_defaults(func=_cmd_check)
