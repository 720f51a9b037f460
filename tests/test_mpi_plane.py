"""The control plane on a real MPI world (MPICH, no engines; tests/mpi_plane_ranks.py):
elastic members launched as their own `mpiexec` join with signed hellos, take roles and
leave; an announcer that never connects is freed by the doorman; strangers (a pickle, a
hello signed with another key) and a joiner that connected and died before its hello
are dropped without executing anything; a member killed
with a command on its way and a member stopped (a silent node) are declared failed, and
the call waiting for the killed one fails at once; the master's loop turns throughout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pearl_hpc.comm.mpiexec import one_node
from tests.mpi_plane_ranks import HEARTBEAT_TIMEOUT_S, SEND_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]


def test_joins_strangers_and_faults_never_stop_the_masters_loop(tmp_path: Path) -> None:
    argv = [*one_node(3), sys.executable, "-m", "tests.mpi_plane_ranks", str(tmp_path), "world"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    events = result["events"]
    print({k: v for k, v in result.items() if k != "events"})

    def of(kind: str) -> list[dict]:  # type: ignore[type-arg]
        return [e for e in events if e["kind"] == kind]

    # the role partition is the master's table: logged when it changes
    partitions = of("partition")
    assert [p["epoch"] for p in partitions] == [1, 2, 3]
    assert partitions[0]["groups"] == {"decode": ["base:2"], "prefill": ["base:1"]}
    assert partitions[1]["groups"] == {"decode": ["base:2", "el1+0:0"], "prefill": ["base:1"]}
    assert partitions[2]["groups"] == partitions[0]["groups"]
    # joined with a proven hello, left
    assert [e["group"] for e in of("joined")] == ["el1+0", "el2+0", "el3+0", "el4+0"]
    assert {e["group"] for e in of("leave")} == {"el1+0", "el4+0"}
    # the dead announcer: each Accept freed by the doorman, then the join abandoned
    dropped = of("connection_dropped")
    doorman = [e for e in dropped if e["group"] == "el9+0"]
    assert len(doorman) == 3 and all("doorman" in e["reason"] for e in doorman), dropped
    # (a stranger that took a go and failed its hello leaves that go to be tried again:
    # it may have raced the rightful joiner to the port)
    assert [e["group"] for e in of("join_abandoned")] == ["el9+0", "el7+0", "el8+0", "el6+0"]
    # strangers: dropped, nothing executed, never members
    pickled = [e["reason"] for e in dropped if e["group"] == "el7+0"]
    assert "not a hello" in pickled[0] and all("doorman" in r for r in pickled[1:]), pickled
    assert not (tmp_path / "owned").exists()
    forged = [e["reason"] for e in dropped if e["group"] == "el8+0"]
    assert "not signed by the run's key" in forged[0], forged
    mute = [e["reason"] for e in dropped if e["group"] == "el6+0"]
    assert "before its hello" in mute[0] or "sent no hello" in mute[0], mute
    failed = {e["member"]: e["reason"] for e in of("member_failed")}
    assert set(failed) == {"el2+0:0", "el3+0:0"}, failed
    # killed with a command on its way: the waiting call failed before any heartbeat
    # timeout could have named it
    assert "el2+0:0" in result["call_error"]
    assert result["killed_call_s"] < SEND_TIMEOUT_S + 1.0, result
    # stopped: silent, failed by the heartbeat timeout
    assert "silent" in failed["el3+0:0"]
    assert HEARTBEAT_TIMEOUT_S - 0.5 < result["stopped_detect_s"] < HEARTBEAT_TIMEOUT_S + 3
    # the given-back component that joined late was sent away
    late = [e["kind"] for e in events if e.get("group") == "el4+0"]
    assert late == ["joined", "leave"], late
    # the loop turned throughout (the pump, not the loop, sits in Accept: 3 s each time
    # the doorman had to knock); generous on two shared cores with MPI processes starting
    assert result["loop_gap_s"] < 0.5, result["loop_gap_s"]
    assert max(result["accept_s"]) > 3.0  # (the pump did sit)


def test_bench_plane_measures_plans_a_burst_of_joiners_and_cycles(tmp_path: Path) -> None:
    """`pearl-hpc bench --plane` at a small size: each figure reported, every joiner in,
    its line recorded (where asked: never into the checkout); 40 join / leave-or-fail
    cycles leave the master's communicators, open files and threads where they were (a
    link leaked per cycle would show 20 or 40 fewer free communicators)."""
    lines = tmp_path / "bench.jsonl"
    argv = [sys.executable, "-m", "pearl_hpc.bench.plane", "--ranks", "4", "--joiners", "3"]
    argv += ["--cycles", "40", "--json", "--record", str(lines)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert row["ranks"] == 4 and row["joined"] == 3
    assert row["partition_ms"] > 0 and row["fanout_ms"] > 0 and row["join_ms"] > 0
    assert row["burst_poll_ms"] < row["burst_s"] * 1e3
    assert row["cycles"] == 40 and row["cycle_ms"] > 0
    for what in ("free_comms", "fds", "threads"):
        assert row[f"{what}_after"] == row[f"{what}_before"], (what, row)
    (line,) = [json.loads(x) for x in lines.read_text().splitlines()]
    assert line["bench"] == "plane" and line["result"] == [row]
