"""Slurm builders, parsers and client logic, without a cluster (a hand-written runner)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from pearl_hpc.errors import ConfigError
from pearl_hpc.slurm.client import CommandResult, SlurmClient, SlurmError
from pearl_hpc.slurm.parse import (
    SlurmParseError,
    parse_sbatch_parsable,
    parse_squeue_json,
    parse_squeue_text,
    parse_test_only,
)
from pearl_hpc.slurm.scripts import HetComponent, JobSpec, render_sbatch, scancel_args

GOLDEN = Path(__file__).parent / "golden"


def elastic_spec() -> JobSpec:
    return JobSpec(
        name="pearl-elastic",
        run_tag="run42",
        components=(
            HetComponent(
                "elastic", nodes=1, gpus_per_node=2, ntasks_per_node=1, time_limit="30:00"
            ),
            HetComponent(
                "elastic", nodes=2, gpus_per_node=4, ntasks_per_node=2, time_limit="30:00"
            ),
        ),
        command=["srun", "--het-group=0,1", "python", "-m", "pearl_hpc.rank", "--run", "run 42"],
        output="/runs/run42/elastic-%j.out",
        env=(("PEARL_RUN_DIR", "/runs/run42"),),
    )


def test_hetjob_script_matches_golden_file() -> None:
    assert render_sbatch(elastic_spec()) == (GOLDEN / "hetjob.sbatch").read_text()


def test_single_component_script_has_no_hetjob_line() -> None:
    spec = JobSpec(
        "pearl-base",
        "r1",
        (HetComponent("normal", gpus_per_node=8),),
        ["true"],
        signal=None,
        requeue=True,
    )
    text = render_sbatch(spec)
    assert "hetjob" not in text and "--signal" not in text and "#SBATCH --requeue" in text
    assert "#SBATCH --gres=gpu:8" in text


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"partition": "bad name"}, "partition 'bad name'"),
        ({"partition": "p", "nodes": 0}, "nodes must be >= 1"),
        ({"partition": "p", "gpus_per_node": -1}, "gpus_per_node must be >= 0"),
        ({"partition": "p", "time_limit": "1 hour"}, "is not a Slurm time"),
    ],
)
def test_bad_component_is_a_clear_error(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        HetComponent(**kwargs)


def test_scancel_of_job_or_component() -> None:
    assert scancel_args("123") == ["scancel", "123"]
    assert scancel_args("123", 1) == ["scancel", "123+1"]
    assert scancel_args("123", signal="USR2") == ["scancel", "--signal=USR2", "123"]
    with pytest.raises(ConfigError):
        scancel_args("12;rm -rf /")


def test_parse_sbatch_parsable() -> None:
    assert parse_sbatch_parsable("123\n") == "123"
    assert parse_sbatch_parsable("456;cluster\n") == "456"
    with pytest.raises(SlurmParseError):
        parse_sbatch_parsable("sbatch: error: invalid partition")


def test_parse_squeue_text_plain_and_het() -> None:
    rows = parse_squeue_text(
        "3+0|RUNNING|pearl-el|pearl:run1|elastic|n1|None|2026-12-04T01:00:00\n"
        "3+1|PENDING|pearl-el|pearl:run1|elastic||Resources|2026-12-04T02:10:00\n"
        "7|RUNNING|base|pearl:run1|normal|n[1-2]|None|2026-12-04T00:59:30\n"
        "8|PENDING|base|pearl:run1|normal||Priority|N/A\n"
    )
    assert [r.key for r in rows] == ["3+0", "3+1", "7", "8"]
    assert rows[1].state == "PENDING" and rows[1].reason == "Resources"
    assert rows[1].start_s == datetime(2026, 12, 4, 2, 10).timestamp()  # expected start
    assert rows[2].component is None and rows[2].nodes == "n[1-2]"
    assert rows[3].start_s is None  # no estimate yet
    with pytest.raises(SlurmParseError, match="2 fields, expected 8"):
        parse_squeue_text("3|RUNNING\n")


def test_parse_squeue_json_2205_and_newer_forms() -> None:
    old = {
        "jobs": [
            {
                "job_id": 3,
                "het_job_id": 3,
                "het_job_offset": 0,
                "job_state": "RUNNING",
                "name": "e",
                "comment": "pearl:r",
                "partition": "elastic",
                "nodes": "n1",
                "state_reason": "None",
                "start_time": 1764810000,
            },
            {
                "job_id": 9,
                "het_job_id": 0,
                "het_job_offset": 0,
                "job_state": "PENDING",
                "name": "b",
                "comment": "",
                "partition": "normal",
                "nodes": "",
                "state_reason": "Priority",
            },
        ]
    }
    new = {
        "jobs": [
            {
                "job_id": 4,
                "het_job_id": {"set": True, "number": 3},
                "het_job_offset": {"set": True, "number": 1},
                "job_state": ["RUNNING", "COMPLETING"],
                "name": "e",
                "comment": "pearl:r",
                "partition": "elastic",
                "nodes": "n2",
            },
            {
                "job_id": 10,
                "het_job_id": {"set": False, "number": 0},
                "het_job_offset": {"set": False, "number": 0},
                "job_state": ["PENDING"],
                "name": "b",
            },
        ]
    }
    a = parse_squeue_json(json.dumps(old))
    b = parse_squeue_json(json.dumps(new))
    assert [(r.key, r.state) for r in a] == [("3+0", "RUNNING"), ("9", "PENDING")]
    assert [r.start_s for r in a] == [1764810000.0, None]
    assert [(r.key, r.state) for r in b] == [("3+1", "RUNNING"), ("10", "PENDING")]
    with pytest.raises(SlurmParseError):
        parse_squeue_json("not json")


class ScriptedRunner:
    """Answers each command with the next scripted result; records the calls."""

    def __init__(self, *results: CommandResult) -> None:
        self.results = list(results)
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(self, argv: Sequence[str], stdin: str | None) -> CommandResult:
        self.calls.append((list(argv), stdin))
        return self.results.pop(0)


def test_test_only_start_estimate_is_read_and_nothing_is_submitted() -> None:
    line = "sbatch: Job 42 to start at 2026-12-04T01:40:00 using 2 processors on nodes n1"
    assert parse_test_only(line) == datetime(2026, 12, 4, 1, 40).timestamp()
    assert parse_test_only("sbatch: error: Batch job submission failed") is None
    soon = (datetime.now() + timedelta(seconds=90)).strftime("%Y-%m-%dT%H:%M:%S")
    past = "2000-01-01T00:00:00"

    def estimate(stderr: str, rc: int = 0) -> float | None:
        runner = ScriptedRunner(CommandResult(rc, "", stderr))
        seconds = SlurmClient(runner).start_estimate(elastic_spec())
        assert runner.calls == [(["sbatch", "--test-only"], render_sbatch(elastic_spec()))]
        return seconds

    at = "sbatch: Job 1 to start at {} using 1 processors on nodes n1 in partition elastic"
    assert estimate(at.format(soon)) == pytest.approx(90, abs=2)
    assert estimate(at.format(past)) == 0.0  # would start now
    assert estimate("sbatch: no estimate") is None
    assert estimate(at.format(soon), rc=1) is None


def test_earliest_pool_prefers_a_known_soon_start_then_the_turn() -> None:
    from pearl_hpc.backends.slurm import earliest_pool

    assert earliest_pool({0: 600.0, 1: 30.0, 2: None}, [0, 1, 2]) == 1
    assert earliest_pool({0: None, 1: 900.0}, [0, 1]) == 1  # no estimate: last
    assert earliest_pool({0: 0.0, 1: 0.0, 2: 0.0}, [2, 0, 1]) == 2  # a tie keeps the turn
    assert earliest_pool({0: None, 1: None}, [1, 0]) == 1


def test_submit_sends_the_script_and_raises_with_stderr() -> None:
    runner = ScriptedRunner(
        CommandResult(0, "77\n", ""),
        CommandResult(1, "", "sbatch: error: invalid partition specified: gpuz"),
    )
    client = SlurmClient(runner)
    assert client.submit(elastic_spec()) == "77"
    assert runner.calls[0][0] == ["sbatch", "--parsable"]
    assert runner.calls[0][1] == render_sbatch(elastic_spec())
    with pytest.raises(SlurmError, match="invalid partition specified: gpuz"):
        client.submit(elastic_spec())


def test_failed_poll_keeps_last_state_and_backs_off() -> None:
    now = [0.0]
    ok = CommandResult(
        0, "5+0|RUNNING|e|pearl:r|elastic|n1|None|N/A\n8|RUNNING|x|other|normal|n2|None|N/A\n", ""
    )
    down = CommandResult(1, "", "slurm_load_jobs error: Unable to contact slurm controller")
    runner = ScriptedRunner(ok, down, down, ok)
    client = SlurmClient(runner, clock=lambda: now[0], min_backoff_s=1.0)
    assert list(client.poll("r")) == ["5+0"]  # only this run's jobs
    assert list(client.poll("r")) == ["5+0"]  # squeue failed: last known state
    assert client.poll_failures == 1
    assert list(client.poll("r")) == ["5+0"] and len(runner.calls) == 2  # backing off
    now[0] = 1.5
    client.poll("r")  # fails again: back-off doubles
    assert client.poll_failures == 2 and len(runner.calls) == 3
    now[0] = 3.0
    assert set(client.poll()) == {"5+0", "8"}  # backing off until 3.5: last known, unfiltered
    assert len(runner.calls) == 3
    now[0] = 4.0
    assert set(client.poll()) == {"5+0", "8"}
    assert len(runner.calls) == 4


# -- a partition's history as an availability trace (pearl-hpc trace --from-sacct) ------


def _at(seconds: float) -> str:
    """A Slurm time ``seconds`` after 2026-12-01T08:00 (local)."""
    return (datetime(2026, 12, 1, 8, 0) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S")


T0 = datetime(2026, 12, 1, 8, 0).timestamp()
SACCT = "\n".join([
    f"101|train|{_at(10)}|{_at(20)}|n1|8|billing=8,cpu=8,mem=64G,node=1",  # exclusive: no GPU named
    f"102+0|het|{_at(15)}|{_at(30)}|n[1-2]|4|cpu=4,gres/gpu=4,mem=8G,node=2",  # 2 GPUs a node
    f"103|pearl-elastic|{_at(0)}|{_at(40)}|n2|8|cpu=8,gres/gpu=4,node=1",  # the run's own: idle
    f"104|other|{_at(5)}|{_at(35)}|n9|8|cpu=8,gres/gpu=4,node=1",  # not the partition's node
    "105|pending|Unknown|Unknown|None assigned|1|",  # never started: holds nothing
    f"106|running|{_at(50)}|Unknown|n2|1|cpu=1,gres/gpu=1,node=1",  # to the window's end
])  # fmt: skip


def test_history_idle_gpus_follow_the_jobs_that_held_the_partitions_nodes() -> None:
    from pearl_hpc.slurm.history import Node, idle_trace, parse_nodes, parse_sacct

    nodes = parse_nodes("n1|8|gpu:a100:4(S:0-1)\nn2|8|gpu:a100:4\nn1|8|gpu:a100:4\nbad|x|\n")
    assert nodes == {"n1": Node(8, 4), "n2": Node(8, 4)}
    holds = parse_sacct(SACCT)
    assert [h.job for h in holds] == ["101", "102+0", "103", "104", "106"]
    assert holds[1].nodes == ("n1", "n2") and holds[1].gpus == 4 and holds[0].gpus is None
    assert holds[2].own and holds[4].end_s is None
    trace, touched = idle_trace(holds, nodes, T0, T0 + 60, "p")
    assert touched == 3  # 101, 102+0, 106
    # 0-10: all 8 idle; 10-15: n1's CPUs all held; 15-20: + n2 2 GPUs; 20-30: n1 2, n2 2;
    # 30-50: all idle; 50-60: n2 1 held
    assert trace.times_s == (0.0, 10.0, 15.0, 20.0, 30.0, 50.0, 60.0)
    assert trace.counts == (8, 4, 2, 4, 8, 7, 7)


def test_history_reads_accounting_else_the_completion_log() -> None:
    from pearl_hpc.slurm.history import read_history

    calls: list[list[str]] = []

    def cluster(accounting: bool, completion: bool):  # type: ignore[no-untyped-def]
        def run(argv: Sequence[str], stdin: str | None) -> CommandResult:
            calls.append(list(argv))
            if argv[0] == "sinfo":
                return CommandResult(0, "n1|8|gpu:4\nn2|8|gpu:4\n", "")
            if "-c" not in argv and not accounting:
                return CommandResult(1, "", "Slurm accounting storage is disabled\n")
            if "-c" in argv and not completion:
                return CommandResult(1, "", "Slurm job completion is disabled\n")
            return CommandResult(0, SACCT, "")

        return run

    history = read_history("scavenger", T0, T0 + 60, cluster(True, False))
    assert not isinstance(history, str) and history.source == "accounting"
    assert (history.nodes, history.gpus, history.jobs) == (2, 8, 3)
    assert calls[0][:5] == ["sinfo", "-N", "-h", "-p", "scavenger"]
    assert calls[1][:7] == ["sacct", "-a", "-X", "-D", "-n", "-P", "-S"]
    history = read_history("scavenger", T0, T0 + 60, cluster(False, True))
    assert not isinstance(history, str) and history.source == "the job completion log"
    assert calls[-1][:2] == ["sacct", "-c"]
    why = read_history("scavenger", T0, T0 + 60, cluster(False, False))
    assert isinstance(why, str) and "keeps no job history" in why
