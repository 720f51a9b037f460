"""Elastic capacity as heterogeneous jobs: the pure state machine, then real Slurm."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from pearl_hpc.core.controller import CapacityGranted, CapacityReclaimed
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.errors import TransitionError
from pearl_hpc.slurm.capacity import (
    CapacityManager,
    Component,
    ComponentState,
    gpu_ids_of,
)
from pearl_hpc.slurm.client import SlurmClient
from pearl_hpc.slurm.parse import JobRow, expand_hostlist
from pearl_hpc.slurm.scripts import HetComponent, JobSpec


def spec(run: str, *, extra: tuple[str, ...] = (), out: str | None = None) -> JobSpec:
    return JobSpec(
        "pearl-elastic",
        run,
        (
            HetComponent("elastic", gpus_per_node=2, time_limit="5:00", extra=extra),
            HetComponent("elastic", gpus_per_node=4, time_limit="5:00", extra=extra),
        ),
        ["sleep", "300"],
        output=out,
    )


def row(key: str, state: str, nodes: str = "n1") -> JobRow:
    job, _, comp = key.partition("+")
    return JobRow(job, int(comp) if comp else None, state, "e", "pearl:r", "elastic", nodes, "")


def test_expand_hostlist() -> None:
    assert expand_hostlist("n[1-3,5]") == ["n1", "n2", "n3", "n5"]
    assert expand_hostlist("gpu07") == ["gpu07"]
    assert expand_hostlist("a[08-10],b1") == ["a08", "a09", "a10", "b1"]


def test_pending_then_running_grants_gpu_sets() -> None:
    m = CapacityManager("r", pending_timeout_s=60, grace_s=20)
    m.submitted("5", spec("r"), [2, 2], now_s=0)
    assert m.observe({"5+0": row("5+0", "PENDING"), "5+1": row("5+1", "PENDING")}, 1).events == []
    out = m.observe({"5+0": row("5+0", "RUNNING", "n1"), "5+1": row("5+1", "RUNNING", "n[2-3]")}, 2)
    assert out.events == [
        CapacityGranted(ElasticSource("5", 0), (("5+0:n1:gpu0", "5+0:n1:gpu1"),)),
        CapacityGranted(
            ElasticSource("5", 1),
            tuple((f"5+1:{n}:gpu{i}", f"5+1:{n}:gpu{i + 1}") for n in ("n2", "n3") for i in (0, 2)),
        ),
    ]
    # a second poll of the same states says nothing new
    again = m.observe({"5+0": row("5+0", "RUNNING"), "5+1": row("5+1", "RUNNING")}, 3)
    assert again.events == []


def test_pending_past_the_timeout_is_cancelled_and_reported() -> None:
    m = CapacityManager("r", pending_timeout_s=10, grace_s=20)
    m.submitted("5", spec("r"), [2, 2], now_s=0)
    jobs = {"5+0": row("5+0", "PENDING"), "5+1": row("5+1", "PENDING")}
    assert m.observe(jobs, 5).cancel == []
    out = m.observe(jobs, 11)
    assert out.cancel == [("5", None)]
    assert out.timed_out == [ElasticSource("5", 0), ElasticSource("5", 1)]
    m.observe({}, 12)
    assert m.live() == []


def test_vanished_running_component_is_reclaimed_now() -> None:
    m = CapacityManager("r", pending_timeout_s=10, grace_s=20)
    m.submitted("5", spec("r"), [2, 2], now_s=0)
    m.observe({"5+0": row("5+0", "RUNNING"), "5+1": row("5+1", "RUNNING")}, 1)
    out = m.observe({"5+0": row("5+0", "RUNNING")}, 7)
    assert out.events == [CapacityReclaimed(ElasticSource("5", 1), 7)]


def test_signal_gives_a_grace_deadline_and_release_cancels_one_component() -> None:
    m = CapacityManager("r", pending_timeout_s=10, grace_s=20)
    m.submitted("5", spec("r"), [2, 2], now_s=0)
    m.observe({"5+0": row("5+0", "RUNNING"), "5+1": row("5+1", "RUNNING")}, 1)
    assert m.signalled(ElasticSource("5", 0), 3) == CapacityReclaimed(ElasticSource("5", 0), 23)
    assert m.signalled(ElasticSource("5", 0), 4) is None  # already releasing
    assert m.release(ElasticSource("5", 1)) == ("5", 1)
    assert m.release(ElasticSource("5", 1)) is None
    m.observe({}, 5)  # both vanish: no reclaim for components already released
    assert m.live() == []
    with pytest.raises(TransitionError):
        m._move(m.components["5+0"], ComponentState.RUNNING)


def test_adopt_takes_over_this_runs_jobs() -> None:
    m = CapacityManager("r", pending_timeout_s=10, grace_s=20)
    m.adopt([row("9+0", "RUNNING"), row("9+1", "RUNNING")], 2, 2, now_s=0)
    out = m.observe({"9+0": row("9+0", "RUNNING"), "9+1": row("9+1", "RUNNING")}, 1)
    assert [e.source.tag for e in out.events] == ["9+0", "9+1"]


# ------------------------------------------------------------- real Slurm cluster
class SlurmCapacity:
    """The manager run against real Slurm, one call at a time (what the Slurm backend
    does from its watch)."""

    def __init__(self, manager: CapacityManager, client: SlurmClient) -> None:
        self.manager = manager
        self.client = client

    def acquire(self, spec: JobSpec, gpus_per_worker: int, now_s: float) -> str:
        job_id = self.client.submit(spec)
        self.manager.submitted(job_id, spec, [gpus_per_worker] * len(spec.components), now_s)
        return job_id

    def poll(self, now_s: float) -> list[CapacityGranted | CapacityReclaimed]:
        actions = self.manager.observe(self.client.poll(self.manager.run_tag), now_s)
        for job_id, component in actions.cancel:
            self.client.cancel(job_id, component)
        return actions.events

    def release(self, source: ElasticSource) -> None:
        target = self.manager.release(source)
        if target is not None:
            self.client.cancel(*target)


def wait_events(cap: SlurmCapacity, want: int, timeout_s: float = 60) -> list:
    events: list = []
    deadline = time.monotonic() + timeout_s
    while len(events) < want:
        events += cap.poll(time.monotonic())
        assert time.monotonic() < deadline, f"only {events}"
        time.sleep(0.3)
    return events


@pytest.mark.slurm
def test_elastic_hetjob_is_granted_released_and_reclaimed_when_it_vanishes(
    slurm_cluster: str, tmp_path: Path
) -> None:
    run = f"t{uuid.uuid4().hex[:8]}"
    client = SlurmClient(min_backoff_s=0.1)
    cap = SlurmCapacity(CapacityManager(run, pending_timeout_s=60, grace_s=20), client)
    t0 = time.monotonic()
    job_id = cap.acquire(spec(run, out=str(tmp_path / "e-%j.out")), gpus_per_worker=2, now_s=t0)
    try:
        granted = wait_events(cap, 2)
        assert [e.source for e in granted] == [ElasticSource(job_id, 0), ElasticSource(job_id, 1)]
        assert [len(e.gpu_sets) for e in granted] == [1, 2]
        cap.release(ElasticSource(job_id, 1))  # scancel JOB+1
        time.sleep(2)
        assert cap.poll(time.monotonic()) == []  # a release is not a reclaim
        assert set(client.poll(run)) == {f"{job_id}+0"}
        # component 0 disappears without our release (an admin's scancel; preemption of a
        # heterogeneous job, signal first, is covered by tests/test_slurm_run.py)
        client.cancel(job_id, 0)
        reclaimed = wait_events(cap, 1)
        assert reclaimed[0].source == ElasticSource(job_id, 0)
        assert isinstance(reclaimed[0], CapacityReclaimed)
    finally:
        client.cancel(job_id)
    deadline = time.monotonic() + 30
    while client.poll(run) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert client.poll(run) == {}


@pytest.mark.slurm
def test_job_pending_past_its_wait_is_cancelled(slurm_cluster: str, tmp_path: Path) -> None:
    run = f"t{uuid.uuid4().hex[:8]}"
    client = SlurmClient(min_backoff_s=0.1)
    cap = SlurmCapacity(CapacityManager(run, pending_timeout_s=2, grace_s=20), client)
    # --begin in an hour: it can only pend
    cap.acquire(
        spec(run, extra=("--begin=now+3600",), out=str(tmp_path / "p-%j.out")),
        2,
        now_s=time.monotonic(),
    )
    deadline = time.monotonic() + 30
    while cap.manager.live() and time.monotonic() < deadline:
        assert cap.poll(time.monotonic()) == []
        time.sleep(0.3)
    assert cap.manager.live() == []
    assert client.poll(run) == {}  # nothing leaked


# ------------------------------------------------------------ worker GPU ids


def test_gpu_ids_of() -> None:
    assert gpu_ids_of("12+1", "n3", 1, 2) == ["12+1:n3:gpu2", "12+1:n3:gpu3"]
    assert gpu_ids_of("12+1", "n3", 0, 2) == ["12+1:n3:gpu0", "12+1:n3:gpu1"]
    assert gpu_ids_of("7+0", "a", 3, 1) == ["7+0:a:gpu3"]


@pytest.mark.parametrize(("gpus_per_node", "gpus_per_worker"), [(4, 2), (8, 2), (8, 1), (8, 8)])
def test_gpu_ids_of_matches_capacity_gpu_sets(gpus_per_node: int, gpus_per_worker: int) -> None:
    source = ElasticSource("12", 1)
    comp = Component(
        source,
        gpus_per_node,
        gpus_per_worker,
        state=ComponentState.RUNNING,
        nodes=("n3", "n4"),
    )
    per_node = gpus_per_node // gpus_per_worker
    from_workers = [
        tuple(gpu_ids_of(source.tag, node, local, gpus_per_worker))
        for node in comp.nodes
        for local in range(per_node)
    ]
    assert list(comp.gpu_sets()) == from_workers
    if (gpus_per_node, gpus_per_worker) == (4, 2):
        assert comp.gpu_sets()[1] == ("12+1:n3:gpu2", "12+1:n3:gpu3")
