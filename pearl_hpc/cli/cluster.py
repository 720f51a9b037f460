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

from pearl_hpc.cli.common import EXIT_USAGE, Parser


def _cmd_check(args: argparse.Namespace) -> int:
    from pearl_hpc.backends.world import base_job_spec
    from pearl_hpc.config.cluster import CLUSTER_ENV, find_cluster, key_lines, read_cluster
    from pearl_hpc.config.run import RunConfig, check_cluster_defaults
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
    srun = " ".join([f"--mpi={cfg.slurm.mpi}", *cfg.slurm.srun_extra])
    print(f"its elastic steps: srun {srun}")
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


def add_parsers(sub: Any) -> None:
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
