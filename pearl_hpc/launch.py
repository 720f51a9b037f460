"""Start a run's base job on Slurm: with submitit (default) or a plain sbatch script.

    pearl-hpc launch configs/clusters/local.yaml [--sbatch] [--wait]

Python API::

    from pearl_hpc.launch import submit
    job, run_dir = submit("configs/clusters/local.yaml")
    summary = job.result()          # rank 0's return value: the run summary

Every rank of the base job runs :func:`base_main`: rank 0 becomes the master
(:class:`pearl_hpc.mpimaster.Master`), the others serve as training and reserved rollout
workers. The run directory holds the config copy, the MPI port file, the journal, the
event log and the summary.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pearl_hpc.cluster import ClusterConfig, load_cluster
from pearl_hpc.errors import ConfigError
from pearl_hpc.slurm.client import SlurmClient
from pearl_hpc.slurm.scripts import JobSpec, render_sbatch

REPO_ROOT = Path(__file__).resolve().parent.parent


def new_run_dir(cfg: ClusterConfig, config_path: Path) -> tuple[Path, str]:
    """A fresh run directory under ``cfg.runs_dir`` and the run's tag."""
    tag = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = Path(cfg.runs_dir).resolve() / tag
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "cluster.yaml").write_text(config_path.read_text())
    return run_dir, tag


def elastic_command(cfg: ClusterConfig, run_dir: Path) -> list[str]:
    """The batch command of an elastic job."""
    return [
        sys.executable, "-m", "pearl_hpc.worker", "noop-elastic",
        "--run-dir", str(run_dir), "--mpi", cfg.mpi,
        "--gpus-per-worker", str(cfg.base.gpus_per_worker),
        "--heartbeat-s", str(cfg.run.heartbeat_interval_s),
        "--data-plane", cfg.run.data_plane,
        "--base-job", os.environ.get("SLURM_JOB_ID", ""),
    ]  # fmt: skip


def base_main(config_path: str, run_dir: str, run_tag: str) -> dict[str, Any] | None:
    """Every rank of the base job: rank 0 is the master, the others workers."""
    faulthandler.enable()  # a crash in MPI / torch native code leaves a Python stack
    cfg = load_cluster(config_path)
    path = Path(run_dir)
    master_rank = os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")) == "0"
    store = None
    if master_rank and cfg.run.data_plane != "off":
        # before MPI starts: a child forked from an initialised MPI process crashed it
        from pearl_hpc.comm.store_server import StoreProcess

        store = StoreProcess(path, socket.gethostname())
    elif cfg.run.data_plane != "off":
        import torch  # noqa: F401  (loaded before joining, not inside a plan)

    from mpi4py import MPI

    from pearl_hpc.comm.mpi import MasterPlane, WorkerPlane, member_info
    from pearl_hpc.mpimaster import Master
    from pearl_hpc.worker.noop import NoopWorker

    if MPI.COMM_WORLD.rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        plane = MasterPlane(path, heartbeat_timeout_s=cfg.run.heartbeat_timeout_s)
        master = Master(
            cfg,
            path,
            run_tag,
            plane,
            SlurmClient(),
            worker_command=elastic_command,
            rendezvous=store,
        )
        try:
            return master.run()
        finally:
            if store is not None:
                store.close()
    worker = WorkerPlane.base(heartbeat_interval_s=cfg.run.heartbeat_interval_s)
    NoopWorker(worker).serve(member_info({"group": "base"}))
    return None


def submit(config_path: str | Path, *, folder: str | Path | None = None) -> tuple[Any, Path]:
    """Submit the base job with submitit; returns (job, run_dir)."""
    import submitit

    config_path = Path(config_path).resolve()
    cfg = load_cluster(config_path)
    run_dir, tag = new_run_dir(cfg, config_path)
    executor = submitit.AutoExecutor(folder=str(folder or run_dir / "submitit"), cluster="slurm")
    base = cfg.base_component()
    params: dict[str, Any] = {
        "slurm_partition": base.partition,
        "nodes": base.nodes,
        "tasks_per_node": base.ntasks_per_node,
        "cpus_per_task": base.cpus_per_task,
        "timeout_min": _minutes(base.time_limit),
        "slurm_comment": f"pearl:{tag}",
        "slurm_job_name": "pearl-base",
        # a rank that dies ends the step: no base rank waits forever on a dead master
        "slurm_srun_args": [f"--mpi={cfg.mpi}", "--kill-on-bad-exit=1"],
    }
    if base.gpus_per_node:
        params["slurm_gres"] = f"gpu:{base.gpus_per_node}"
    executor.update_parameters(**params)
    job = executor.submit(base_main, str(config_path), str(run_dir), tag)
    return job, run_dir


def sbatch_spec(config_path: Path, cfg: ClusterConfig, run_dir: Path, tag: str) -> JobSpec:
    """The base job as a plain sbatch script (what launch/pearl.sbatch does by hand)."""
    command = [
        "srun", f"--mpi={cfg.mpi}", "--kill-on-bad-exit=1",
        sys.executable, "-m", "pearl_hpc.launch",
        str(config_path), str(run_dir), tag,
    ]  # fmt: skip
    return JobSpec(
        name="pearl-base",
        run_tag=tag,
        components=(cfg.base_component(),),
        command=command,
        signal="B:USR2@60",
        output=str(run_dir / "base-%j.out"),
        workdir=str(REPO_ROOT),
    )


def submit_sbatch(config_path: str | Path) -> tuple[str, Path]:
    config_path = Path(config_path).resolve()
    cfg = load_cluster(config_path)
    run_dir, tag = new_run_dir(cfg, config_path)
    spec = sbatch_spec(config_path, cfg, run_dir, tag)
    (run_dir / "base.sbatch").write_text(render_sbatch(spec))
    return SlurmClient().submit(spec), run_dir


def _minutes(time_limit: str) -> int:
    """A Slurm time limit in whole minutes (rounded up), as submitit takes it."""
    days, _, rest = time_limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, sec = [*parts, 0, 0][:3]
        minutes = h * 60 + m + (sec > 0)
    elif len(parts) == 1:
        minutes = parts[0]
    elif len(parts) == 2:
        minutes = parts[0] + (parts[1] > 0)
    else:
        minutes = parts[0] * 60 + parts[1] + (parts[2] > 0)
    return max(1, int(days or 0) * 1440 + minutes)


if __name__ == "__main__":  # the plain-sbatch entry: every rank runs this
    if len(sys.argv) != 4:
        raise SystemExit("usage: srun --mpi=pmi2 python -m pearl_hpc.launch CONFIG RUN_DIR RUN_TAG")
    try:
        base_main(*sys.argv[1:])
    except ConfigError as exc:
        raise SystemExit(f"pearl-hpc: {exc}") from None


# ------------------------------------------------------------------ waiting, reports
def wait_for_run(run_dir: Path, *, timeout_s: float = 3600.0, poll_s: float = 1.0) -> None:
    """Block until no job of the run (found by its tag) is left in squeue, showing its
    last event. A failed squeue keeps the last known jobs: it never ends the wait."""
    from rich.console import Console

    console = Console(stderr=True)
    client = SlurmClient(min_backoff_s=poll_s)
    deadline = time.monotonic() + timeout_s
    with console.status(f"run {run_dir.name}: waiting for the base job") as status:
        while client.poll(run_dir.name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_dir.name} still in squeue after {timeout_s:g} s")
            status.update(f"run {run_dir.name}: {_last_event(run_dir)}")
            time.sleep(poll_s)


def _last_event(run_dir: Path) -> str:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return "waiting for the base job to start"
    lines = path.read_text().splitlines()
    steps = [line for line in lines if '"what": "step"' in line]
    return f"{len(steps)} step(s) started, {len(lines)} events"


STAGES = (
    ("submitted", "running", "submit -> RUNNING"),
    ("running", "joined", "RUNNING -> ranks joined"),
    ("joined", "admitted", "joined -> admitted"),
    ("release", "left", "release -> ranks left"),
    ("cancelled", "gone", "scancel -> gone from squeue"),
    ("signal", "left", "preemption signal -> ranks left"),
)


def latency_rows(summary: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """The milestones of every elastic component and the plane's collective timings,
    as (what, seconds...) rows."""
    rows = []
    for start, end, label in STAGES:
        values = [
            lat[end] - lat[start]
            for lat in summary.get("latency", {}).values()
            if start in lat and end in lat
        ]
        if values:
            rows.append((label, values))
    timings = summary.get("timings", {})
    for key, label in (
        ("accept_s", "MPI Accept + Merge (per component)"),
        ("admit_s", "universe extension (Create_intercomm + Merge)"),
        ("shrink_s", "universe shrink (Create_group)"),
        ("partition_s", "re-partition (Comm.Split)"),
    ):
        if timings.get(key):
            rows.append((label, list(timings[key])))
    joins = [
        dp["join_s"]
        for part in summary.get("partitions", [])
        for dp in part.get("dataplane", {}).values()
        if "join_s" in dp
    ]
    if joins:
        rows.append(("data plane join per member (gloo)", joins))
    return rows


def summary_table(summary: dict[str, Any]) -> Any:
    import statistics

    from rich.table import Table

    table = Table(title=f"run {summary.get('run_tag')}: {summary.get('steps')} steps")
    for column in ("what", "n", "median s", "max s"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for label, values in latency_rows(summary):
        table.add_row(
            label, str(len(values)), f"{statistics.median(values):.3f}", f"{max(values):.3f}"
        )
    return table
