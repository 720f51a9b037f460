"""What this user's dead processes left in a node's shared memory, removed (no torch
here: the launcher sweeps before and after each world)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")  # Linux's tmpfs of shared memory (one per node)


def sweep(root: Path = SHM_ROOT, *, settle_s: float = 30.0) -> list[str]:
    """Remove what this user's dead processes left in shared memory (a killed run leaves
    its weight directory; MPICH leaves a ``mpich_shm_*`` segment behind a process that
    did not finalize): ``pearl-*`` directories whose trainer (the pid their name ends
    in) is gone, and segments no live process maps, older than ``settle_s`` (a new one
    is mapped right after it is made). Returns the names removed."""
    uid = os.geteuid()
    removed: list[str] = []
    try:
        entries = [e for e in root.iterdir() if e.name.startswith(("pearl-", "mpich_shm_"))]
    except OSError:
        return removed
    mine = [e for e in entries if _owner(e) == uid]
    for entry in [e for e in mine if e.name.startswith("pearl-") and e.is_dir()]:
        pid = entry.name.rpartition("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    segments = [e for e in mine if e.name.startswith("mpich_shm_")]
    if segments:
        mapped = _mapped(root)
        now = time.time()
        for entry in segments:
            with contextlib.suppress(OSError):
                if str(entry) not in mapped and now - entry.stat().st_mtime > settle_s:
                    entry.unlink()
                    removed.append(entry.name)
    if removed:
        log.info("shared memory: removed %d leftovers of dead processes", len(removed))
    return removed


def _owner(path: Path) -> int | None:
    try:
        return path.lstat().st_uid
    except OSError:
        return None


def _mapped(root: Path) -> set[str]:
    """The files under ``root`` some process this user may inspect maps."""
    prefix = f" {root}/"
    paths: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    paths.add(line[at + 1 :].removesuffix(" (deleted)"))
    return paths


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
