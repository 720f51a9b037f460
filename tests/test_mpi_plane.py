"""The control plane on a real MPI world (MPICH, no engines): the members re-partition
among themselves, so a member slow to enter the split never stalls the master's loop;
an elastic member launched as its own `mpiexec` joins (Connect + Merge), splits with the
others and leaves (LEAVE + Disconnect), and the universe shrinks before the next split;
one whose component was given back before it joined is sent away, never admitted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pearl_hpc.comm.mpi import base_member_id
from pearl_hpc.comm.mpiexec import mpiexec_path

REPO = Path(__file__).resolve().parents[1]
SLOW_S = 3.0


def test_members_split_without_the_master_and_an_elastic_member_joins_and_leaves(
    tmp_path: Path,
) -> None:
    argv = [mpiexec_path(), "-launcher", "fork", "-hosts", "localhost", "-n", "3"]
    argv += [sys.executable, "-m", "tests.mpi_plane_ranks", str(tmp_path), str(SLOW_S)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    events = result["events"]
    splits = [e for e in events if e["kind"] == "split"]
    # member 2 entered each split SLOW_S late: member 1 waited for it inside the
    # collective, the master's loop turned on (each turn 10 ms apart when idle)
    assert splits[0]["s"] >= SLOW_S * 0.9 and splits[0]["wait_s"] >= SLOW_S * 0.9
    assert splits[0]["last"] == base_member_id(2)  # the event names the one waited for:
    # the least time inside (it entered last)
    assert result["loop_gap_s"] < 0.5, result["loop_gap_s"]
    assert [s["epoch"] for s in splits] == [1, 2, 3]
    assert splits[0]["groups"] == {"decode": [2], "prefill": [1]}
    assert splits[1]["groups"] == {"decode": [2, 3], "prefill": [1]}  # the joiner, rank 3
    assert splits[2]["groups"] == {"decode": [2], "prefill": [1]}
    kinds = [e["kind"] for e in events]
    assert kinds.index("admitted") < kinds.index("leave") < kinds.index("shrink")
    assert "split_mismatch" not in kinds  # every member counted the group the master sent
    # given back before it joined: joined, sent away, never admitted
    late = [e for e in events if e.get("group") == "el2+0"]
    assert [e["kind"] for e in late] == ["joined", "leave"], late


def test_a_split_a_member_does_not_finish_in_time_fails_the_run(tmp_path: Path) -> None:
    """Member 2 enters 20 s late, the split's timeout is 2 s: the members' poll raises
    one clear error (what happened, what to do) about 2 s after sending, not at 20 s."""
    argv = [mpiexec_path(), "-launcher", "fork", "-hosts", "localhost", "-n", "3"]
    argv += [sys.executable, "-m", "tests.mpi_plane_ranks", str(tmp_path), "20", "hung"]
    subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    result = json.loads((tmp_path / "result.json").read_text())
    assert "re-partition 1: ['base:1', 'base:2'] did not finish in 2 s" in result["error"]
    assert "resume the run" in result["error"]
    assert 2.0 <= result["after_s"] < 10.0
