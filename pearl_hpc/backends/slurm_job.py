"""The batch step of an elastic job (Slurm backend), run by ``sbatch`` on the job's
first node:

    python -m pearl_hpc.backends.slurm_job --run-dir DIR --model M ...

It starts one engine rank per heterogeneous component, each in its own
``srun --mpi=pmi2 --het-group=K`` step (so ``scancel JOB+K`` ends only that component):
``python -m pearl_hpc.worker join`` Connects to the master and Merges into the run's
world. It writes the job's preemption signal for the master (``elastic/JOB.signal``) and
ends the steps once the master's lease (``elastic/master.lease``) goes stale or another
master takes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pearl_hpc.backends.lease import LEASE_FILE, lease_watcher


def _launch(args: argparse.Namespace) -> int:
    """The batch step of an elastic job: one engine rank per component, each in its own
    ``srun --het-group=K`` step; the job's signal is written for the master; the steps end
    when the master's lease goes stale."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print(
            "pearl_hpc.backends.slurm_job: not inside a Slurm job (no SLURM_JOB_ID)",
            file=sys.stderr,
        )
        return 2
    het = "SLURM_HET_SIZE" in os.environ
    size = int(os.environ.get("SLURM_HET_SIZE", "1"))
    edir = args.run_dir / "elastic"
    procs = []
    for k in range(size):
        # PMI from srun: the rank is an MPI process of its own, Connecting to the
        # master's port (a Hydra-launched base world accepts it: verified here)
        argv = ["srun", "-n1", "--mpi=pmi2", *([f"--het-group={k}"] if het else [])]
        argv += [
            sys.executable, "-m", "pearl_hpc.worker", "join",
            "--run-dir", str(args.run_dir), "--model-dir", args.model, "--group", f"{job}+{k}",
        ]  # fmt: skip
        procs.append(subprocess.Popen(argv))

    def on_signal(signum: int, _frame: Any) -> None:
        note = {"signal": signal.Signals(signum).name, "time": time.time()}
        tmp = edir / f"{job}.signal.tmp"
        tmp.write_text(json.dumps(note))
        tmp.rename(edir / f"{job}.signal")  # the master drains and cancels us
        print(f"elastic job {job}: {note['signal']}; told the master", flush=True)

    def end_steps() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    signal.signal(signal.SIGUSR2, on_signal)
    signal.signal(signal.SIGTERM, lambda *_: end_steps())
    master_alive = lease_watcher(edir / LEASE_FILE, args.lease_timeout_s)
    while any(proc.poll() is None for proc in procs):
        if not master_alive():
            print(f"elastic job {job}: the master's lease is stale or taken; ending", flush=True)
            end_steps()
            break
        time.sleep(1.0)
    return max((proc.wait() for proc in procs), default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pearl_hpc.backends.slurm_job", description=_launch.__doc__
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--lease-timeout-s", type=float, default=60.0)
    return _launch(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
