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


def test_replayed_load_starts_a_standing_request_then_preempts_it(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """slurm/replay-load over all four nodes of a trace "none idle, one idle for 8 s, none
    idle": a pending one-node request on the elastic partition starts when the load
    frees a node, and is signalled (then ended) when the load takes the node back."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    trace = tmp_path / "trace.csv"
    trace.write_text("0,0\n4,0\n4,1\n12,1\n12,0\n16,0\n")
    log = tmp_path / "load.jsonl"
    load = subprocess.Popen(
        [sys.executable, "slurm/replay-load", "--file", str(trace), "--speedup", "1",
         "--nodes", "4", "--tag", "cluster-test", "--log", str(log)],
        cwd=repo, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    client, run = SlurmClient(min_backoff_s=0.1), tag()
    marker = tmp_path / "signalled"
    script = f"trap 'date +%s.%N > {marker}; exit 0' USR2; for i in $(seq 1 300); do sleep 1; done"
    request = JobSpec(
        "pearl-elastic",
        run,
        (HetComponent("elastic", gpus_per_node=1, time_limit="5:00", extra=("--exclusive",)),),
        ["bash", "-c", script],
        signal="B:USR2@15",
        output=str(tmp_path / "elastic-%j.out"),
    )
    job_id = None
    try:
        time.sleep(1.5)  # the load holds every node
        job_id = client.submit(request)
        time.sleep(1.5)
        assert client.poll(run)[job_id].state == "PENDING"
        jobs = wait_for(
            lambda: client.poll(run),
            lambda j: job_id in j and j[job_id].state == "RUNNING",
            timeout_s=20,
        )
        started = time.time()
        wait_for(lambda: client.poll(run), lambda j: job_id not in j, timeout_s=60)
        assert marker.exists(), "preempted without its USR2 first"
        assert float(marker.read_text()) - started > 5  # the trace's 8 idle seconds
        assert jobs[job_id].nodes  # it ran on the node the load left idle
        assert load.wait(90) == 0
    finally:
        load.terminate()
        load.wait(30)
        if job_id:
            client.cancel(job_id)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["idle_nodes"] for x in lines if "idle_nodes" in x] == [0, 1, 0]
    assert lines[-1]["end"] is True
    # its jobs cancelled at the end: a cancelled job stays listed while it completes
    # (CI once saw one there right after the load exited)
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(["squeue", "-h", "-o", "%k %T"], capture_output=True, text=True)
        left = [row for row in out.stdout.splitlines() if row.startswith("loadgen:cluster-test")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, left
    check_trace_from_history(lines, tmp_path)


def check_trace_from_history(lines: list[dict], tmp_path: Path) -> None:
    """``pearl-hpc trace --from-sacct`` over the load's window finds the idle GPUs the
    load left (the pearl-elastic request that took them counts as idle), and the simulator
    runs on what it wrote."""
    from datetime import datetime

    import numpy as np

    from pearl_hpc.cli.main import main as cli
    from pearl_hpc.config.traces import load_trace

    steps = [x for x in lines if "idle_nodes" in x]
    since = steps[0]["wall"] - steps[0]["t_s"]
    until = lines[-1]["wall"]
    out = tmp_path / "elastic-idle.csv"
    iso = [datetime.fromtimestamp(t).isoformat() for t in (since, until)]
    assert cli(["trace", "--from-sacct", "elastic", "--since", iso[0], "--until", iso[1],
                "--out", str(out)]) == 0  # fmt: skip
    found = load_trace(out)
    grid = np.arange(steps[0]["t_s"] + 1.0, lines[-1]["t_s"] - 1.0, 0.1)
    replayed = [8 * next(x["idle_nodes"] for x in reversed(steps) if x["t_s"] <= t) for t in grid]
    seen = [found.count_at(t) for t in grid]
    corr = float(np.corrcoef(replayed, seen)[0, 1])
    print(f"trace --from-sacct against the replayed load: correlation {corr:.3f}, idle GPUs "
          f"mean {np.mean(seen):.2f} found, {np.mean(replayed):.2f} replayed")  # fmt: skip
    # Slurm records whole seconds (and a preempted job's grace): more than 1.5 s from a
    # change of the load, what was found is what was replayed
    changes = [x["t_s"] for x in steps[1:]] + [lines[-1]["t_s"]]
    settled = [i for i, t in enumerate(grid) if min(abs(t - c) for c in changes) > 1.5]
    assert len(settled) > len(grid) / 2
    assert [seen[i] for i in settled] == [replayed[i] for i in settled]
    assert corr > 0.5
    assert cli(["simulate", "--trace", str(out), "--systems", "pearl", "--json"]) == 0
