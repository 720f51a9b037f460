"""The no-op member of ``pearl-hpc launch``'s control plane: a base-job rank or an
elastic job's rank (the test fake of the plane; the run's members are
:mod:`pearl_hpc.worker.main`).

    python -m pearl_hpc.worker noop-elastic --run-dir DIR   # batch step of an elastic job
    python -m pearl_hpc.worker noop-join --run-dir DIR --group JOB+N

``noop-elastic`` starts one ``srun`` step per heterogeneous component (so ``scancel
JOB+N`` ends only that component's ranks) and forwards SIGUSR2/SIGTERM to them; each rank
runs ``noop-join``: connect to the master over MPI, then serve commands.

The workload is the documented no-op of :class:`pearl_hpc.cluster.RunConfig`: roles are
taken and acknowledged, a training step sleeps ``seconds``. Issue 5 puts the vLLM
engine and the GRPO trainer behind the same commands.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pearl_hpc.comm.messages import COLLECTIVE, Command, Kind, Op
from pearl_hpc.comm.mpi import WorkerPlane, member_info
from pearl_hpc.slurm.capacity import gpu_ids_of
from pearl_hpc.slurm.client import run_command


class NoopWorker:
    """Serves the master's commands with no engine behind them."""

    def __init__(self, plane: WorkerPlane) -> None:
        self.plane = plane
        self.roles: dict[int, str] = {}  # slot -> role this process hosts
        self.training: tuple[int, int, float] | None = None  # (seq, step, ends at)
        self.dp: Any = None  # pearl_hpc.comm.dataplane.DataPlane once used

    def serve(self, hello: dict[str, Any]) -> int:
        plane = self.plane
        plane.catch_signals()
        plane.report(Kind.HELLO, **hello)
        while True:
            cmd = plane.next_command(0.05)
            self._finish_training()
            if cmd is None:
                continue
            if self._handle(cmd):
                return 0

    def _ack(self, cmd: Command, **args: Any) -> None:
        self.plane.report(Kind.ACK, cmd.seq, op=cmd.op, **args)

    def _handle(self, cmd: Command) -> bool:
        """Carry out one command; True when the process should exit."""
        plane = self.plane
        if cmd.op in COLLECTIVE:
            seconds = plane.enter(cmd)
            args: dict[str, Any] = {"seconds": seconds}
            if cmd.op is Op.PARTITION:  # prove the role group works: count its members
                args["epoch"] = plane.epoch
                args["group_size"] = plane.role_comm.allreduce(1)
                if cmd.args.get("dataplane"):
                    args["dataplane"] = self._data_plane(plane.epoch, cmd.args["dataplane"])
            self._ack(cmd, **args)
        elif cmd.op is Op.ROLE:
            self.roles[int(cmd.args["slot"])] = str(cmd.args["role"])
            self._ack(cmd, slot=cmd.args["slot"], role=cmd.args["role"])
        elif cmd.op in (Op.DRAIN, Op.RELEASE):
            self.roles.pop(int(cmd.args["slot"]), None)
            self._ack(cmd, slot=cmd.args["slot"], partial_trajectories=0)
        elif cmd.op is Op.TRAIN:
            ends = time.monotonic() + float(cmd.args.get("seconds", 0.0))
            self.training = (cmd.seq, int(cmd.args["step"]), ends)
        elif cmd.op in (Op.LEAVE, Op.SHUTDOWN):
            if self.dp is not None and self.dp.joined:
                self.dp.leave(timeout_s=5.0)  # a dead peer must not hold the exit up
            self._ack(cmd)
            plane.disconnect()
            return True
        else:
            plane.report(Kind.ERROR, cmd.seq, message=f"unknown command {cmd.op}")
        return False

    def _data_plane(self, epoch: int, spec: dict[str, Any]) -> dict[str, Any]:
        """Rebuild this epoch's torch.distributed groups and check them: the trainer
        broadcasts a weights tensor, each prefill member sends a KV tensor to the decode
        members it is paired with. Returns what was seen, for the master's records."""
        import torch

        from pearl_hpc.comm.dataplane import DataPlane, plan_groups, select_backend

        t0 = time.perf_counter()
        if self.dp is None:
            self.dp = DataPlane()
        if self.dp.joined:
            self.dp.leave()
        plan = plan_groups(epoch, spec["roles"])
        me = self.plane.member_id
        if me not in plan.members:
            return {"member": False}
        backend = select_backend(spec["backend"])
        self.dp.join(spec["host"], spec["port"], plan, me, backend, timeout_s=60.0)
        out: dict[str, Any] = {"member": True, "join_s": time.perf_counter() - t0}
        if plan.weights_source is not None:
            weights = torch.full((1024,), float(epoch) if plan.weights_source == me else -1.0)
            self.dp.broadcast([weights])
            out["weights_ok"] = bool((weights == float(epoch)).all())
        prefill = [m for m in plan.members if plan.role_of(m) == "prefill"]
        decode = [m for m in plan.members if plan.role_of(m) == "decode"]
        if prefill and decode:  # decode member j takes its KV from prefill member j mod P
            for j, d in enumerate(decode):
                p = prefill[j % len(prefill)]
                if me == p:
                    self.dp.send(torch.full((4096,), float(epoch * 100 + j)), d)
                elif me == d:
                    kv = torch.zeros(4096)
                    self.dp.recv(kv, p)
                    out["kv_ok"] = bool((kv == float(epoch * 100 + j)).all())
        out["seconds"] = time.perf_counter() - t0
        return out

    def _finish_training(self) -> None:
        if self.training is not None and time.monotonic() >= self.training[2]:
            seq, step, _ = self.training
            self.training = None
            self.plane.report(Kind.ACK, seq, op=Op.TRAIN, step=step)


def _join(args: argparse.Namespace) -> int:
    if args.data_plane != "off":
        import torch  # noqa: F401  (loaded before joining, not inside a plan)
    plane = WorkerPlane.join(
        args.run_dir, args.group, heartbeat_interval_s=args.heartbeat_s, timeout_s=args.timeout_s
    )
    info = member_info({"group": args.group})
    info["gpu_ids"] = gpu_ids_of(
        args.group, str(info["node"]), int(info["local_id"]), args.gpus_per_worker
    )
    return NoopWorker(plane).serve(info)


def _elastic(args: argparse.Namespace) -> int:
    """The batch step of an elastic job: one srun step per component."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print(
            "pearl_hpc.worker noop-elastic: not inside a Slurm job (no SLURM_JOB_ID)",
            file=sys.stderr,
        )
        return 2
    het_size = int(os.environ.get("SLURM_HET_SIZE", "1"))
    procs = []
    for k in range(het_size):
        argv = ["srun", f"--mpi={args.mpi}"]
        if "SLURM_HET_SIZE" in os.environ:
            argv.append(f"--het-group={k}")
        argv += [
            sys.executable, "-m", "pearl_hpc.worker", "noop-join",
            "--run-dir", str(args.run_dir), "--group", f"{job}+{k}",
            "--gpus-per-worker", str(args.gpus_per_worker),
            "--heartbeat-s", str(args.heartbeat_s),
            "--data-plane", args.data_plane,
        ]  # fmt: skip
        procs.append(subprocess.Popen(argv))

    def forward(signum: int, _frame: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(signum, forward)
    while any(proc.poll() is None for proc in procs):
        if args.base_job and not _job_alive(args.base_job):
            # the master's job is gone (crashed, cancelled): nobody will release us
            print(f"base job {args.base_job} is gone; ending this elastic job", file=sys.stderr)
            forward(signal.SIGTERM, None)
            time.sleep(5)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            break
        time.sleep(BASE_CHECK_S)
    return max((proc.wait() for proc in procs), default=0)


BASE_CHECK_S = 5.0


def _job_alive(job_id: str) -> bool:
    """Is the job still in squeue? (True when squeue itself fails: never guess dead.)"""
    result = run_command(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if result.returncode != 0:
        return "Invalid job id" not in result.stderr
    return bool(result.stdout.strip())


def add_parsers(sub: Any) -> None:
    """``noop-join`` and ``noop-elastic``: the no-op members."""
    for name in ("noop-join", "noop-elastic"):
        p = sub.add_parser(name)
        p.add_argument("--run-dir", type=Path, required=True)
        p.add_argument("--gpus-per-worker", type=int, default=1)
        p.add_argument("--heartbeat-s", type=float, default=0.5)
        p.add_argument("--data-plane", default="off", help="off | auto | gloo | nccl")
        if name == "noop-join":
            p.add_argument("--group", required=True, help="JOB+N of this component")
            p.add_argument("--timeout-s", type=float, default=300.0)
        else:
            p.add_argument("--mpi", default="pmi2", help="srun --mpi plugin")
            p.add_argument("--base-job", default="", help="the master's job: end with it")
        p.set_defaults(func=_join if name == "noop-join" else _elastic)
