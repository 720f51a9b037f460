"""Start a pearl_hpc run from Python with submitit (the API behind `pearl-hpc launch`).

    python launch/submit.py configs/clusters/local.yaml

Each rank of the submitted base job runs ``pearl_hpc.launch.base_main``; rank 0 is the
master and returns the run summary, which ``job.results()[0]`` reads back.
"""

from __future__ import annotations

import sys

from pearl_hpc.launch import submit, summary_table, wait_for_run


def main(config: str) -> int:
    job, run_dir = submit(config)
    print(f"base job {job.job_id}, run directory {run_dir}")
    wait_for_run(run_dir)
    summary = job.results()[0]  # rank 0's return value
    from rich.console import Console

    Console().print(summary_table(summary))
    return 0 if not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "configs/clusters/local.yaml"))
