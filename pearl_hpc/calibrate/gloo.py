"""The gloo fallback (local processes or srun tasks), the ``calibrate`` run and its
printing: the edges."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from pearl_hpc.calibrate.files import (
    BandwidthRow,
    ClusterBandwidth,
    TestSummary,
    bandwidth_row,
    check_out_path,
    cluster_from_nccl,
    cluster_yaml_text,
    default_profile_out,
    iso_time,
    profile_mapping,
    profile_with_transfer,
    read_nccl_dir,
    summarise,
    write_text,
)
from pearl_hpc.calibrate.nccl import FIELD_OF_TEST, GB, MiB
from pearl_hpc.config.files import read_user_text
from pearl_hpc.errors import CalibrationError, ConfigError
from pearl_hpc.slurm.parse import expand_hostlist

# --------------------------------------------------------------------------- gloo
GLOO_TESTS = ("sendrecv", "broadcast", "all_reduce")
# Iterations per size: enough to move ~this many bytes, within [3, 20].
_GLOO_BYTES_PER_SIZE = 64 * MiB
_GLOO_ITERS = (3, 20)


def gloo_sizes(max_size_bytes: int, *, min_size_bytes: int = MiB, factor: int = 4) -> list[int]:
    """min, min*factor, ... up to max (inclusive if it falls on the grid)."""
    if not 0 < min_size_bytes <= max_size_bytes:
        raise ConfigError(
            f"sizes: need 0 < min ({min_size_bytes} B) <= max ({max_size_bytes} B); "
            "raise --max-size-mib"
        )
    sizes = [min_size_bytes]
    while sizes[-1] * factor <= max_size_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def gloo_iterations(size_bytes: int) -> int:
    low, high = _GLOO_ITERS
    return max(low, min(high, math.ceil(_GLOO_BYTES_PER_SIZE / size_bytes)))


def run_gloo_rank(
    rank: int,
    world_size: int,
    init_method: str,
    sizes_bytes: Sequence[int],
    tests: Sequence[str] = GLOO_TESTS,
    timeout_s: float = 120.0,
) -> list[TestSummary]:
    """Join a gloo group and time ``tests`` at ``sizes_bytes``; every rank returns the
    same summaries (each time is the max over ranks, so the slowest rank sets it).

    sendrecv: each rank sends to rank+1 and receives from rank-1 at once (nccl-tests'
    pattern); broadcast from rank 0; all_reduce (sum, float32). One warm-up, a barrier,
    then :func:`gloo_iterations` operations timed together."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    if world_size < 2:
        raise CalibrationError(f"gloo calibration needs >= 2 ranks, got {world_size}")
    unknown = [t for t in tests if t not in GLOO_TESTS]
    if unknown:
        raise ConfigError(f"gloo tests {unknown}: not one of {', '.join(GLOO_TESTS)}")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=dt.timedelta(seconds=timeout_s),
    )
    try:
        summaries = []
        for test in tests:
            rows = []
            for size in sizes_bytes:
                send = torch.ones(size // 4, dtype=torch.float32)
                recv = torch.empty_like(send)
                iters = gloo_iterations(size)
                _gloo_op(dist, test, send, recv, rank, world_size)  # warm-up
                dist.barrier()
                started = time.perf_counter()
                for _ in range(iters):
                    _gloo_op(dist, test, send, recv, rank, world_size)
                elapsed = torch.tensor(
                    [(time.perf_counter() - started) / iters], dtype=torch.float64
                )
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                rows.append(bandwidth_row(test, send.numel() * 4, float(elapsed), world_size))
            summaries.append(summarise(test, world_size, rows))
        return summaries
    finally:
        dist.destroy_process_group()


def _gloo_op(dist: Any, test: str, send: Any, recv: Any, rank: int, world_size: int) -> None:
    if test == "sendrecv":
        reqs = [
            dist.isend(send, (rank + 1) % world_size),
            dist.irecv(recv, (rank - 1) % world_size),
        ]
        for req in reqs:
            req.wait()
    elif test == "broadcast":
        dist.broadcast(send, src=0)
    else:
        dist.all_reduce(send)


def cluster_from_gloo(
    summaries: Sequence[TestSummary],
    *,
    num_ranks: int,
    num_nodes: int | None,
    measured_at: datetime,
) -> ClusterBandwidth:
    return ClusterBandwidth(
        source="gloo",
        measured_at=iso_time(measured_at),
        num_ranks=num_ranks,
        num_nodes=num_nodes,
        gpu=None,
        tests=tuple(summaries),
    )


def measure_gloo_local(
    num_ranks: int,
    sizes_bytes: Sequence[int],
    tests: Sequence[str] = GLOO_TESTS,
    *,
    timeout_s: float = 120.0,
) -> list[TestSummary]:
    """Start ``num_ranks`` local processes (``python -m pearl_hpc.calibrate``) that meet
    through a file store and measure over loopback; returns rank 0's summaries."""
    if num_ranks < 2:
        raise ConfigError(f"--ranks must be >= 2 for a gloo measurement, got {num_ranks}")
    with tempfile.TemporaryDirectory(prefix="pearl-gloo-") as tmp:
        result = Path(tmp) / "rank0.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
            env["GLOO_SOCKET_IFNAME"] = "lo"  # stay on loopback, whatever the hostname is
        procs = []
        for rank in range(num_ranks):
            argv = [
                *(sys.executable, "-m", "pearl_hpc.calibrate"),
                *("--rank", str(rank), "--world-size", str(num_ranks)),
                *("--init-method", f"file://{tmp}/store"),
                *("--sizes", ",".join(map(str, sizes_bytes)), "--tests", ",".join(tests)),
                *("--timeout-s", str(timeout_s)),
                *(("--result", str(result)) if rank == 0 else ()),
            ]
            log = open(Path(tmp) / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
            procs.append(
                (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log)
            )
        _wait_all(procs, timeout_s + 30)
        return _read_rank_result(result)


def _wait_all(procs: list[tuple[subprocess.Popen[bytes], Any]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    try:
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} timed out after {timeout_s:.0f} s")
                break
            if code != 0:
                log.seek(0)
                tail = " | ".join(log.read().strip().splitlines()[-3:])
                failed.append(f"rank {rank} exited with {code}: {tail}")
                break
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        raise CalibrationError(f"gloo measurement failed: {failed[0]}")


def _read_rank_result(path: Path) -> list[TestSummary]:
    doc = json.loads(path.read_text())
    return [
        TestSummary(**{**s, "rows": tuple(BandwidthRow(**r) for r in s["rows"])})
        for s in doc["summaries"]
    ]


def srun_rendezvous(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(rank, world size, init method) for a process started by ``srun``: SLURM_PROCID,
    SLURM_NTASKS and tcp://MASTER_ADDR:MASTER_PORT, where MASTER_ADDR defaults to the
    first host of the step and MASTER_PORT to 20000 + SLURM_JOB_ID % 10000."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS") if k not in env]
    if missing:
        raise ConfigError(
            f"--srun: {' and '.join(missing)} not set; start this command with srun "
            "(srun -n N pearl-hpc calibrate --gloo --srun ...)"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    addr = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else None)
    if not addr:
        raise ConfigError("--srun: set MASTER_ADDR (no SLURM_STEP_NODELIST to take it from)")
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
    return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), f"tcp://{addr}:{port}"


def _rank_main(argv: Sequence[str] | None = None) -> int:
    """One local gloo rank (started by :func:`measure_gloo_local`)."""
    parser = argparse.ArgumentParser(prog="python -m pearl_hpc.calibrate")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--sizes", required=True, help="comma list of bytes")
    parser.add_argument("--tests", default=",".join(GLOO_TESTS))
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--result", help="rank 0 writes its summaries here (JSON)")
    args = parser.parse_args(argv)
    summaries = run_gloo_rank(
        args.rank,
        args.world_size,
        args.init_method,
        [int(s) for s in args.sizes.split(",")],
        args.tests.split(","),
        args.timeout_s,
    )
    if args.result:
        doc = {"summaries": [{**asdict(s)} for s in summaries]}
        write_text(args.result, json.dumps(doc))
    return 0


# --------------------------------------------------------------------------- command
def run_calibration(
    *,
    out: Path,
    nccl_dir: Path | None = None,
    gloo_ranks: int = 2,
    srun: bool = False,
    max_size_bytes: int = 64 * MiB,
    timeout_s: float = 120.0,
    profile: Path | None = None,
    profile_out: Path | None = None,
    now: datetime,
    env: Mapping[str, str],
) -> int:
    """``pearl-hpc calibrate``: measure (nccl-tests files or gloo), write the cluster
    YAML and, with ``profile``, a copy of it with the measured ``transfer_bytes_per_s``.
    The profile is checked before anything is measured."""
    check_out_path(out)
    target = None if profile is None else (profile_out or default_profile_out(profile, out))
    if profile is not None and target is not None and target.resolve() == profile.resolve():
        raise ConfigError(f"--profile-out {target}: is the profile itself; give another path")
    profile_text = None
    if profile is not None:
        profile_text = read_user_text(profile, "--profile")
        profile_mapping(profile_text, str(profile))
    if nccl_dir is not None:
        cluster = cluster_from_nccl(read_nccl_dir(nccl_dir), measured_at=now)
        command = f"pearl-hpc calibrate --nccl-dir {nccl_dir}"
    else:
        sizes = gloo_sizes(max_size_bytes)
        command = f"pearl-hpc calibrate --gloo --max-size-mib {max_size_bytes / MiB:g}"
        if srun:
            rank, world, init_method = srun_rendezvous(env)
            summaries = run_gloo_rank(rank, world, init_method, sizes, timeout_s=timeout_s)
            if rank != 0:
                return 0  # rank 0 writes and prints
            nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
            command = f"srun -n {world} {command} --srun"
        else:
            summaries = measure_gloo_local(gloo_ranks, sizes, timeout_s=timeout_s)
            world, nodes = gloo_ranks, 1
            command += f" --ranks {gloo_ranks}"
        cluster = cluster_from_gloo(summaries, num_ranks=world, num_nodes=nodes, measured_at=now)
    command += f" --out {out}"
    written = [write_text(out, cluster_yaml_text(cluster, command=command))]
    if target is not None and profile is not None and profile_text is not None:
        p2p = cluster.p2p_bytes_per_s
        if p2p is None:
            raise CalibrationError(
                f"--profile needs a sendrecv measurement for transfer_bytes_per_s; {out} has "
                f"only {', '.join(s.test for s in cluster.tests)}: add sendrecv_perf"
            )
        note = (
            f"BW: {cluster.source} sendrecv, {cluster.num_ranks} ranks, "
            f"{cluster.measured_at[:10]} ({out.name})"
        )
        header = f"# Copy of {profile.name}; transfer_bytes_per_s measured by: {command}\n"
        text = profile_with_transfer(profile_text, p2p, note=note, where=str(profile))
        written.append(write_text(target, header + text))
    print_cluster(cluster, written)
    return 0


# --------------------------------------------------------------------------- output
def format_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"


def print_cluster(cluster: ClusterBandwidth, written: Iterable[Path]) -> None:
    """A rich table of every row, then the figures the YAML holds."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    nodes = cluster.num_nodes
    where = f" on {nodes} node{'s' if nodes != 1 else ''}" if nodes else ""
    table = Table(title=f"{cluster.source}: {cluster.num_ranks} ranks{where}")
    for col in ("test", "size", "time us", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for summary in cluster.tests:
        for row in summary.rows:
            peak = "*" if row.size_bytes == summary.peak_size_bytes else ""
            table.add_row(
                summary.test,
                format_size(row.size_bytes),
                f"{row.time_us:.1f}",
                f"{row.algbw_bytes_per_s / GB:.3f}",
                f"{row.busbw_bytes_per_s / GB:.3f}{peak}",
            )
    console.print(table)
    for test, field in FIELD_OF_TEST.items():
        value = cluster.peak(test)
        shown = "not measured" if value is None else f"{value:.4e} ({value / GB:.3f} GB/s)"
        console.print(f"{field}: {shown}")
    for path in written:
        console.print(f"wrote {path}")
