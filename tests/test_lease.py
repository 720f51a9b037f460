"""The master's lease: what elastic ranks, elastic jobs' batch steps and `pearl-hpc
status` read of it (real files, a real thread)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pearl_hpc.backends.lease import (
    LEASE_STALE_S,
    MasterLease,
    lease_owner,
    lease_watcher,
)
from pearl_hpc.cli.view import _master_alive
from pearl_hpc.rundir import RunDir


def _write(path: Path, host: str, pid: int, age_s: float = 0.0) -> None:
    path.write_text(f"{host} {pid} {time.time():.1f}\n")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_the_master_touches_its_lease_until_stopped(tmp_path: Path) -> None:
    lease = MasterLease(tmp_path / "elastic" / "master.lease")
    try:
        deadline = time.monotonic() + 5
        while lease_owner(lease.path) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease_owner(lease.path) == (os.uname().nodename, os.getpid())
        first = lease.path.stat().st_mtime
        time.sleep(1.3)
        assert lease.path.stat().st_mtime > first  # touched again
    finally:
        lease.stop()


def test_a_rank_ends_on_a_stale_lease_or_another_master(tmp_path: Path) -> None:
    path = tmp_path / "master.lease"
    alive = lease_watcher(path, timeout_s=10)
    assert alive()  # none written yet
    _write(path, "n1", 100)
    assert alive()
    _write(path, "n1", 100, age_s=11)
    assert not alive()  # the master went silent
    _write(path, "n2", 200)
    assert not alive()  # a resumed master holds it: this rank was the dead one's

    batch_step = lease_watcher(path, timeout_s=10, any_owner=True)
    _write(path, "n1", 100)
    assert batch_step()
    _write(path, "n2", 200)
    assert batch_step()  # it serves whichever master
    _write(path, "n2", 200, age_s=11)
    assert not batch_step()


def test_unreadable_leases_have_no_owner(tmp_path: Path) -> None:
    path = tmp_path / "master.lease"
    assert lease_owner(path) is None
    for text in ("", "n1", "n1 x 3.0", "a b c d"):
        path.write_text(text)
        assert lease_owner(path) is None, text
    assert lease_watcher(path, timeout_s=10)()  # caught mid-write: not a verdict


def test_status_trusts_the_lease_only_of_a_master_on_another_node(tmp_path: Path) -> None:
    run_dir = tmp_path
    (run_dir / "elastic").mkdir()
    path = RunDir(run_dir).lease
    _write(path, "another-node", 1)
    assert _master_alive(run_dir, 0)
    _write(path, "another-node", 1, age_s=LEASE_STALE_S + 1)
    assert not _master_alive(run_dir, 0)
    # a fresh lease of this machine whose master is dead (no lock held, no such pid)
    dead = 2**22 + 12345
    _write(path, os.uname().nodename, dead)
    (run_dir / "lock").write_text("")
    assert not _master_alive(run_dir, dead)
