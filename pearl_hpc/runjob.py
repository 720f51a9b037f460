"""``pearl-hpc run`` through submitit: the master as a Slurm job that requeues itself.

    pearl-hpc run configs/runs/slurm-local.yaml --submit --partition normal --wait

The job runs the run's MPI world (:func:`pearl_hpc.backends.world.run_world`) on the run
directory it was given. On preemption or at its time limit, submitit's signal handler calls
:meth:`RunJob.checkpoint`: the job is requeued and the next start resumes from the
journal, as ``pearl-hpc run --resume`` does (the trainer from its newest checkpoint, the
steps after it replayed and the step in progress resumed from the trajectory log, the
dead master's elastic jobs cancelled by tag). A job that Slurm restarts without a
checkpoint (node failure) resumes too: a run directory with an unfinished journal is
always resumed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import submitit

from pearl_hpc.backends.world import run_world
from pearl_hpc.config.cluster import run_config_text
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.rundir import RunDir, RunStatus, read_journal


class RunJob(submitit.helpers.Checkpointable):
    """The submitted callable: one master of the run in ``run_dir``."""

    def __call__(self, run_dir: str) -> dict[str, Any]:
        run = RunDir(Path(run_dir))
        path = run.path
        cfg = load_run_config(run.config)
        status = read_journal(run.journal).get("status") if run.journal.exists() else None
        if status == RunStatus.FINISHED and run.summary.exists():
            # requeued after its last step (the preemption came late): nothing to do
            print(f"pearl-hpc run: {path} already finished", flush=True)
            done: dict[str, Any] = json.loads(run.summary.read_text())
            return done
        resume = status is not None
        print(f"pearl-hpc run: {'resuming ' if resume else ''}{path}", flush=True)
        # the world's rank 0 prints the step lines and the summary into this job's output
        # the preemption's SIGTERM is ignored (submitit only logs it) by this process and,
        # inherited through exec, by the world and by the `scontrol requeue` submitit's
        # USR2 handler runs: the requeue's own step teardown must not kill that command
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rc = run_world(cfg, path, resume=resume)
        if rc != 0 or not run.summary.exists():
            raise RuntimeError(f"the run's world ended with status {rc}; see the job's output")
        summary: dict[str, Any] = json.loads(run.summary.read_text())
        return summary

    def checkpoint(self, run_dir: str) -> submitit.helpers.DelayedSubmission:
        """Preempted or timed out: requeue; the next start resumes from the journal."""
        return submitit.helpers.DelayedSubmission(RunJob(), run_dir)


def submit_run(
    config: str | Path,
    *,
    partition: str | None = None,
    gpus: int = 0,
    cpus: int = 4,
    timeout_min: int = 60,
) -> tuple[Any, Path]:
    """Submit the master of a new run; returns (submitit job, run directory)."""
    cfg = load_run_config(config)
    run_dir = RunDir.new(cfg.runs_dir, cfg.name, run_config_text(config)).path.resolve()
    executor = submitit.AutoExecutor(folder=str(RunDir(run_dir).submitit), cluster="slurm")
    params: dict[str, Any] = {
        "slurm_job_name": "pearl-run",
        "cpus_per_task": cpus,
        "timeout_min": timeout_min,
        "tasks_per_node": 1,
        "nodes": 1,
    }
    if partition:
        params["slurm_partition"] = partition
    if gpus:
        params["slurm_gres"] = f"gpu:{gpus}"
    executor.update_parameters(**params)
    return executor.submit(RunJob(), str(run_dir)), run_dir
