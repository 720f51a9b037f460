"""`pearl-hpc run` on the Slurm backend, on the local cluster, with real engines: the
master is a batch job (`pearl-hpc run CONFIG --sbatch`); elastic engine workers are a standing
heterogeneous request on the preemptible partition that Slurm starts when other users'
jobs free two nodes and preempts when they come back; the master is SIGKILLed mid-run
and the batch job's launcher resumes it by itself (run.max_restarts), adopting the
elastic job it finds by tag (its ranks join the new world; nothing is cancelled or
resubmitted). Afterwards no job of the run
is in squeue and no process of it is left.

Four engine processes at most (reserved, overlap, two elastic)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pearl_hpc.backends.slurm import run_tag_of
from pearl_hpc.rundir import RunDir, read_jsonl
from tests import other_user
from tests.conftest import resume_drained_nodes, vllm_skip_reason
from tests.test_local_run import CONFIG as LOCAL_CONFIG
from tests.test_local_run import MEASURED, check_replay

REPO = Path(__file__).resolve().parents[1]
BATCH = 4 * 4
# enough steps that the first master is still running when its elastic engines are
# admitted (their start takes 20-110 s here; a fast machine runs a step in ~3 s)
STEPS = 12
STEPS_SUBMITIT = 10
OTHERS = "others"  # the --comment of other users' jobs

# the site's env and setup lines (slurm.env, slurm.setup): every job of the run runs
# them first, and every process of it inherits them
PROBE = "site-env-applied"
SITE = {
    "env": {"PEARL_SITE_PROBE": PROBE},
    "setup": ['echo "site setup ran: PEARL_SITE_PROBE=$PEARL_SITE_PROBE"'],
}
SETUP_RAN = f"site setup ran: PEARL_SITE_PROBE={PROBE}"
# the ranks in an apptainer image: no apptainer can be installed here, so tests/bin's
# stand-in runs each command on the host with PEARL_TEST_IMAGE set (the wiring, every
# rank through the runtime, is under test; the runtime itself is not)
IMAGE = "/images/pearl.sif"
IN_IMAGE = {
    "container": {"runtime": "apptainer", "image": IMAGE, "mounts": ["/tmp:/tmp"],
                  "python": sys.executable},
    "setup": [*SITE["setup"], f"export PATH={REPO / 'tests' / 'bin'}:$PATH"],
}  # fmt: skip

CONFIG = {
    **LOCAL_CONFIG,  # the local run test's workload and ungated policies
    "cluster": "local",  # configs/clusters/local.yaml: its typed GPUs, time, MPI plugin
    "backend": "slurm",
    # the dead master's elastic job outlives it until the resumed master adopts it (its
    # lease would end it after lease_timeout_s; a loaded machine takes minutes to resume)
    "slurm": {"poll_s": 0.5, "lease_timeout_s": 600, **SITE},
    "elastic": {
        "grace_s": 15,  # the elastic partition's GraceTime is 20 s
        "max_workers": 2,
        "request": "hetjob",
        "pools": [{"partition": "elastic", "sbatch_extra": ["--exclusive"], "hetjob_workers": 2}],
    },
    "run": {**LOCAL_CONFIG["run"], "steps": STEPS},
    # elasticity under test, not the objective: the engines skip the per-token log-softmax
    # over the vocabulary (as costly as the tiny model's forward on these 2 cores)
    "train": {"correction": "none", "record_logprobs": False},
}


class OtherUsers:
    """Other users' jobs on the high partition, one whole node each: what a busy cluster
    does to the preemptible partition (Slurm preempts an elastic job for one)."""

    def __init__(self) -> None:
        self.jobs: list[str] = []

    def take(self, nodes: int) -> None:
        argv = ["-p", "high", "--exclusive", f"--comment={OTHERS}", "-o", "/dev/null"]
        for _ in range(nodes):
            self.jobs.append(_sbatch([*argv, "--wrap", "sleep 100000"], dict(os.environ)))

    def give(self, nodes: int) -> None:
        for _ in range(nodes):
            subprocess.run(["scancel", self.jobs.pop()], check=True)

    def running(self) -> int:
        return _squeue("%k|%T").count(f"{OTHERS}|RUNNING")

    def end(self) -> None:
        if self.jobs:
            subprocess.run(["scancel", *self.jobs], check=False)
        self.jobs.clear()


def _sbatch(args: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", *([] if "-p" in args else ["-p", "normal"]), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def _submit(config: Path, env: dict[str, str]) -> tuple[str, Path, Path]:
    """``pearl-hpc run CONFIG --sbatch``: (job id, run directory, the job's log)."""
    out = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", str(config), "--sbatch"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]  # pearl-hpc run: batch job N, run directory D
    job, run_dir = first.split("batch job ")[1].split(", run directory ")
    return job, Path(run_dir), Path(run_dir) / f"batch-{job}.out"


def _without_site_env(run_dir: Path, image: bool = False) -> list[str]:
    """The run's live rank processes (base and elastic) whose environment lacks the
    site's variable (``image``: or the image's, with its mount; read from /proc: the
    local cluster's nodes are this host)."""
    lacking = []
    site = f"PEARL_SITE_PROBE={PROBE}".encode()
    in_image = [f"PEARL_TEST_IMAGE={IMAGE}".encode(), b"--nv --bind /tmp:/tmp"]
    for proc in _rank_processes(run_dir):
        launcher = _cmdline(proc).split(" ")[0].endswith("srun")  # (starts the image)
        want = [site, *(in_image if image and not launcher else [])]
        try:
            environ = (proc / "environ").read_bytes()
            if not all(w in environ for w in want):
                lacking.append(_cmdline(proc))
        except OSError:
            continue  # gone meanwhile
    return lacking


def _rank_processes(run_dir: Path) -> list[Path]:
    return [
        proc
        for proc in Path("/proc").glob("[0-9]*")
        if "pearl_hpc.rank" in (cmd := _cmdline(proc)) and str(run_dir) in cmd
    ]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _squeue(fmt: str, timeout_s: float = 60.0) -> list[str]:
    """Every job's line of ``squeue -o FMT``. A failed call (slurmctld busy or restarting)
    is tried again, never read as an empty queue (a test would see its jobs gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["squeue", "-h", "-o", fmt], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.splitlines()
        if time.monotonic() > deadline:
            raise AssertionError(f"squeue kept failing: {out.stderr.strip()}")
        time.sleep(1.0)


def _in_squeue(job_id: str) -> bool:
    """A job (each component of a heterogeneous one is listed as ID+N) is in squeue."""
    return any(j.partition("+")[0] == job_id for j in _squeue("%i"))


def _states(comment: str) -> dict[str, str]:
    rows = [line.split("|") for line in _squeue("%i|%k|%T")]
    return {job: state for job, k, state in rows if k == comment}


def _tagged(comment: str) -> list[str]:
    return list(_states(comment))


def _wait(  # type: ignore[no-untyped-def]
    what: str, cond, timeout_s: float, log: Path | None = None, poll_s: float = 1.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail}")
        time.sleep(poll_s)


def _elastic_logs(run_dir: Path) -> str:
    """The tails of the run's elastic job logs and member logs (what a failure shows)."""
    logs = sorted((run_dir / "elastic").glob("job-*.out")) + sorted(run_dir.glob("rank*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)


def _ended_without_summary(master: str, log: Path, run_dir: Path, conf: Path) -> str:
    """What a master that left no summary shows: how Slurm saw it end, its log, the last
    events and the other ranks' logs."""
    acct = subprocess.run(["scontrol", "-o", "show", "job", master], capture_output=True, text=True)
    events = (run_dir / "events.jsonl").read_text().splitlines()[-15:]
    logs = conf.parent / "log"
    slurm = [
        f"{p.name}: {line}"
        for p in sorted(logs.glob("*.log"))
        for line in p.read_text(errors="replace").splitlines()
        if f"JobId={master}" in line or f"job {master}" in line or f"StepId={master}." in line
    ]
    return (
        f"the master left no summary\n--- scontrol show job\n{acct.stdout}{acct.stderr}"
        "--- Slurm's logs on it\n" + "\n".join(slurm[-30:]) + "\n"
        f"--- master log\n{log.read_text()[-4000:]}\n--- last events\n"
        + "\n".join(events)
        + f"\n{_elastic_logs(run_dir)}"
    )


def _kinds(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_slurm_run_harvests_a_standing_request_master_killed_and_resumed(
    slurm_cluster: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    doc = {**CONFIG, "slurm": {**CONFIG["slurm"], **IN_IMAGE}, "runs_dir": str(tmp_path / "runs")}
    config.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PEARL_HPC_CACHE": str(tmp_path / "cache")}
    others = OtherUsers()
    others.take(3)  # every node but the one the master's job will get
    _wait("other users' jobs running", lambda: others.running() == 3, 60)
    first, run_dir, first_log = _submit(config, env)
    masters = [first]
    tag = run_tag_of(run_dir)

    def elastic_serving() -> bool:
        events = read_jsonl(run_dir / "events.jsonl")
        return any(e["kind"] == "admit" and any(s > 2 for s in e["slots"]) for e in events)

    try:
        # the request waits in squeue while other users hold the nodes: nothing granted
        _wait("the standing request", lambda: _kinds(run_dir, "submitted"), 300, first_log)
        time.sleep(3)
        assert set(_states(f"pearl:{tag}").values()) == {"PENDING"}
        events = read_jsonl(run_dir / "events.jsonl")
        assert not [e for e in events if e.get("event") == "CapacityGranted"]
        others.give(2)  # two nodes idle: Slurm starts the heterogeneous request
        # killed as soon as the elastic workers serve: the resumed master still has most
        # steps to roll out (a step whose trajectories were all logged takes no time)
        try:
            _wait("the elastic workers admitted", elastic_serving, 600, first_log, poll_s=0.05)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_elastic_logs(run_dir)}") from None
        # the site's env and setup reached the base job and the elastic job, and every
        # rank of both runs in the image: 4 base ranks, 2 elastic ones
        assert SETUP_RAN in first_log.read_text()
        elastic_out = "".join(p.read_text() for p in (run_dir / "elastic").glob("job-*.out"))
        assert SETUP_RAN in elastic_out, elastic_out[-2000:]
        assert len(_rank_processes(run_dir)) >= 6 and _without_site_env(run_dir, True) == []
        master_pid = RunDir(run_dir).read_state()["pid"]
        os.kill(master_pid, signal.SIGKILL)  # gforker ends the world; the launcher resumes it

        def rejoined() -> bool:
            events = read_jsonl(run_dir / "events.jsonl")
            at = [i for i, e in enumerate(events) if e["kind"] == "adopted"]
            if not at:
                return False
            joined = [e for e in events[at[0] :] if e["kind"] == "joined" and "+" in e["group"]]
            return len(joined) == 2

        _wait("the adopted ranks to join the resumed world", rejoined, 600, first_log)
        assert "restart 1 of 3 (run.max_restarts)" in first_log.read_text()
        others.take(2)  # other users come back: Slurm preempts the elastic job
        _wait("the resumed run to finish", lambda: not _in_squeue(first), 900, first_log)
        print(first_log.read_text()[-3000:])
    finally:
        for job in masters + _tagged(f"pearl:{tag}"):
            subprocess.run(["scancel", job], check=False)
        others.end()

    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    c = summary["counters"]
    # every step trained on its whole batch, across the kill, the grants and the preemption
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["trajectories"] for m in metrics] == [BATCH] * STEPS
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    # the resumed master adopted the dead master's elastic job it found by tag: both its
    # components' ranks joined the first world, then the resumed one; none resubmitted
    (at,) = [i for i, e in enumerate(events) if e["kind"] == "adopted"]
    job = next(e["job"] for e in events if e["kind"] == "submitted")
    assert events[at]["jobs"] == [job]
    assert events[at]["components"] == [f"{job}+0", f"{job}+1"]
    elastic = [e for e in events if e["kind"] == "joined" and "+" in e["group"]]
    before = {e["group"] for e in elastic if events.index(e) < at}
    after = sorted(e["group"] for e in elastic if events.index(e) > at)
    assert before and after == [f"{job}+0", f"{job}+1"], (before, after)
    # one heterogeneous request of two components, granted in one decision
    submitted = [e for e in events if e["kind"] == "submitted"]
    assert submitted[0]["job"] == job and submitted[0]["components"] == 2, submitted
    assert not [e for e in events[:at] if e["kind"] == "submitted" and e["job"] != job]
    both = [e for e in events if e["kind"] == "reconfigure" and ", " in e["cause"]]
    assert both and all(e["cause"].startswith("capacity granted by") for e in both)
    # the reclaim is Slurm's preemption: the job's signal, drained before the grace ended
    (sig,) = [e for e in events[at:] if e["kind"] == "signal"]
    assert sig["job"] == job
    reclaimed = [
        e for e in events if e.get("event") == "CapacityReclaimed" and e["t_s"] >= sig["t_s"]
    ]
    assert len(reclaimed) == 2 and all(
        e["deadline_s"] == pytest.approx(e["t_s"] + 15, abs=1) for e in reclaimed
    )
    scancel = next(e for e in events if e["kind"] == "scancel" and e["t_s"] >= sig["t_s"])
    assert scancel["t_s"] - sig["t_s"] < 15
    # the demand stands: asked again after the reclaim, pending until the run ended
    assert any(e["kind"] == "submitted" and e["t_s"] > sig["t_s"] for e in events)
    assert c["grows"] >= 3 and c["reclaims"] >= 2  # 2 granted + 2 adopted; 2 preempted
    assert c["borrow_cycles"] >= 1 and c["mode_changes"] >= 1
    assert len(c["return_latency_s"]) == STEPS  # borrowed GPUs returned before every step
    status = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "status", str(run_dir), "--json"],
        capture_output=True,
        text=True,
    )
    assert json.loads(status.stdout)["status"] == "finished", status.stderr
    # nothing of the run is left: no job in squeue, no process
    _wait("the run's jobs to leave squeue", lambda: not _tagged(f"pearl:{tag}"), 60)
    stray = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert stray.stdout.strip() == "", f"processes of the run left: {stray.stdout}"
    # private from the first byte, the Slurm jobs' logs too (sbatch passes the umask on)
    assert other_user.open_to_others(run_dir) == []


STEPS_FAULTS = 12


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_slurm_run_survives_a_slurmctld_outage_and_a_killed_elastic_rank(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """Other users hold two of the three free nodes (slurm/replay-load replaying a flat
    trace). Once the elastic rank serves: slurmctld is stopped for 20 s (a failed squeue
    keeps the last known state: the master declares nobody gone and keeps training),
    then the elastic rank is SIGKILLed (declared failed, out of the role groups, its
    job given back, and asked for again: the demand stands). Every step trains its
    whole batch; nothing is left."""
    config = tmp_path / "run.yaml"
    doc = {
        **CONFIG,
        "elastic": {**CONFIG["elastic"], "request": "single", "max_workers": 1},
        "run": {**CONFIG["run"], "steps": STEPS_FAULTS},
        "runs_dir": str(tmp_path / "runs"),
    }
    config.write_text(yaml.safe_dump(doc))
    trace = tmp_path / "flat.csv"
    trace.write_text("0,1\n3600,1\n")  # one node of three idle, for an hour
    load = subprocess.Popen(
        [sys.executable, "slurm/replay-load", "--file", str(trace), "--speedup", "1",
         "--nodes", "3", "--tag", "faults", "--log", str(tmp_path / "load.jsonl")],
        cwd=REPO, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    _wait("other users' jobs", lambda: len(_tagged("loadgen:faults")) == 2, 60)
    env = {**os.environ, "PEARL_HPC_CACHE": str(tmp_path / "cache")}
    master, run_dir, log = _submit(config, env)
    conf = Path(slurm_cluster)
    try:
        tag = run_tag_of(run_dir)

        def turns_logged() -> int:  # trajectory turns the master has logged
            logs = (run_dir / "trajectories").glob("step-*.jsonl")
            return sum(len(p.read_text().splitlines()) for p in logs)

        def serving() -> bool:  # the elastic worker admitted and the rollout going (it
            # can be ready before the base engines are)
            events = read_jsonl(run_dir / "events.jsonl")
            admitted = any(e["kind"] == "admit" and any(s > 2 for s in e["slots"]) for e in events)
            return admitted and turns_logged() > 0

        try:
            _wait("the elastic worker serving", serving, 600, log, poll_s=0.1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_elastic_logs(run_dir)}") from None

        before = turns_logged()
        # slurmctld away for 20 s: longer than squeue's own ~9 s of connection retries
        pid_file = conf.parent / "run" / "slurmctld.pid"
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        time.sleep(20)
        during = turns_logged() - before
        subprocess.run(["slurmctld", "-f", str(conf)], check=True)
        _wait("slurmctld back", lambda: "is UP" in subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True).stdout, 30)  # fmt: skip
        resume_drained_nodes()
        assert _in_squeue(master), f"the master did not survive the outage\n{log.read_text()}"
        assert during > 0, "the master's rollout stood still during the outage"
        events = read_jsonl(run_dir / "events.jsonl")
        (joined,) = [e for e in events if e["kind"] == "joined" and "+" in e["group"]]
        member, pid = next(iter(joined["members"].items()))
        # no collective spans the members: killed whenever, mid-rollout
        os.kill(int(pid), signal.SIGKILL)
        _wait("the run to finish", lambda: not _in_squeue(master), 900, log)
        print(log.read_text()[-2000:])
    finally:
        subprocess.run(["scancel", master], check=False)
        for job in _tagged(f"pearl:{tag}"):
            subprocess.run(["scancel", job], check=False)
        load.terminate()
        load.wait(60)

    assert (run_dir / "summary.json").exists(), _ended_without_summary(master, log, run_dir, conf)
    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["trajectories"] for m in metrics] == [BATCH] * STEPS_FAULTS  # nothing lost
    # (whether a squeue call failed, or its own retries outlasted the outage, depends on
    # when it started: not asserted)
    print(f"squeue calls that failed: {summary['slurm']['poll_failures']}")
    assert summary["slurm"]["errors"] == []
    # the outage declared nobody gone; the kill did, once, and only the killed rank
    failed = [e for e in events if e["kind"] == "member_failed"]
    assert [e["member"] for e in failed] == [member], failed
    assert len([e for e in events if e["kind"] == "worker_failed"]) == 1
    assert len([e for e in events if e.get("event") == "WorkerFailed"]) == 1
    after = [e for e in events if e["kind"] == "partition" and e["t_s"] > failed[0]["t_s"]]
    assert after and sum(map(len, after[0]["groups"].values())) == 3  # without it
    assert any(e["kind"] == "scancel" and e["t_s"] > failed[0]["t_s"] for e in events)
    # the demand stands: the worker is asked of Slurm again
    assert any(e["kind"] == "submitted" and e["t_s"] > failed[0]["t_s"] for e in events)
    assert RunDir(run_dir).read_state()["status"] == "finished"
    # the simulator replays it from its recorded grants, failure and costs
    doc = check_replay(run_dir, steps=STEPS_FAULTS)
    assert doc["inputs"]["capacity"], "the elastic grant is in the replay's timeline"
    _wait("the run's jobs to leave squeue", lambda: not _tagged(f"pearl:{tag}"), 60)
    stray = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert stray.stdout.strip() == "", f"processes of the run left: {stray.stdout}"


MULTI_NODE = {
    **LOCAL_CONFIG,
    "profile": MEASURED,  # colocated throughout: the placement is under test
    "cluster": "local",
    "backend": "slurm",
    "workers": {"training_gpus": 2, "reserved_rollout": 1, "overlap": 1},
    "layout": {"gpus_per_node": 8, "training_nodes": 1, "rollout_nodes": 1},
    # a full site section over the local cluster's file (typed GPUs sim, pmi2)
    "slurm": {
        "poll_s": 0.5,
        "account": "lab",
        "qos": "normal",
        "time": "0:40:00",
        "constraint": "sim",
        "srun_extra": ["--cpu-bind=none"],
        **SITE,
    },
    "elastic": {**CONFIG["elastic"], "pools": [{"partition": "elastic", "hetjob_workers": 2}]},
    "run": {**LOCAL_CONFIG["run"], "steps": 3},
}


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_submitit_runs_a_two_node_layout_requeued_when_preempted_and_resumed(
    slurm_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pearl-hpc run --submit` of a layout over two nodes: the master as a submitit job
    of a task a node, with the site settings of the local cluster's file; the first
    task's world starts the ranks on both nodes (one srun step, overlapping the
    job's step). A preemption after step 0 (submitit's own test hook: SIGTERM, then
    USR2) checkpoints and requeues it; the next start resumes from the journal and the
    run ends with every step trained once."""
    from pearl_hpc.runjob import submit_run

    monkeypatch.setenv("PEARL_HPC_CACHE", str(tmp_path / "cache"))
    config = {
        **MULTI_NODE,
        "elastic": {**MULTI_NODE["elastic"], "max_workers": 0},  # the base job under test
        # synchronous steps of a few seconds each: the preemption lands after step 0,
        # well before the end
        "run": {**MULTI_NODE["run"], "steps": STEPS_SUBMITIT, "max_staleness": 0},
        "runs_dir": str(tmp_path / "runs"),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    job, run_dir = submit_run(path)
    try:
        _wait("step 0", lambda: bool(read_jsonl(run_dir / "metrics.jsonl")), 600, poll_s=0.1)
        job._interrupt()  # preemption as submitit simulates it
        _wait("the requeued job to finish", job.done, 900)
        summary = job.results()[0]
    finally:
        subprocess.run(["scancel", str(job.job_id)], check=False)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS_SUBMITIT))
    assert [m["version"] for m in metrics] == list(range(1, STEPS_SUBMITIT + 1))
    assert [m["trajectories"] for m in metrics] == [BATCH] * STEPS_SUBMITIT
    assert summary["steps"] == STEPS_SUBMITIT
    events = read_jsonl(run_dir / "events.jsonl")
    worlds = [e for e in events if e["kind"] == "world"]
    assert len(worlds) == 2 and all(w["ranks"] == 5 for w in worlds)  # before and after
    assert all(w["nodes"]["4"] != w["nodes"]["1"] for w in worlds)  # over both nodes
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed, "the requeued job did not resume"
    assert resumed[0]["step"] < STEPS_SUBMITIT, "the preemption came after the last step"
    assert RunDir(run_dir).read_state()["status"] == "finished"
    _wait("the job to leave squeue", lambda: not _in_squeue(str(job.job_id)), 60)
    stray = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert stray.stdout.strip() == "", f"processes of the run left: {stray.stdout}"


@pytest.mark.slurm
@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_a_base_job_over_two_nodes_trains_on_one_and_serves_on_the_other(
    slurm_cluster: str, tmp_path: Path
) -> None:
    """`pearl-hpc run CONFIG --sbatch` with a full site section: Slurm holds the job
    with the site's account, qos, time, constraint and typed GPUs; its setup lines and
    env reach every rank, each started in the site's apptainer image (a stand-in); the
    world (the master) is one srun step of the base job (Slurm's pmi2 for the ranks'
    PMI), the trainer ranks another, placed by RUN_DIR/hostfile on the training node; each
    engine rank a step of its own on its node, the overlap rank on the training node, the
    reserved engine rank on the rollout node; elastic workers are asked for as a
    2-component hetjob; every step trains its whole batch."""
    config = tmp_path / "run.yaml"
    slurm = {**MULTI_NODE["slurm"], **IN_IMAGE}
    config.write_text(
        yaml.safe_dump({**MULTI_NODE, "slurm": slurm, "runs_dir": str(tmp_path / "runs")})
    )
    env = {**os.environ, "PEARL_HPC_CACHE": str(tmp_path / "cache")}
    job, run_dir, log = _submit(config, env)
    seen: list[list[str]] = []  # the rank processes lacking the site's env, when 5 lived
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        for field in ("Account=lab", "TimeLimit=00:40:00", "Features=sim"):
            assert field in shown, shown
        # a heterogeneous job: each node asks the GPUs its ranks use (2 trainer GPUs; the
        # reserved engine's 1), the other 6 and 7 of the node stay free
        parts = shown.split("HetJobOffset=")[1:]
        assert len(parts) == 2, shown
        for part, gpus in zip(parts, (2, 1), strict=True):
            assert re.search(r"NumNodes=1\b", part) and f"TresPerNode=gres:gpu:sim:{gpus}\n" in part
        script = subprocess.run(["scontrol", "write", "batch_script", job, "-"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "#SBATCH --qos=normal" in script  # (no accounting here: Slurm keeps no QOS)

        def world_up() -> bool:
            if len(_rank_processes(run_dir)) >= 6:  # srun and its 5 ranks
                seen.append(_without_site_env(run_dir, True))
            return bool(seen) or not _in_squeue(job)

        _wait("the world's ranks", world_up, 600, log, poll_s=0.5)
        _wait("the base job to end", lambda: not _in_squeue(job), 900, log)
    finally:
        subprocess.run(["scancel", job], check=False)
    assert seen == [[]], seen
    assert SETUP_RAN in log.read_text()
    assert (run_dir / "summary.json").exists(), log.read_text()[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["trajectories"] for m in metrics] == [BATCH] * 3
    events = read_jsonl(run_dir / "events.jsonl")
    world = next(e for e in events if e["kind"] == "world")
    assert world["ranks"] == 5 and world["trainers"] == 2 and world["engines"] == 2
    nodes = world["nodes"]  # rank -> the node its hello came from
    training_node = nodes["1"]
    assert nodes["2"] == nodes["3"] == training_node  # trainer 2, overlap engine 3
    assert nodes["4"] != training_node  # the reserved engine rank: the rollout node
    hostfile = (run_dir / "hostfile").read_text().split()
    assert hostfile == [training_node] * 2  # a line a trainer rank
    # the trainer ranks and each engine rank ran in a step of their own, and left at the end
    assert sorted(p.name for p in (run_dir / "domains").iterdir()) == [
        "rank3-0.left", "rank4-0.left", "trainers-0.left"
    ]  # fmt: skip
    partitions = [e for e in events if e["kind"] == "partition"]
    training = ["trainers-0:0", "trainers-0:1"]
    assert partitions and all(p["groups"]["training"] == training for p in partitions)
    submitted = [e for e in events if e["kind"] == "submitted"]
    assert submitted and submitted[0]["components"] == 2  # (serving them: the test above)
    tag = run_tag_of(run_dir)
    _wait("the run's jobs to leave squeue", lambda: not _tagged(f"pearl:{tag}"), 60)
    stray = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert stray.stdout.strip() == "", f"processes of the run left: {stray.stdout}"
