"""``pearl-hpc run`` through submitit: the master as a Slurm job that requeues itself.

    pearl-hpc run configs/runs/slurm-local.yaml --submit --wait

The job's partition, account, time, typed GPUs, env and setup lines are the config's
``slurm:`` site settings (:func:`submitit_parameters`); ``--set`` overrides them.

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
import shlex
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit

from pearl_hpc.backends.world import base_job_spec, run_world
from pearl_hpc.config.cluster import run_config_text
from pearl_hpc.config.run import RunConfig
from pearl_hpc.config.slurm import gpu_request, job_env, slurm_minutes
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.rundir import RunDir, RunStatus, private_files, read_journal


class RunJob(submitit.helpers.Checkpointable):
    """The submitted callable: one master of the run in ``run_dir``."""

    def __call__(self, run_dir: str) -> dict[str, Any]:
        private_files()
        if submitit.JobEnvironment().global_rank != 0:
            # a layout over several nodes: one task a node holds the allocation; the
            # first's world starts the ranks on every node (one srun step, --overlap)
            return {}
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
        if rc == 0 and read_journal(run.journal).get("status") == RunStatus.STOPPED:
            return {"stopped": True}  # pearl-hpc cancel: --resume continues it
        if rc != 0 or not run.summary.exists():
            raise RuntimeError(f"the run's world ended with status {rc}; see the job's output")
        summary: dict[str, Any] = json.loads(run.summary.read_text())
        return summary

    def checkpoint(self, run_dir: str) -> submitit.helpers.DelayedSubmission:
        """Preempted or timed out: requeue; the next start resumes from the journal."""
        return submitit.helpers.DelayedSubmission(RunJob(), run_dir)


def submit_run(config: str | Path, sets: Sequence[str] = ()) -> tuple[Any, Path]:
    """Submit the master of a new run as a submitit job with the config's site settings
    (``slurm:``) and its one node's tasks, CPUs and GPUs; returns (submitit job, run
    directory). ``job.results()[0]`` is the run's summary (a layout over several nodes
    has a task a node)."""
    cfg = load_run_config(config, sets=sets)
    if not cfg.slurm.time:
        raise ConfigError(
            f"{config}: --submit needs slurm.time (the job's time limit: submitit requeues "
            "the job when it comes), e.g. --set slurm.time=1-00:00:00"
        )
    run_dir = RunDir.new(cfg.runs_dir, cfg.name, run_config_text(config, sets)).path.resolve()
    executor = submitit.AutoExecutor(folder=str(RunDir(run_dir).submitit), cluster="slurm")
    executor.update_parameters(**submitit_parameters(cfg, run_dir))
    try:
        return executor.submit(RunJob(), str(run_dir)), run_dir
    except Exception as exc:  # submitit's sbatch failed: one line, no directory left
        shutil.rmtree(run_dir, ignore_errors=True)
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise ConfigError(f"{config}: the job was not queued: {why}") from None


def submitit_parameters(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """submitit's parameters for the run's base job (pure): the nodes, GPUs and site
    options of :func:`~pearl_hpc.backends.world.base_job_spec` -- every node as the
    widest (submitit submits no heterogeneous job: ``--sbatch`` asks each node's GPUs) --,
    one task a node with the CPUs of the busiest node's ranks, its env and setup lines,
    the warning before the time limit."""
    job = base_job_spec(cfg, run_dir, uniform=True)
    shape = job.components[0]
    s = cfg.slurm
    cpus = shape.ntasks_per_node * shape.cpus_per_task
    setup = [f"export {k}={shlex.quote(v)}" for k, v in job_env(s).items()] + list(s.setup)
    sbatch = {}  # the site's sbatch options (account, qos, gres...): submitit writes them
    for option in [*shape.extra, *gpu_request(s, shape.gpus_per_node)]:
        key, eq, value = option.removeprefix("--").partition("=")
        sbatch[key.replace("-", "_")] = value if eq else True
    return {
        "slurm_job_name": cfg.name,
        "nodes": shape.nodes,
        "tasks_per_node": 1,
        "cpus_per_task": cpus,
        "timeout_min": slurm_minutes(s.time),
        "slurm_signal_delay_s": s.signal_lead_s,
        "slurm_setup": setup,
        "slurm_srun_args": list(s.srun_extra),
        **({"slurm_partition": s.partition} if s.partition else {}),
        "slurm_additional_parameters": sbatch,
    }
