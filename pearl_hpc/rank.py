"""The entry of every process of a run's MPI world.

    mpiexec -n 1 python -m pearl_hpc.rank rank --run-dir RUN_DIR --model-dir M [--resume]
    mpiexec -n T python -m pearl_hpc.rank trainers --run-dir RUN_DIR --model-dir M --attempt 0
    mpiexec -n 1 python -m pearl_hpc.rank engine --run-dir RUN_DIR --model-dir M --rank R
    srun --mpi=pmi2 python -m pearl_hpc.rank join --run-dir RUN_DIR --model-dir M --group JOB+K
    mpiexec -n 1 python -m pearl_hpc.rank join ... --group elJ+K --gpu-ids elJ+K:gpu0   (local)

Every rank reads ``RUN_DIR/config.yaml`` and finds what it runs by its rank in the base
layout (:func:`pearl_hpc.comm.layout.base_layout`). The world (``rank``) is the master
alone (its loop: :mod:`pearl_hpc.master.loop`, with the backend
:func:`pearl_hpc.backends.backend_factory` names). The trainer ranks (``trainers``,
:mod:`pearl_hpc.worker.trainer`; their launch's world is their communicator) and each
base engine rank (``engine``, :mod:`pearl_hpc.worker.engine`) are launches of their own,
failure domains apart (:mod:`pearl_hpc.backends.domains`), that join the master like an
elastic component (``join``). This module is the top of the house: it may import every
layer, and none imports it. mpi4py is imported before torch or vLLM; the master starts
its doorman (:mod:`pearl_hpc.comm.doorman`) before either.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pearl_hpc.comm.mpiexec import die_with_parent
from pearl_hpc.rundir import RunDir, RunDirBusy, private_files

if TYPE_CHECKING:
    from pearl_hpc.config.run import RunConfig

STARTED_S = time.monotonic()  # this process's start, for the world's start latency


def _rank(args: argparse.Namespace) -> int:
    """The base world: the master alone (the trainer ranks and each engine rank are
    launches of their own that join it: :mod:`pearl_hpc.backends.domains`)."""
    doorman = _doorman(args.run_dir)  # before MPI_Init: it forks
    from mpi4py import MPI

    from pearl_hpc.comm.layout import base_layout, world_of
    from pearl_hpc.comm.mpi import MasterPlane
    from pearl_hpc.engine.rpc import read_key
    from pearl_hpc.errors import ConfigError
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.worker.placement import place_rank

    run_dir: Path = args.run_dir
    run = RunDir(run_dir)
    cfg = load_run_config(run.config)
    ranks = world_of(base_layout(cfg.workers, cfg.layout))
    world = MPI.COMM_WORLD
    if world.Get_size() != len(ranks):
        if world.Get_rank() == 0:
            print(
                f"pearl_hpc.rank: the world has {world.Get_size()} ranks, the run's layout "
                f"{len(ranks)}; start it with `pearl-hpc run`",
                file=sys.stderr,
            )
        return 2
    try:
        place_rank(ranks[0], cfg)
    except ConfigError as exc:
        print(f"pearl_hpc.rank: the master: {exc}", file=sys.stderr, flush=True)
        return 2
    _compute_threads(1)
    # Slurm's --signal without B: (submitit's USR2 before a time-out) reaches every process
    # of the job step: the job's own handler acts on it, the ranks carry on
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    key = read_key(run.rpc_key)
    plane = MasterPlane(run_dir, key, doorman=doorman)
    try:
        return _master(cfg, run_dir, plane, args, key, world)
    finally:
        if doorman is not None:
            doorman.close()


def _trainers(args: argparse.Namespace) -> int:
    """The trainer ranks: one launch of their own (started again from the newest
    checkpoint when one of them dies: :mod:`pearl_hpc.backends.domains`), its world their
    communicator, joined to the master together as group ``trainers-A``. A first launch
    that fails before it joined records the run's failure (a relaunch would fail too).
    A trainer that ends cleanly left at the run's end (``GROUP.left``)."""
    from mpi4py import MPI

    from pearl_hpc.backends.world import multi_node
    from pearl_hpc.comm.layout import TRAINERS, base_layout, cpu_threads, domain_group, trainers_of
    from pearl_hpc.comm.mpi import WorkerPlane, member_info
    from pearl_hpc.engine.rpc import read_key
    from pearl_hpc.errors import ConfigError
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.worker.placement import place_rank

    run = RunDir(args.run_dir)
    cfg = load_run_config(run.config)
    layout = base_layout(cfg.workers, cfg.layout)
    ranks, comm = trainers_of(layout), MPI.COMM_WORLD
    if comm.Get_size() != len(ranks):
        print(f"pearl_hpc.rank: {comm.Get_size()} trainer ranks, the layout's {len(ranks)}",
              file=sys.stderr)  # fmt: skip
        return 2
    me, first = ranks[comm.Get_rank()], args.attempt == 0
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the launcher's to pass to the master
    try:
        placement = place_rank(me, cfg)
        host = _bind_host(cfg)
    except ConfigError as exc:  # one line on the launcher's output
        print(f"pearl_hpc.rank: rank {me.rank}: {exc}", file=sys.stderr, flush=True)
        if first:
            run.record_failure(me.rank, me.kind, _error_line(exc), joined=False)
        comm.Abort(2)
        return 2
    cpus = len(os.sched_getaffinity(0))  # (a srun step's task: what Slurm bound it to)
    share = min(cpus, cfg.layout.cpus_per_rank) if multi_node(cfg) else None
    _compute_threads(share or cpu_threads(layout, me.rank, cpus))
    _log_to(run.rank_log(me.rank, me.kind))
    group = domain_group(TRAINERS, args.attempt)
    planes: list[WorkerPlane] = []
    try:
        from pearl_hpc.worker.trainer import TrainerRank

        key = read_key(run.rpc_key)
        hello = member_info(me.kind, gpu_ids=me.gpu_ids, rank=me.rank, group=group)
        if not first:  # an overlap engine may still hold this GPU: the master takes it back
            _wait_while(run.trainer_gpus_lent, f"trainer rank {me.rank}")
        trainer = TrainerRank(
            comm, cfg, me, run.path, args.model_dir, key, host, args.resume,
            device=placement.device,
        )  # fmt: skip
        planes.append(WorkerPlane.join(run.path, group, key, timeout_s=600.0))
        code = trainer.serve(planes[-1], hello)
        if code == 0 and comm.Get_rank() == 0:
            run.domain_note(group, "left").touch()
        return code
    except BaseException as exc:  # its launch ends: the other ranks with it
        if isinstance(exc, KeyboardInterrupt):
            return 130
        traceback.print_exc()
        if first and not (planes and planes[-1].joined):
            run.record_failure(me.rank, me.kind, _error_line(exc), joined=False)
        sys.stderr.flush()
        comm.Abort(1)
        return 1


def _wait_while(mark: Path, who: str, every_s: float = 0.2) -> float:
    """Wait while ``mark`` exists (a trainer relaunched after a loss: while an overlap
    engine holds its GPU, which would run out of memory as the model loads); the seconds
    waited. No bound: the master returns borrowed GPUs at the loss (drains within the
    stop deadline), and a master that dies ends this world."""
    t0 = time.monotonic()
    said = t0
    while mark.exists():
        if time.monotonic() - said >= 30.0:
            print(f"{who}: still waiting for the master to take its GPU back ({mark})",
                  file=sys.stderr, flush=True)  # fmt: skip
            said = time.monotonic()
        time.sleep(every_s)
    waited = time.monotonic() - t0
    if waited > every_s:
        print(f"{who}: waited {waited:.2f} s for its GPU to come back from an overlap engine",
              file=sys.stderr, flush=True)  # fmt: skip
    return waited


def _bind_host(cfg: RunConfig) -> str:
    """The address this rank's sockets bind (engine RPC, the weight store, NIXL's side
    channel): loopback on the local backend; on Slurm ``slurm.engine_interface``'s, which
    other nodes must reach where the run spans them (several nodes, or elastic pools)."""
    from pearl_hpc.backends.world import multi_node
    from pearl_hpc.comm.net import bind_address

    if cfg.backend == "local":
        return "127.0.0.1"
    spans = multi_node(cfg) or bool(cfg.elastic.pools and cfg.elastic.max_workers)
    return bind_address(cfg.slurm.engine_interface, reachable=spans)


def _compute_threads(threads: int) -> None:
    """This rank's torch (OpenMP) threads: a trainer its share of the node's CPUs
    (``layout.cpus_per_rank`` in a world over several nodes), a master or engine rank one
    (its work is its loop, or its engine server's, whose process picks its own); left
    alone, OpenMP gives every rank all the node's CPUs."""
    import torch

    torch.set_num_threads(threads)


def _error_line(exc: BaseException) -> str:
    """An exception as the one line a failure record keeps."""
    return (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0][:500]


def _engine(args: argparse.Namespace) -> int:
    """A base engine rank: a launch of its own (started again by the launcher when it
    dies: :mod:`pearl_hpc.backends.domains`), joined to the master like an elastic rank
    (group ``rankR-A``), served until the master's LEAVE at the run's end. A first
    launch that fails before it joined records the run's failure (nothing relaunched
    would start either)."""
    from mpi4py import MPI  # noqa: F401  (MPI before torch and vLLM)

    from pearl_hpc.comm.layout import ENGINE, base_layout, domain_group, domain_name
    from pearl_hpc.comm.mpi import WorkerPlane, member_info
    from pearl_hpc.engine.rpc import read_key
    from pearl_hpc.engine.spec import check_kv_transfer, check_vllm, engine_spec
    from pearl_hpc.errors import ConfigError
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.worker.engine import engine_rank_id, serve_engine
    from pearl_hpc.worker.placement import place_rank

    run = RunDir(args.run_dir)
    cfg = load_run_config(run.config)
    me = next((r for r in base_layout(cfg.workers, cfg.layout) if r.rank == args.rank), None)
    if me is None or me.kind != ENGINE:
        print(f"pearl_hpc.rank: rank {args.rank} is no engine rank of the run", file=sys.stderr)
        return 2
    first = args.attempt == 0
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the launcher's to pass to the master
    try:
        placement = place_rank(me, cfg)
        check_vllm()
        check_kv_transfer(cfg)
        host = _bind_host(cfg)
    except ConfigError as exc:  # one line on the launcher's output
        print(f"pearl_hpc.rank: rank {me.rank}: {exc}", file=sys.stderr, flush=True)
        if first:
            run.record_failure(me.rank, me.kind, _error_line(exc), joined=False)
        return 2
    _log_to(run.rank_log(me.rank, me.kind))
    _compute_threads(1)
    planes: list[WorkerPlane] = []
    try:
        group = domain_group(domain_name(me), args.attempt)
        hello = member_info(me.kind, gpu_ids=me.gpu_ids, rank=me.rank, group=group)
        key = read_key(run.rpc_key)
        spec = engine_spec(cfg, args.model_dir, device=placement.device, gpus=len(me.devices),
                           host=host, overlap=me.overlap)  # fmt: skip

        def connect() -> WorkerPlane:
            planes.append(WorkerPlane.join(run.path, group, key, timeout_s=600.0))
            return planes[-1]

        worker_id = engine_rank_id(me)
        ready = run.engine_ready(worker_id)
        return serve_engine(
            connect, spec, worker_id, ready, key, hello, host,
            left_mark=lambda group: run.domain_note(group, "left"),
        )  # fmt: skip
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            return 130
        traceback.print_exc()
        if first and not (planes and planes[-1].joined):
            run.record_failure(me.rank, me.kind, _error_line(exc), joined=False)
        return 1


def _doorman(run_dir: Path) -> Any:
    """Rank 0 (the master): its doorman, started before MPI_Init (see
    :mod:`pearl_hpc.comm.doorman`); None on every other rank."""
    if os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return None
    from pearl_hpc.comm.doorman import Doorman
    from pearl_hpc.comm.mpiexec import gforker_path

    return Doorman(RunDir(run_dir).mpi_port, gforker_path())


def _join(args: argparse.Namespace) -> int:
    """An elastic rank (a hetjob component's ``srun`` step, or a local ``mpiexec -n 1``):
    its engine socket up, then Connect + Merge with the master, then served like a base
    engine rank until the master's LEAVE."""
    from mpi4py import MPI  # noqa: F401  (MPI before torch and vLLM)

    from pearl_hpc.backends.lease import lease_watcher
    from pearl_hpc.comm.layout import ENGINE
    from pearl_hpc.comm.mpi import WorkerPlane, member_info
    from pearl_hpc.engine.rpc import read_key
    from pearl_hpc.engine.spec import check_kv_transfer, check_vllm, engine_spec
    from pearl_hpc.errors import ConfigError
    from pearl_hpc.master.preflight import load_run_config
    from pearl_hpc.slurm.capacity import gpu_ids_of
    from pearl_hpc.worker.engine import serve_engine
    from pearl_hpc.worker.placement import cuda_works, gpus_seen, place, usable

    run_dir: Path = args.run_dir
    run = RunDir(run_dir)
    cfg = load_run_config(run.config)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the job's batch step tells the master
    where = member_info(ENGINE, group=args.group)
    if args.gpu_ids:  # named by the local backend
        gpu_ids = tuple(args.gpu_ids.split(","))
    else:  # a job component's: its node's GPUs, split by local id
        gpu_ids = tuple(gpu_ids_of(args.group, where.node, where.local_id, args.gpus))
    info = msgspec.structs.replace(where, gpu_ids=gpu_ids)
    if args.devices:  # the local backend's: the node's GPUs it chose for this rank
        devices: Sequence[int] = [int(d) for d in args.devices.split(",")]
    else:  # a job component's step: its GPUs, this rank's share of them
        devices = range(info.local_id * args.gpus, (info.local_id + 1) * args.gpus)
    try:  # (Slurm's CUDA_VISIBLE_DEVICES, or the node's)
        check_vllm()
        placement = place(
            devices,
            gpus_seen(os.environ),
            cfg.engine.device,
            key="engine.device",
            who=f"elastic rank {args.group}",
        )
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.visible
        placement = usable(placement, cfg.engine.device, "engine.device", cuda_works)
        check_kv_transfer(cfg)
        host = _bind_host(cfg)
    except ConfigError as exc:
        print(f"pearl_hpc.rank: {exc}", file=sys.stderr, flush=True)
        return 2
    _compute_threads(1)

    def connect() -> WorkerPlane:
        key = read_key(run.rpc_key)
        return WorkerPlane.join(run_dir, args.group, key, heartbeat_interval_s=1.0, timeout_s=600.0)

    spec = engine_spec(
        cfg, args.model_dir, device=placement.device, gpus=placement.num_gpus, host=host
    )
    worker_id = f"{args.group}-" + "-".join(info.gpu_ids)
    return serve_engine(
        connect,
        spec,
        worker_id,
        run.engine_ready(worker_id, elastic=True),
        read_key(run.rpc_key),
        info,
        host,
        lease_watcher(run.lease, cfg.slurm.lease_timeout_s),
    )


def _log_to(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _periodic(every_s: float) -> Any:
    """The rollout line every ``every_s`` s in a log (None: 0, off)."""
    from pearl_hpc.cli.live import PeriodicLine

    return PeriodicLine(every_s) if every_s > 0 else None


def _master(
    cfg: Any, run_dir: Path, plane: Any, args: argparse.Namespace, key: str, world: Any
) -> int:
    """Rank 0: the run, its step lines and summary; a failure ends the whole world."""
    import asyncio

    from pearl_hpc.backends import backend_factory
    from pearl_hpc.errors import ConfigError
    from pearl_hpc.master.loop import run_master
    from pearl_hpc.master.records import format_step, format_summary

    try:
        lock = RunDir(run_dir).lock()  # held until this process ends
    except RunDirBusy as exc:
        print(f"pearl-hpc run: {exc}", file=sys.stderr, flush=True)
        world.Abort(2)
        return 2
    live = None
    if args.live:
        from pearl_hpc.cli.live import LiveRollout

        live = LiveRollout()
    progress = live or _periodic(cfg.run.log_every_s)
    try:
        summary = asyncio.run(
            run_master(
                cfg,
                run_dir,
                plane,
                backend_factory(cfg.backend),
                model_dir=args.model_dir,
                key=key,
                resume=args.resume,
                on_step=lambda m: print(format_step(m), flush=True),
                on_progress=progress.update if progress is not None else None,
                started_s=STARTED_S,
                say=lambda line: print(line, flush=True),
            )
        )
    except BaseException as exc:
        if live is not None:
            live.stop()
        if isinstance(exc, KeyboardInterrupt):
            print("pearl-hpc run: interrupted", file=sys.stderr, flush=True)
        elif isinstance(exc, ConfigError):  # the run's input: one line, not restarted
            print(f"pearl-hpc run: error: {exc}", file=sys.stderr, flush=True)
            RunDir(run_dir).record_failure(0, "master", str(exc)[:500], joined=False)
        else:
            traceback.print_exc()
            RunDir(run_dir).record_failure(0, "master", _error_line(exc), joined=True)
        print(
            f"pearl-hpc run: failed; resume with: pearl-hpc run --resume {run_dir}",
            file=sys.stderr,
            flush=True,
        )
        sys.stderr.flush()
        world.Abort(1)  # every rank ends with the master (the journal stays)
        return 1
    if live is not None:
        live.stop()
    if summary.get("stopped"):
        print(
            f"pearl-hpc run: stopped (pearl-hpc cancel) before step {summary['next_step']}, "
            f"a checkpoint written; continue it: pearl-hpc run --resume {run_dir}",
            flush=True,
        )
        lock.close()
        return 0
    print(format_summary(summary), flush=True)
    lock.close()
    print(f"status: pearl-hpc status {run_dir}; plots: pearl-hpc report {run_dir}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pearl_hpc.rank", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rank = sub.add_parser("rank", help="a process of a run's world (pearl-hpc run starts them)")
    rank.add_argument("--run-dir", type=Path, required=True)
    rank.add_argument("--model-dir", required=True)
    rank.add_argument("--resume", action="store_true")
    rank.add_argument("--live", action="store_true", help="rank 0: a live line (a terminal)")
    rank.set_defaults(func=_rank)
    trainers = sub.add_parser("trainers", help="the trainer ranks (pearl-hpc run starts them)")
    trainers.add_argument("--run-dir", type=Path, required=True)
    trainers.add_argument("--model-dir", required=True)
    trainers.add_argument("--attempt", type=int, default=0, help="their launch: 0 the first")
    trainers.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    trainers.set_defaults(func=_trainers)
    engine = sub.add_parser("engine", help="a base engine rank (pearl-hpc run starts them)")
    engine.add_argument("--run-dir", type=Path, required=True)
    engine.add_argument("--model-dir", required=True)
    engine.add_argument("--rank", type=int, required=True, help="its rank in the base layout")
    engine.add_argument("--attempt", type=int, default=0, help="its launch: 0 the first")
    engine.set_defaults(func=_engine)
    join = sub.add_parser("join", help="a rank of an elastic job: joins the run's world")
    join.add_argument("--run-dir", type=Path, required=True)
    join.add_argument("--model-dir", required=True)
    join.add_argument("--group", required=True, help="JOB+K: this rank's job component")
    join.add_argument("--gpu-ids", help="comma-separated: its GPUs' names (else from Slurm's)")
    join.add_argument("--gpus", type=int, default=1, help="GPUs of its worker (from Slurm's)")
    join.add_argument("--devices", help="comma-separated: the node's GPU numbers it runs on")
    join.set_defaults(func=_join)
    args = parser.parse_args(argv)
    private_files()
    die_with_parent()  # a rank whose launcher was killed outright does not live on
    logging.basicConfig(level=os.environ.get("PEARL_LOG_LEVEL", "WARNING"))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
