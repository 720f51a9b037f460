"""Start a pearl_hpc run from Python with submitit (what `pearl-hpc run --submit` does).

    python launch/submit.py configs/runs/slurm-local.yaml [KEY.PATH=VALUE ...]

The job's site settings (partition, account, time, setup lines...) are the config's
``slurm:`` section (over its cluster's file); ``KEY.PATH=VALUE`` overrides one, as
``--set`` does. The submitted job runs the run's MPI world (rank 0 the master); on
preemption or at its time limit it requeues itself and resumes from the journal.
``job.results()[0]`` is the run's summary.
"""

from __future__ import annotations

import sys

import pearl_hpc
from pearl_hpc.master.records import format_summary


def main(config: str, *sets: str) -> int:
    job, run_dir = pearl_hpc.submit(config, sets)
    print(f"master job {job.job_id}, run directory {run_dir}", flush=True)
    print(format_summary(job.results()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]) if len(sys.argv) > 1 else main("configs/runs/slurm-local.yaml"))
