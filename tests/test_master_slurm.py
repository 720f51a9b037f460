"""The master rank on the real local Slurm cluster: a submitit-launched base job, an
elastic hetjob whose ranks join over MPI, Comm.Split per plan, a torch.distributed data
plane across re-partitions, release of one component, preemption and faults.

Each test runs a whole short run (tens of seconds) and checks its records: the event log,
the summary, squeue and the process table afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import resume_drained_nodes

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def mpi_ready() -> None:
    pytest.importorskip("mpi4py", reason="mpi4py + MPICH are needed: pip install -e .[slurm]")
    pytest.importorskip("submitit", reason="submitit is needed: pip install -e .[slurm]")


def write_config(tmp_path: Path, **sections: Any) -> Path:
    cfg: dict[str, Any] = {
        "name": "t",
        "runs_dir": str(tmp_path / "runs"),
        "profile": str(REPO / "configs/profiles/qwen3-8b-h800-tp2.yaml"),
        "policy": {"pd_policy": "fixed-ratio", "prefill_fraction": 0.5, "expansion": "always"},
        "base": {
            "partition": "normal",
            "gpus_per_node": 4,
            "gpus_per_worker": 1,
            "num_training_workers": 2,
            "num_rollout_workers": 2,
            "time_limit": "10:00",
        },
        "elastic": {"pending_timeout_s": 60, "grace_s": 20, "poll_s": 0.5, "requests": []},
        "run": {
            "steps": 3,
            "rollout_s": 3,
            "train_s": 1,
            "data_plane": "off",
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 4,
        },
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def squeue_tagged(tag: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i|%T|%r|%k"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if line.endswith(f"pearl:{tag}")]


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch(
    config: Path, during: Callable[[Path], None] | None = None
) -> tuple[dict[str, Any], Path, list[dict[str, Any]]]:
    """Submit the base job with submitit, wait until this run has no job left in squeue,
    check nothing of it is still running; returns (summary, run dir, events)."""
    from pearl_hpc.launch import submit

    job, run_dir = submit(config)
    try:
        if during is not None:
            during(run_dir)
        wait_gone_from_squeue(run_dir.name, RUN_TIMEOUT_S)
    finally:
        cancel_tagged(run_dir.name)
    summary_path = run_dir / "summary.json"
    assert summary_path.exists(), (
        f"no summary; master log:\n{_tail(run_dir / 'submitit' / f'{job.job_id}_0_log.err')}"
    )
    assert_no_process_left(run_dir, settle_s=1)
    return json.loads(summary_path.read_text()), run_dir, events(run_dir)


def wait_gone_from_squeue(tag: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while squeue_tagged(tag):
        assert time.monotonic() < deadline, f"run {tag} still in squeue: {squeue_tagged(tag)}"
        time.sleep(1)


def cancel_tagged(tag: str) -> None:
    """Never leak: cancel whatever of the run is still in squeue."""
    for line in squeue_tagged(tag):
        subprocess.run(["scancel", line.split("|")[0].split("+")[0]], check=False)


def assert_no_process_left(run_dir: Path, settle_s: float) -> None:
    time.sleep(settle_s)
    stray = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout
    assert not stray.strip(), f"processes of the run left behind: {stray}"


def wait_for_roles(run_dir: Path, members: set[str], timeout_s: float = 60) -> None:
    """Until a re-partition gave every one of ``members`` a role (killing a rank in the
    middle of a collective call would hang the others: MPI has no fault tolerance
    there)."""
    deadline = time.monotonic() + timeout_s
    while not any(e["what"] == "partition" and members <= set(e["roles"]) for e in events(run_dir)):
        assert time.monotonic() < deadline, f"{sorted(members)} never got a role"
        time.sleep(0.2)


def wait_settled(run_dir: Path, members: set[str], timeout_s: float = 60) -> None:
    """Until ``members`` were admitted and the re-partition that follows admission
    finished with them. Only then is killing one safe: a member that dies within the
    master's freshness window (heartbeat_timeout_s / 4) before a collective would hang
    it, and admission is always followed by one."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = events(run_dir)
        # their admission, not the base job's earlier one: after they joined (seen in CI:
        # a partition between joining and admission already lists them in its roles)
        joined = [
            i for i, e in enumerate(log) if e["what"] == "joined" and members <= set(e["members"])
        ]
        admitted = [
            i for i, e in enumerate(log) if e["what"] == "admitted" and joined and i > joined[0]
        ]
        if admitted and any(
            e["what"] == "partition" and members <= set(e["roles"]) for e in log[admitted[-1] + 1 :]
        ):
            return
        assert time.monotonic() < deadline, f"{sorted(members)} never settled: {log[-5:]}"
        time.sleep(0.1)


def wait_event(run_dir: Path, what: str, timeout_s: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in events(run_dir):
            if event["what"] == what:
                return event
        time.sleep(0.2)
    raise AssertionError(
        f"no {what!r} event within {timeout_s} s: {events(run_dir)[-5:]}\n{_diagnosis(run_dir)}"
    )


def _diagnosis(run_dir: Path) -> str:
    """Where the run stands in Slurm and what its master logged (for a failed wait)."""
    sinfo = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T %E"], capture_output=True, text=True
    ).stdout
    logs = sorted((run_dir / "submitit").glob("*_log.*")) if run_dir.exists() else []
    tails = "\n".join(f"--- {p.name}\n{_tail(p, 20)}" for p in logs)
    return f"squeue: {squeue_tagged(run_dir.name)}\nsinfo:\n{sinfo}{tails}"


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text().splitlines()[-n:]) if path.exists() else "(none)"


# ------------------------------------------------------------------------------ tests
def test_hetjob_joins_splits_by_role_and_one_component_is_released(
    slurm_cluster: str, mpi_ready: None, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="the gloo data plane needs torch")
    request = {
        "at_step": 0,
        "components": [
            {"shape": "prefill", "partition": "elastic", "gpus_per_node": 2},
            {"shape": "decode", "partition": "elastic", "gpus_per_node": 2},
        ],
        "release": [{"component": 1, "at_step": 2}],
    }
    config = write_config(
        tmp_path,
        elastic={"requests": [request]},
        run={"steps": 4, "rollout_s": 4, "data_plane": "gloo"},
    )
    summary, _, log = launch(config)

    assert summary["steps"] == 4
    assert summary["errors"] == [] and summary["failures"] == []
    job = next(e["job_id"] for e in log if e["what"] == "submitted")
    first, second = f"{job}+0", f"{job}+1"
    lat = summary["latency"]
    for group in (first, second):  # submitted -> RUNNING -> ranks joined -> admitted
        stages = [lat[group][k] for k in ("submitted", "running", "joined", "admitted")]
        assert stages == sorted(stages), lat[group]
    # component 1 alone was given back with scancel JOB+1, while component 0 worked on
    cancels = [e for e in log if e["what"] == "cancelled"]
    assert [c["scancel"] for c in cancels] == [second]
    released_at = lat[second]["cancelled"]
    later = [p for p in summary["partitions"] if p["at"] > released_at and p["acks"]]
    assert later, "no re-partition after the release"
    for part in later:
        assert not any(m.startswith(second) for m in part["roles"])
        assert {f"{first}:0", f"{first}:1"} <= set(part["roles"])
    # Comm.Split: every member's role group has as many members as hold that role
    split = [p for p in summary["partitions"] if len(p["acks"]) == len(p["universe"]) - 1]
    assert split
    for part in split:
        for member, size in part["acks"].items():
            role = part["roles"].get(member)
            expected = sum(1 for r in part["roles"].values() if r == role) if role else None
            if role is not None:
                assert size == expected, (member, part)
    assert any({"prefill", "decode"} <= set(p["roles"].values()) for p in split)
    # the data plane: weights broadcast and prefill -> decode KV, elastic members included
    seen = [
        (member, dp)
        for p in summary["partitions"]
        for member, dp in p["dataplane"].items()
        if dp.get("member")
    ]
    assert seen and all(dp.get("weights_ok") for _, dp in seen)
    assert any(m.startswith(first) and dp.get("kv_ok") for m, dp in seen)
    assert any(
        m.startswith(first) and dp.get("weights_ok") and p["at"] > released_at
        for p in summary["partitions"]
        for m, dp in p["dataplane"].items()
    )


def test_preemption_signal_is_drained_and_reported_before_the_grace_time(
    slurm_cluster: str, mpi_ready: None, tmp_path: Path
) -> None:
    request = {
        "at_step": 0,
        "components": [{"partition": "elastic", "gpus_per_node": 8}],  # a whole node
    }
    config = write_config(
        tmp_path, elastic={"requests": [request]}, run={"steps": 3, "rollout_s": 8}
    )
    preempted: dict[str, float] = {}

    def preempt(run_dir: Path) -> None:
        granted = wait_event(run_dir, "granted")
        wait_event(run_dir, "joined")
        node = granted["nodes"][0]
        high = subprocess.run(
            ["sbatch", "--parsable", "-p", "high", "-w", node, "--gres=gpu:8", "-o", "/dev/null",
             "--wrap", "sleep 3"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        preempted["job"] = float(high.stdout.strip().split(";")[0])
        preempted["at"] = time.monotonic()

    summary, _, log = launch(config, during=preempt)
    # let the high-priority job finish so that it leaks nothing either
    deadline = time.monotonic() + 60
    while subprocess.run(["squeue", "-h", "-j", str(int(preempted["job"]))],
                         capture_output=True, text=True).stdout.strip():  # fmt: skip
        assert time.monotonic() < deadline
        time.sleep(1)

    assert summary["steps"] == 3 and summary["errors"] == []
    group = next(e["group"] for e in log if e["what"] == "granted")
    lat = summary["latency"][group]
    signal = next(e for e in log if e["what"] == "signal")
    reclaim = next(e for e in log if e["what"] == "event" and e["type"] == "CapacityReclaimed")
    assert signal["group"] == group and reclaim["source"] == group
    grace_s = 20.0
    assert reclaim["deadline_s"] == pytest.approx(reclaim["t"] + grace_s, abs=0.5)
    # drained (workers released), left the plane and given back before the grace ended
    assert lat["left"] - lat["signal"] < grace_s
    assert lat["cancelled"] - lat["signal"] < grace_s
    released = [e for e in log if e["what"] == "event" and e["type"] == "WorkerReleased"]
    assert any(e["t"] >= lat["signal"] for e in released)


def test_bad_partition_is_reported_and_the_run_goes_on(
    slurm_cluster: str, mpi_ready: None, tmp_path: Path
) -> None:
    request = {"at_step": 1, "components": [{"partition": "nosuchpartition", "gpus_per_node": 2}]}
    config = write_config(tmp_path, elastic={"requests": [request]}, run={"steps": 2})
    summary, _, log = launch(config)
    assert summary["steps"] == 2
    assert len(summary["errors"]) == 1
    assert "sbatch failed" in summary["errors"][0]
    assert "partition" in summary["errors"][0].lower()  # Slurm's own message
    assert not [e for e in log if e["what"] == "submitted"]


def test_a_killed_worker_is_declared_failed_and_dropped_from_the_universe(
    slurm_cluster: str, mpi_ready: None, tmp_path: Path
) -> None:
    request = {"at_step": 0, "components": [{"partition": "elastic", "gpus_per_node": 2}]}
    config = write_config(
        tmp_path, elastic={"requests": [request]}, run={"steps": 3, "rollout_s": 6}
    )
    killed: dict[str, Any] = {}

    def kill_one(run_dir: Path) -> None:
        joined = wait_event(run_dir, "joined")
        member, pid = sorted(joined["members"].items())[-1]
        wait_settled(run_dir, set(joined["members"]))
        os.kill(int(pid), 9)
        killed.update(member=member, at=time.monotonic())

    summary, _, log = launch(config, during=kill_one)
    assert summary["steps"] == 3
    failed = [f["member"] for f in summary["failures"]]
    assert killed["member"] in failed
    kinds = [e["type"] for e in log if e["what"] == "event"]
    assert "WorkerFailed" in kinds
    after = [p for p in summary["partitions"] if p["at"] > summary["failures"][0]["at"]]
    assert after and all(killed["member"] not in p["universe"] for p in after)


def test_slurmctld_unreachable_for_a_while_is_survived(
    slurm_cluster: str, mpi_ready: None, tmp_path: Path
) -> None:
    request = {"at_step": 1, "components": [{"partition": "elastic", "gpus_per_node": 2}]}
    config = write_config(
        tmp_path, elastic={"requests": [request]}, run={"steps": 4, "rollout_s": 5}
    )
    conf = Path(slurm_cluster)
    pid_file = conf.parent / "run" / "slurmctld.pid"

    def outage(run_dir: Path) -> None:
        wait_event(run_dir, "base")
        os.kill(int(pid_file.read_text()), 15)
        time.sleep(15)  # longer than squeue's own ~9 s of connection retries
        subprocess.run(["slurmctld", "-f", str(conf)], check=True)
        deadline = time.monotonic() + 30
        while "is UP" not in subprocess.run(["scontrol", "ping"], capture_output=True,
                                            text=True).stdout:  # fmt: skip
            assert time.monotonic() < deadline, "slurmctld did not come back"
            time.sleep(0.5)
        resume_drained_nodes()

    summary, _, log = launch(config, during=outage)
    assert summary["steps"] == 4
    assert summary["failures"] == []  # a deaf master declares nobody failed
    assert summary["errors"] == []  # a submission that met the outage was retried
    assert summary["slurm_poll_failures"] >= 1  # logged, last state kept, backed off
    assert [e for e in log if e["what"] == "granted"]  # the request after the outage ran


def test_a_killed_master_takes_its_jobs_down(
    slurm_cluster: str, mpi_ready: None, tmp_path: Path
) -> None:
    """kill -9 of rank 0: srun --kill-on-bad-exit ends the base job, the elastic job's
    launcher sees its base job gone and ends too: nothing is left to the time limit."""
    from pearl_hpc.launch import submit

    request = {"at_step": 0, "components": [{"partition": "elastic", "gpus_per_node": 2}]}
    config = write_config(
        tmp_path, elastic={"requests": [request]}, run={"steps": 50, "rollout_s": 5}
    )
    _, run_dir = submit(config)
    try:
        base = wait_event(run_dir, "base")
        joined = wait_event(run_dir, "joined")
        wait_for_roles(run_dir, set(joined["members"]))
        os.kill(int(base["master_pid"]), 9)
        wait_gone_from_squeue(run_dir.name, 60)
    finally:
        cancel_tagged(run_dir.name)
    assert_no_process_left(run_dir, settle_s=2)
