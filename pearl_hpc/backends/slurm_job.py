"""The batch step of an elastic job (Slurm backend), run by ``sbatch`` on the job's
first node:

    python -m pearl_hpc.backends.slurm_job --run-dir DIR --model M ...

It starts one engine rank per heterogeneous component, each in its own
``srun --mpi=MPI --het-group=K`` step (MPI: ``slurm.mpi``; ``scancel JOB+K`` ends only
that component):
``python -m pearl_hpc.rank join`` Connects to the master and Merges into the run's
world. It writes the job's preemption signal for the master (``elastic/JOB.signal``).

    master SIGKILLed ──> its ranks wait ──> a resumed master takes the lease ──> the old
    ranks end, the steps start again and join it (the master adopts the job by tag)
    no master for slurm.lease_timeout_s (a stale lease) ──> every step ends, the job too
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.backends.lease import lease_owner, lease_watcher
from pearl_hpc.rundir import RunDir, private_files


def _launch(args: argparse.Namespace) -> int:
    """The batch step of an elastic job: one engine rank per component, each in its own
    ``srun --het-group=K`` step; the job's signal is written for the master. A step whose
    master died ends itself once a resumed master takes the lease: it is started again
    and joins that master (the job is adopted, not resubmitted). Every step ends when the
    lease goes stale."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print(
            "pearl_hpc.backends.slurm_job: not inside a Slurm job (no SLURM_JOB_ID)",
            file=sys.stderr,
        )
        return 2
    het = "SLURM_HET_SIZE" in os.environ
    size = int(os.environ.get("SLURM_HET_SIZE", "1"))
    gpus = [int(g) for g in args.gpus.split(",")]  # per component: its worker's GPUs
    if len(gpus) != size:
        print(f"pearl_hpc.backends.slurm_job: --gpus names {len(gpus)} components, the "
              f"job has {size}", file=sys.stderr)  # fmt: skip
        return 2
    edir = RunDir(args.run_dir).elastic
    lease = RunDir(args.run_dir).lease
    steps: list[_Step] = []

    def start(k: int) -> _Step:
        # PMI from srun: the rank is an MPI process of its own, Connecting to the
        # master's port (a base world of gforker or srun accepts it: verified here)
        argv = ["srun", "-n1", f"--mpi={args.mpi}", *args.srun_option]
        argv += [f"--het-group={k}"] if het else []
        argv += [
            *(args.rank_command or [sys.executable]), "-m", "pearl_hpc.rank", "join",
            "--run-dir", str(args.run_dir), "--model-dir", args.model, "--group", f"{job}+{k}",
            "--gpus", str(gpus[k]),
        ]  # fmt: skip
        return _Step(k, subprocess.Popen(argv), lease_owner(lease))

    def on_signal(signum: int, _frame: Any) -> None:
        note = {"signal": signal.Signals(signum).name, "time": time.time()}
        tmp = edir / f"{job}.signal.tmp"
        tmp.write_text(json.dumps(note))
        tmp.rename(edir / f"{job}.signal")  # the master drains and cancels us
        print(f"elastic job {job}: {note['signal']}; told the master", flush=True)

    ending = False

    def end_steps() -> None:
        nonlocal ending
        ending = True
        for step in steps:
            if step.proc.poll() is None:
                step.proc.terminate()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(s.proc.poll() is None for s in steps):
            time.sleep(0.2)
        for step in steps:
            if step.proc.poll() is None:
                step.proc.kill()

    signal.signal(signal.SIGUSR2, on_signal)
    signal.signal(signal.SIGTERM, lambda *_: end_steps())
    steps.extend(start(k) for k in range(size))
    fresh = lease_watcher(lease, args.lease_timeout_s, any_owner=True)
    while not ending:  # the master's scancel (or a stale lease) ends the job
        if not fresh():
            print(f"elastic job {job}: the master's lease is stale; ending", flush=True)
            end_steps()
            break
        holder = lease_owner(lease)
        for i, step in enumerate(steps):
            # a step ended under a master that is gone (its rank saw the new lease, or
            # MPI failed it with the dead master): it joins the master that took over
            if step.proc.poll() is not None and holder is not None and holder != step.owner:
                print(f"elastic job {job}: component {step.k} joins the resumed master", flush=True)
                steps[i] = start(step.k)
        time.sleep(1.0)
    return max((step.proc.wait() for step in steps), default=0)


@dataclass
class _Step:
    """One component's ``srun`` step, and the master whose lease it started under."""

    k: int
    proc: subprocess.Popen[bytes]
    owner: tuple[str, int] | None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pearl_hpc.backends.slurm_job", description=_launch.__doc__
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--lease-timeout-s", type=float, default=60.0)
    p.add_argument("--gpus", default="1", help="GPUs of each component's worker: 1,2,...")
    p.add_argument("--mpi", default="pmi2", help="srun --mpi of each component's step")
    p.add_argument("--srun-option", action="append", default=[], help="a further srun option")
    p.add_argument(
        "--rank-command", action="append", default=[],
        help="a word of the command that runs Python for each rank, in order (default: this "
        "Python; in a container: apptainer exec ... IMAGE python3, or the image's python3)",
    )  # fmt: skip
    args = p.parse_args(argv)
    private_files()
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
