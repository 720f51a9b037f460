"""Against the real local Slurm cluster (slurm/local-cluster.sh): heterogeneous jobs,
releasing one component, submission errors and preemption of the elastic partition."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pearl_hpc.slurm.client import SlurmClient, SlurmError
from pearl_hpc.slurm.parse import JobRow
from pearl_hpc.slurm.scripts import HetComponent, JobSpec

pytestmark = pytest.mark.slurm


def wait_for(
    poll: Callable[[], dict[str, JobRow]],
    done: Callable[[dict[str, JobRow]], bool],
    timeout_s: float = 60.0,
) -> dict[str, JobRow]:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = poll()
        if done(jobs):
            return jobs
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; squeue shows {jobs}")
        time.sleep(0.3)


def tag() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def test_hetjob_runs_and_one_component_is_released(slurm_cluster: str, tmp_path: Path) -> None:
    client, run = SlurmClient(min_backoff_s=0.1), tag()
    spec = JobSpec(
        "pearl-elastic",
        run,
        (
            HetComponent("elastic", gpus_per_node=2, time_limit="5:00"),
            HetComponent("elastic", gpus_per_node=4, time_limit="5:00"),
        ),
        ["sleep", "300"],
        output=str(tmp_path / "job-%j.out"),
    )
    job_id = client.submit(spec)
    try:
        jobs = wait_for(
            lambda: client.poll(run),
            lambda j: [r.state for r in j.values()] == ["RUNNING", "RUNNING"],
        )
        assert set(jobs) == {f"{job_id}+0", f"{job_id}+1"}
        assert all(r.comment == f"pearl:{run}" and r.partition == "elastic" for r in jobs.values())
        client.cancel(job_id, 1)
        jobs = wait_for(lambda: client.poll(run), lambda j: set(j) == {f"{job_id}+0"})
        assert jobs[f"{job_id}+0"].state == "RUNNING"  # the other component keeps working
    finally:
        client.cancel(job_id)
    wait_for(lambda: client.poll(run), lambda j: not j)


def test_submission_to_a_missing_partition_fails_with_slurms_message(slurm_cluster: str) -> None:
    spec = JobSpec("pearl-bad", tag(), (HetComponent("nosuchpartition"),), ["true"])
    with pytest.raises(SlurmError, match=r"(?i)invalid partition"):
        SlurmClient().submit(spec)


def test_high_priority_job_preempts_elastic_job_after_its_signal(
    slurm_cluster: str, tmp_path: Path
) -> None:
    client, run = SlurmClient(min_backoff_s=0.1), tag()
    marker = tmp_path / "signalled"
    script = f"trap 'date +%s.%N > {marker}; exit 0' USR2; for i in $(seq 1 300); do sleep 1; done"
    # the elastic job holds every GPU of every node; the high job needs one node's
    elastic = JobSpec(
        "pearl-elastic",
        run,
        (HetComponent("elastic", nodes=4, gpus_per_node=8, time_limit="5:00"),),
        ["bash", "-c", script],
        signal="B:USR2@15",
        output=str(tmp_path / "elastic-%j.out"),
    )
    high = JobSpec(
        "pearl-high",
        run,
        (HetComponent("high", gpus_per_node=8, time_limit="1:00"),),
        ["sleep", "2"],
        signal=None,
        output=str(tmp_path / "high-%j.out"),
    )
    elastic_id = client.submit(elastic)
    high_id = None
    try:
        wait_for(
            lambda: client.poll(run),
            lambda j: j.get(elastic_id) is not None and j[elastic_id].state == "RUNNING",
        )
        submitted = time.time()
        high_id = client.submit(high)
        wait_for(lambda: client.poll(run), lambda j: elastic_id not in j, timeout_s=60)
        assert marker.exists(), "the elastic job was cancelled without its USR2 first"
        assert float(marker.read_text()) - submitted < 20  # within the 20 s grace time
        wait_for(
            lambda: client.poll(run),
            lambda j: high_id not in j or j[high_id].state in ("RUNNING", "COMPLETING"),
            timeout_s=30,
        )
    finally:
        client.cancel(elastic_id)
        if high_id:
            client.cancel(high_id)
    wait_for(lambda: client.poll(run), lambda j: not j)
