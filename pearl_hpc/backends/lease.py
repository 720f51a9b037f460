"""The master's lease: how elastic ranks and their launchers learn that it is gone.

    master ──touches RUN_DIR/elastic/master.lease every second ("<host> <pid> <time>")──>
    an elastic rank, an elastic job's batch step: a lease older than
    ``slurm.lease_timeout_s``, or taken by another master (a resumed one), ends them

No MPI, torch or vLLM here: an elastic job's batch step imports it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

LEASE_S = 1.0  # the master touches its lease this often
LEASE_STALE_S = 30.0  # `pearl-hpc status`: a master silent this long is dead


class MasterLease:
    """The master's lease, touched by a thread of its own (the loop may be busy) until
    :meth:`stop`."""

    def __init__(self, path: Path) -> None:
        """``path``: :attr:`pearl_hpc.rundir.RunDir.lease`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._touch, name="lease", daemon=True)
        self._thread.start()

    def _touch(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        while not self._stop.is_set():
            tmp.write_text(f"{os.uname().nodename} {os.getpid()} {time.time():.1f}\n")
            tmp.rename(self.path)
            self._stop.wait(LEASE_S)

    def stop(self) -> None:
        self._stop.set()


def lease_watcher(path: Path, timeout_s: float, *, any_owner: bool = False) -> Callable[[], bool]:
    """``alive()`` for an elastic rank: false once the lease is older than ``timeout_s``,
    or held by another master than the first one seen (the dead one's ranks end; a
    resumed master's join afresh). ``any_owner``: only the age counts (an elastic job's
    batch step serves whichever master). True while none was written."""
    first: list[tuple[str, int]] = []

    def alive() -> bool:
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            return True
        holder = lease_owner(path)
        if holder is None:
            return True
        if not first:
            first.append(holder)
        return age < timeout_s and (any_owner or holder == first[0])

    return alive


def lease_owner(path: Path) -> tuple[str, int] | None:
    """The host and pid of the master holding the lease (None: no lease, or unreadable)."""
    try:
        host, pid, _ = path.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None
