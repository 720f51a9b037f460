"""Cluster files and the checks before the queue, against the real local cluster
(``pearl-hpc cluster check``, ``run --dry-run``, ``run --sbatch``): each planted
mistake is refused with one line naming it, and nothing is queued or left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "configs" / "clusters" / "local.yaml"
SLURM_LOCAL = REPO / "configs" / "runs" / "slurm-local.yaml"


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slurm
def test_the_local_clusters_file_matches_the_local_cluster(slurm_cluster: str) -> None:
    proc = _cli("cluster", "check", "local")
    assert proc.returncode == 0, proc.stderr
    assert "normal (default, up): 4 nodes x 8 GPUs (sim)" in proc.stdout
    assert "--partition=normal" in proc.stdout and "--gres=gpu:sim:2" in proc.stdout
    assert "srun --mpi=pmi2" in proc.stdout and "matches the cluster" in proc.stdout


@pytest.mark.slurm
def test_a_planted_mistake_in_a_clusters_file_is_named_by_its_line(
    slurm_cluster: str, tmp_path: Path
) -> None:
    text = LOCAL.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        text.replace("[normal, elastic, high]", "[normal, gpux, high]").replace(
            "    gpus: 8", "    gpus: 10"
        )
    )
    proc = _cli("cluster", "check", str(bad))
    assert proc.returncode == 2
    lines = bad.read_text().splitlines()
    errors = proc.stderr.strip().splitlines()
    assert any("'gpux': no such partition" in e for e in errors), errors
    assert any("nodes.0.gpus: 10 GPUs" in e for e in errors), errors
    for error in errors:  # FILE:LINE: message, the line holding what it names
        where, line, message = error.split(":", 2)
        assert where == str(bad)
        named = "gpux" if "gpux" in message else "gpus: 10"
        assert named in lines[int(line) - 1], (error, lines[int(line) - 1])


def _config(tmp_path: Path, **changes: object) -> Path:
    doc = yaml.safe_load(SLURM_LOCAL.read_text())
    doc["runs_dir"] = str(tmp_path / "runs")
    doc.update(changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model=/nonexistent/model"], "model /nonexistent/model: no such directory"),
        (["model=lab/agent-7b"], "huggingface-cli download lab/agent-7b"),
        (["slurm.partition=gpux"], "slurm.partition 'gpux': no such partition"),
        (["elastic.pools.0.partition=gpux"], "elastic.pools.0.partition 'gpux'"),
        (["layout.gpus_per_node=10", "layout.rollout_nodes=1"],
         "layout.gpus_per_node: 10 GPUs a node, but the nodes of partition normal have at most 8"),
        (["slurm.gpu_type=a100"], "slurm.gpu_type 'a100': the GPUs of partition normal are sim"),
        (["slurm.constraint=infiniband", "elastic.pools.0.constraint=sim"],
         "sbatch --test-only refuses the base job"),
        (["elastic.pools.0.constraint=infiniband"],
         "elastic.pools[0] (elastic): sbatch --test-only refuses a worker's job"),
        (["slurm.container.runtime=pyxis", "slurm.container.image=/shared/pearl.sqsh"],
         "this cluster's srun has no --container-image (pyxis is not installed)"),
    ],
)  # fmt: skip
def test_each_check_before_the_queue_refuses_with_one_line(
    slurm_cluster: str, tmp_path: Path, sets: list[str], message: str
) -> None:
    config = _config(tmp_path)
    flags = [f"--set={s}" for s in sets]
    dry = _cli("run", str(config), "--dry-run", *flags)
    assert dry.returncode == 2 and "## checks before the queue" in dry.stdout
    assert len(dry.stderr.strip().splitlines()) == 1 and message in dry.stderr, dry.stderr
    queued = _cli("run", str(config), "--sbatch", *flags)
    assert queued.returncode == 2 and queued.stderr == dry.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.slurm
def test_the_dry_run_shows_where_site_values_came_from(slurm_cluster: str, tmp_path: Path) -> None:
    proc = _cli("run", str(_config(tmp_path)), "--dry-run", "--set", "slurm.qos=normal")
    assert proc.returncode == 0, proc.stderr
    origin = "(cluster pearl_hpc/configs/clusters/local.yaml)"  # (configs/: a link to it)
    assert f"slurm.partition: 'normal'  {origin}" in proc.stdout
    assert "slurm.qos: 'normal'  (--set)" in proc.stdout and "#SBATCH --qos=normal" in proc.stdout
    assert "ok: sbatch --test-only takes the base job" in proc.stdout
    # the local cluster's nodes are not exclusive: the KV path others could reach
    assert "WARNING: PD disaggregation on nodes other users' jobs may share" in proc.stdout


def test_offline_skips_the_cluster_and_version_prints() -> None:
    proc = _cli(
        "run", str(REPO / "configs" / "runs" / "pearl-32gpu.yaml"), "--dry-run", "--offline"
    )
    assert proc.returncode == 0 and "nothing against the cluster (--offline)" in proc.stdout
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("pearl-hpc ")


@pytest.mark.slurm
def test_cancel_ends_a_batch_job_whose_master_has_not_started(
    slurm_cluster: str, tmp_path: Path
) -> None:
    config = _config(tmp_path)
    queued = _cli("run", str(config), "--sbatch", "--set=slurm.sbatch_extra=[--hold]")
    assert queued.returncode == 0, queued.stderr
    run_dir = Path(queued.stdout.split("run directory ")[1].split()[0])
    job = (run_dir / "base-job").read_text().strip()
    try:
        status = _cli("status", str(run_dir))
        assert "waiting: no master yet" in status.stdout, status.stdout
        cancel = _cli("cancel", str(run_dir))
        assert cancel.returncode == 0 and f"cancelled batch job {job}" in cancel.stdout
        squeue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                                text=True, timeout=30).stdout.strip()  # fmt: skip
        assert squeue in ("", "CANCELLED"), squeue
        # queued again for the same directory (its config kept the --set: held again)
        again = _cli("run", "--resume", str(run_dir), "--sbatch")
        assert again.returncode == 0 and f"run directory {run_dir}" in again.stdout, again.stderr
        job = (run_dir / "base-job").read_text().strip()
        assert f"batch job {job}," in again.stdout
        assert _cli("cancel", str(run_dir)).returncode == 0
    finally:
        subprocess.run(["scancel", job], check=False)
