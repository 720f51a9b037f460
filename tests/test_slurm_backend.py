"""The Slurm backend's standing requests (one module, with its Slurm edge): they follow
the controller's demand (single jobs from pools in turn, or one heterogeneous job;
requests not started are withdrawn when the demand drops; a request pending too long is
asked again of the next pool); a bad partition on the real local cluster is reported and
the run goes on; sbatch meeting an unreachable slurmctld is retried from the watch."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from pearl_hpc.backends import slurm as backend_mod
from pearl_hpc.backends.slurm import SlurmBackend
from pearl_hpc.cli.view import format_pools
from pearl_hpc.config.run import ElasticConfig, PoolConfig, RunConfig
from pearl_hpc.config.slurm import SlurmSettings
from pearl_hpc.core.types import Role
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.capacity import BackendContext
from pearl_hpc.slurm.client import CommandResult, SlurmClient
from pearl_hpc.slurm.parse import SQUEUE_FORMAT
from pearl_hpc.slurm.scripts import HetComponent, JobSpec
from tests.test_controller import running_base


class _NoMembers:
    """The world the elastic ranks would join: none join in these tests."""

    def group_state(self, group: str) -> set[Any]:
        return set()

    def leave(self, group: str) -> None:
        pass

    def left(self, group: str) -> bool:
        return True


def _backend(
    tmp_path: Path, *pools: PoolConfig, clock: Any = lambda: 0.0, **elastic: Any
) -> tuple[SlurmBackend, list[tuple[str, dict]]]:
    events: list[tuple[str, dict]] = []
    cfg = RunConfig(
        name="t",
        backend="slurm",
        slurm=SlurmSettings(poll_s=0.2),
        elastic=ElasticConfig(
            **{"grace_s": 15.0, "pools": list(pools) or [PoolConfig()], **elastic}
        ),
    )
    backend = SlurmBackend(
        BackendContext(
            cfg=cfg,
            run_dir=tmp_path,
            model_dir="m",
            members=_NoMembers(),  # type: ignore[arg-type]
            queue=asyncio.Queue(),
            clock=clock,
            on_event=lambda kind, fields: events.append((kind, fields)),
            decide_now=lambda: None,
            first_step=0,
            resume=False,
        )
    )
    return backend, events


class FakeSlurm:
    """sbatch / squeue / scancel as a tiny scheduler that starts nothing by itself:
    submitted jobs stay PENDING until :meth:`start` (scancel removes them)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.jobs: dict[str, tuple[int, str, list[str]]] = {}  # id -> components, state, parts
        self.scripts: list[str] = []
        self.cancelled: list[str] = []
        self.start_in: dict[str, float | None] = {}  # partition -> --test-only's estimate

    def start(self, job_id: str) -> None:
        size, _, parts = self.jobs[job_id]
        self.jobs[job_id] = (size, "RUNNING", parts)

    def __call__(self, argv: Any, stdin: str | None = None) -> CommandResult:
        if argv[0] == "sbatch" and "--test-only" in argv:  # when it would start; no job
            (part,) = [x.split("=", 1)[1] for x in (stdin or "").split() if "--partition=" in x]
            seconds = self.start_in.get(part, 0.0)
            if seconds is None:
                return CommandResult(0, "", "sbatch: Job 7 has no start estimate\n")
            at = datetime.fromtimestamp(time.time() + seconds).strftime("%Y-%m-%dT%H:%M:%S")
            return CommandResult(0, "", f"sbatch: Job 7 to start at {at} using 1 processors "
                                 f"on nodes n1 in partition {part}\n")  # fmt: skip
        if argv[0] == "sbatch":
            job_id = str(100 + len(self.scripts))
            self.scripts.append(stdin or "")
            parts = [
                line.split("=", 1)[1]
                for line in (stdin or "").splitlines()
                if line.startswith("#SBATCH --partition=")
            ]
            self.jobs[job_id] = (len(parts), "PENDING", parts)
            return CommandResult(0, f"{job_id}\n", "")
        if argv[0] == "scancel":
            self.cancelled.append(argv[-1])
            self.jobs.pop(argv[-1].split("+")[0], None)
            return CommandResult(0, "", "")
        assert argv[0] == "squeue" and SQUEUE_FORMAT in argv
        lines = []
        for job_id, (size, state, parts) in self.jobs.items():
            for k in range(size):
                key = f"{job_id}+{k}" if size > 1 else job_id
                nodes = f"n{k + 1}" if state == "RUNNING" else ""
                start = "N/A" if state == "PENDING" else "2026-12-04T01:00:00"
                fields = [key, state, "pearl-elastic", f"pearl:{self.tag}", parts[k], nodes, "-"]
                fields.append(start)
                lines.append("|".join(fields))
        return CommandResult(0, "\n".join(lines) + "\n", "")


def _run(backend: SlurmBackend, *steps: Any) -> None:
    """Each step: a demand (int), or a callable run between two watch rounds."""

    async def go() -> None:
        for step in steps:
            if isinstance(step, int):
                backend.want(step)
            else:
                step()
            await backend._watch_once()
        await backend.close()

    asyncio.run(go())


def test_single_requests_follow_the_demand_and_pools_take_turns(tmp_path: Path) -> None:
    backend, events = _backend(tmp_path, PoolConfig(partition="a"), PoolConfig(partition="b"))
    slurm = FakeSlurm(backend.tag)
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)
    held: list[int] = []
    _run(
        backend,
        3,  # three one-worker jobs, pools a, b, a
        lambda: slurm.start("100"),
        lambda: held.append(backend.live_workers()),
        1,  # two pending requests withdrawn (newest first); the running one stays
        lambda: held.append(backend.live_workers()),
        0,  # the running worker is not cancelled: the controller gives it back
    )
    submitted = [f for k, f in events if k == "submitted"]
    assert [s["pools"] for s in submitted] == [["a"], ["b"], ["a"]]
    assert [f["job"] for k, f in events if k == "withdrawn"] == ["102", "101"]
    assert held == [1, 1]
    granted = backend.queue.get_nowait()
    assert granted.source.tag == "100+0" and granted.gpu_sets == (("100+0:n1:gpu0",),)
    assert "--signal=B:USR2@60" in slurm.scripts[0]
    summary = backend.summary()
    assert summary["requested"] == 3 and summary["granted"] == 1


def test_a_single_request_goes_to_the_pool_slurm_would_start_it_in_soonest(
    tmp_path: Path,
) -> None:
    """sbatch --test-only per pool (nothing submitted): the request goes where Slurm
    estimates the earliest start; a pool without an estimate comes last; ties keep the
    turn. The estimates are in the submitted event."""
    pools = (PoolConfig(partition="a"), PoolConfig(partition="b"), PoolConfig(partition="c"))
    backend, events = _backend(tmp_path, *pools)
    slurm = FakeSlurm(backend.tag)
    slurm.start_in = {"a": 3600.0, "b": None, "c": 120.0}
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)
    _run(backend, 1, lambda: slurm.start_in.update(c=3600.0, a=600.0), 2, 3)
    submitted = [f for k, f in events if k == "submitted"]
    assert [s["pools"] for s in submitted] == [["c"], ["a"], ["a"]]
    (a, b, c) = submitted[0]["start_estimates"]  # the turn's pool (a) first
    assert a[:2] == [0, "a"] and b == [1, "b", None] and c[:2] == [2, "c"]
    assert a[2] == pytest.approx(3600, abs=5) and c[2] == pytest.approx(120, abs=5)
    assert len(slurm.scripts) == 3  # test-only submitted nothing


def test_the_expected_start_of_a_request_made_now_is_slurms_last_estimate(
    tmp_path: Path,
) -> None:
    """starts_in_s (what the expansion gate at request time takes): 0 while nothing is
    known; after a submission the soonest --test-only estimate, counted down and kept
    after the request is withdrawn; back to 0 once Slurm starts a request."""
    backend, _ = _backend(tmp_path, PoolConfig(partition="a"), PoolConfig(partition="b"))
    slurm = FakeSlurm(backend.tag)
    slurm.start_in = {"a": 900.0, "b": 300.0}
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)
    seen: list[float] = []
    _run(
        backend,
        lambda: seen.append(backend.starts_in_s()),
        1,
        lambda: seen.append(backend.starts_in_s()),
        0,  # withdrawn
        lambda: seen.append(backend.starts_in_s()),
        1,
        lambda: slurm.start(backend.jobs[-1]),
        lambda: seen.append(backend.starts_in_s()),
    )
    assert seen[0] == 0.0
    assert seen[1] == pytest.approx(300, abs=5) and seen[2] == pytest.approx(300, abs=5)
    assert seen[3] == 0.0


def test_a_kept_start_estimate_is_asked_again_and_follows_nodes_going_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A withdrawn request's far estimate (Slurm plans by the running jobs' time limits)
    is asked again by ``sbatch --test-only`` once ESTIMATE_RENEW_S old while nothing is
    pending: when the other users' jobs end early, the request made now starts at once
    and the gate sees it; never while a request is pending (squeue carries its own)."""
    backend, _ = _backend(tmp_path, PoolConfig(partition="a"), PoolConfig(partition="b"))
    slurm = FakeSlurm(backend.tag)
    slurm.start_in = {"a": 3600.0, "b": 7200.0}
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)
    seen: list[float] = []
    _run(
        backend,
        1,
        0,  # withdrawn: an hour's estimate kept
        lambda: seen.append(backend.starts_in_s()),
        lambda: slurm.start_in.update(a=None, b=0.0),  # b's nodes went idle
        lambda: seen.append(backend.starts_in_s()),  # not asked yet: still an hour
        lambda: monkeypatch.setattr(backend_mod, "ESTIMATE_RENEW_S", 0.0),
        lambda: seen.append(backend.starts_in_s()),
    )
    assert seen[0] == pytest.approx(3600, abs=5) and seen[1] == pytest.approx(3600, abs=5)
    assert seen[2] == pytest.approx(0, abs=2)
    assert len(slurm.scripts) == 1  # one request only: --test-only submits nothing


def test_a_hetjob_request_is_one_job_of_every_pools_components(tmp_path: Path) -> None:
    pools = (
        PoolConfig(partition="a", gpus_per_worker=2, hetjob_workers=1, qos="low", role="prefill"),
        PoolConfig(partition="b", hetjob_workers=2, signal_lead_s=30),
    )
    backend, events = _backend(tmp_path, *pools, request="hetjob")
    slurm = FakeSlurm(backend.tag)
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)
    _run(backend, 1, lambda: slurm.start("100"), 1)
    (submitted,) = [f for k, f in events if k == "submitted"]
    assert submitted["pools"] == ["a", "b", "b"]
    script = slurm.scripts[0]
    assert script.count("#SBATCH hetjob") == 2 and "--qos=low" in script
    assert "--gres=gpu:2" in script and "--gpus=2,1,1" in script
    assert "--signal=B:USR2@30" in script  # the shortest lead of its pools
    grant = backend.queue.get_nowait()  # the three components, one decision
    assert [grant.source.tag, *(g.source.tag for g in grant.also)] == ["100+0", "100+1", "100+2"]
    assert [grant.role, *(g.role for g in grant.also)] == [Role.PREFILL, None, None]
    assert grant.gpu_sets == (("100+0:n1:gpu0", "100+0:n1:gpu1"),)
    assert slurm.cancelled == ["100"] and not slurm.jobs  # closed: the whole job cancelled


def test_a_request_pending_too_long_is_asked_again_of_the_next_pool(tmp_path: Path) -> None:
    now = [0.0]
    pools = (PoolConfig(partition="a"), PoolConfig(partition="b"))
    backend, events = _backend(tmp_path, *pools, clock=lambda: now[0], pending_timeout_s=10)
    slurm = FakeSlurm(backend.tag)
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)
    _run(backend, 1, lambda: now.__setitem__(0, 5.0), lambda: now.__setitem__(0, 11.0))
    assert [f["component"] for k, f in events if k == "pending_timeout"] == ["100+0"]
    assert [f["pools"] for k, f in events if k == "submitted"] == [["a"], ["b"]]
    assert "100" in slurm.cancelled


def test_a_resumed_master_adopts_running_and_pending_requests(tmp_path: Path) -> None:
    """A dead master's two requests, one running and one pending, found by tag: both
    adopted (the running one granted when squeue shows it), nothing resubmitted for a
    demand of two."""
    backend, events = _backend(tmp_path, PoolConfig(partition="a"))
    slurm = FakeSlurm(backend.tag)
    slurm.jobs = {"90": (1, "RUNNING", ["a"]), "91": (1, "PENDING", ["a"])}
    backend.client = SlurmClient(slurm, min_backoff_s=0.0)

    async def go() -> None:
        await backend.adopt_leftovers()
        backend.want(2)
        await backend._watch_once()
        await backend.close()

    asyncio.run(go())
    (adopted,) = [f for k, f in events if k == "adopted"]
    assert adopted == {"jobs": ["90", "91"], "components": ["90+0", "91+0"]}
    assert not [f for k, f in events if k == "submitted"]
    granted = backend.queue.get_nowait()
    assert granted.source.tag == "90+0" and backend.queue.empty()


@pytest.mark.slurm
def test_a_bad_partition_is_reported_and_the_run_goes_on(
    slurm_cluster: str, tmp_path: Path
) -> None:
    backend, events = _backend(tmp_path, PoolConfig(partition="no-such-partition"))

    async def go() -> None:
        backend.want(2)
        await backend._request()  # raises nothing
        await backend._request()  # the pool is not asked again
        await backend.close()

    asyncio.run(go())
    failed = [f for k, f in events if k == "submit_failed"]
    assert len(failed) == 1 and not failed[0]["retry"]
    assert "partition" in failed[0]["error"].lower()
    assert backend.summary()["errors"] and backend.jobs == []
    # shown where the run's workers are (the live line, status) and in the summary
    (row,) = backend.describe()
    assert (row["state"], row["pool"]) == ("refused", "no-such-partition")
    assert format_pools(backend.describe()) == "no-such-partition: 1 refused"
    assert "partition" in backend.summary()["refused_pools"]["no-such-partition"].lower()


@pytest.mark.slurm
def test_a_refused_pool_ends_a_strict_run_with_one_line(
    slurm_cluster: str, tmp_path: Path
) -> None:
    backend, _ = _backend(tmp_path, PoolConfig(partition="no-such-partition"), strict=True)

    async def go() -> None:
        backend.want(1)
        await backend._request()
        try:
            with pytest.raises(ConfigError, match=r"elastic.pools\[0\] \(no-such-partition\)"):
                await backend.before_rollout(0, lambda _: None)
        finally:
            await backend.close()

    asyncio.run(go())


@pytest.mark.slurm
def test_on_the_cluster_a_request_goes_where_slurm_would_start_it_soonest(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Other users hold n1 for 10 minutes and n2 for 2 (their time limits): sbatch
    --test-only estimates a worker pinned to n2 to start ~8 minutes sooner, so the
    single request goes to that pool though n1's pool has the turn; once it is pending,
    squeue's expected start of it shows in describe() (status, the live line). When the
    run is predicted to end before that start, the gated demand is 0 and the request is
    withdrawn."""
    others = SlurmClient()
    busy = [
        others.submit(
            JobSpec(
                "others",
                f"others-{tmp_path.name}",
                (HetComponent("high", gpus_per_node=8, time_limit=limit, extra=(f"-w{node}",)),),
                ["sleep", "600"],
                signal=None,
                output=str(tmp_path / "others-%j.out"),
            )
        )
        for node, limit in (("n1", "10:00"), ("n2", "2:00"))
    ]
    pools = [
        PoolConfig(partition="elastic", time_limit="5:00", sbatch_extra=[f"-w{node}"])
        for node in ("n1", "n2")
    ]
    backend, events = _backend(tmp_path, *pools)
    try:
        deadline = time.monotonic() + 60
        while {r.state for r in others.poll(f"others-{tmp_path.name}").values()} != {"RUNNING"}:
            assert time.monotonic() < deadline, "the other users' jobs did not start"
            time.sleep(0.3)

        async def go() -> tuple[list[dict[str, Any]], float, int]:
            backend.want(1)
            await backend._request()
            described = []
            for _ in range(40):  # the backfill pass estimates it within seconds
                await backend._watch_once()
                described = backend.describe()
                if described and "starts_in_s" in described[0]:
                    break
                await asyncio.sleep(0.5)
            # the run ends before Slurm would start it: the expansion gate at request
            # time wants nobody, and the standing request is withdrawn
            starts_in = backend.starts_in_s()
            gated, _, clock = running_base(
                1, expansion="gated", expected_capacity_window_s=3600.0, preparation_s=10.0
            )
            assert gated.elastic_demand(1).workers == 1  # open-ended: worth it
            gated.expect_end(clock() + starts_in / 2)
            demand = gated.elastic_demand(1, starts_in_s=starts_in)
            backend.want(demand.workers)
            await backend._watch_once()
            await backend.close()  # nothing left: it never started
            return described, starts_in, demand.workers

        described, starts_in, wanted = asyncio.run(go())
    finally:
        for job_id in busy:
            others.cancel(job_id)
    (submitted,) = [f for k, f in events if k == "submitted"]
    assert submitted["pools"] == ["elastic"] and len(backend.jobs) == 1
    (n1, n2) = submitted["start_estimates"]
    assert n1[0] == 0 and n2[0] == 1 and n1[2] is not None and n2[2] is not None
    assert 60 < n2[2] < 180 and n1[2] - n2[2] > 300, submitted
    (pending,) = described
    assert pending["state"] == "pending" and abs(pending["starts_in_s"] - n2[2]) < 30, described
    assert backend.pool_of[f"{backend.jobs[0]}+0"] == 1  # n2's pool
    assert abs(starts_in - pending["starts_in_s"]) < 10 and wanted == 0
    assert [f["job"] for k, f in events if k == "withdrawn"] == backend.jobs
    assert not list((tmp_path / "elastic").glob("job-*.out"))  # the request never ran


def test_sbatch_meeting_an_unreachable_controller_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend_mod, "SUBMIT_RETRY_S", 0.0)
    calls: list[str] = []

    def runner(argv: Any, stdin: str | None = None) -> CommandResult:
        calls.append(argv[0])
        if argv[0] == "sbatch":
            if calls.count("sbatch") == 1:
                return CommandResult(1, "", "sbatch: error: Unable to contact slurm controller")
            return CommandResult(0, "4242\n", "")
        return CommandResult(0, "", "")  # squeue: nothing yet; scancel: done

    backend, events = _backend(tmp_path)
    backend.client = SlurmClient(runner, min_backoff_s=0.01)

    async def go() -> None:
        backend.want(1)
        await backend._request()
        await backend._watch_once()  # the retry is the watch's
        await backend.close()

    asyncio.run(go())
    kinds = [k for k, _ in events]
    assert kinds.count("submit_failed") == 1 and dict(events)["submit_failed"]["retry"]
    assert "submitted" in kinds and backend.jobs == ["4242"]
