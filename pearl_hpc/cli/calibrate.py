"""``pearl-hpc calibrate``: cluster bandwidth from nccl-tests output or gloo."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pearl_hpc.cli.common import (
    number,
    out_file,
    positive_int,
    resolve_profile,
)


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


def add_parsers(sub: Any) -> None:
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
        "--ranks", type=positive_int, default=2, help="local gloo ranks to start (default 2)"
    )
    calib.add_argument(
        "--srun",
        action="store_true",
        help="with --gloo: this process is one srun task (SLURM_PROCID, SLURM_NTASKS, "
        "MASTER_ADDR/MASTER_PORT); rank 0 writes",
    )
    calib.add_argument(
        "--max-size-mib",
        type=number(float, 1.0),
        default=64.0,
        help="gloo: largest message, MiB (sizes 1, 4, 16, ... MiB; default 64)",
    )
    calib.add_argument(
        "--timeout-s", type=number(float, 1.0), default=120.0, help="gloo rendezvous/op timeout"
    )
    calib.add_argument("--out", required=True, type=out_file, help="bandwidth YAML to write")
    calib.add_argument("--profile", help="profile YAML or shipped name to copy with the BW")
    calib.add_argument(
        "--profile-out",
        type=out_file,
        help="where the profile copy goes (default <profile>-<out name>.yaml)",
    )
    calib.set_defaults(func=_cmd_calibrate)
