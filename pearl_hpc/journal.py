"""The master's journal: its state as one JSON file, replaced atomically.

The controller (pure) produces and consumes plain dicts (``Controller.snapshot()`` /
``restore()``); this module is the only place that touches the file. A write goes to a
temporary file in the same directory, is fsynced and renamed over the old one, so a
crash leaves either the old or the new journal, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pearl_hpc.errors import PearlError

JOURNAL_FORMAT = "pearl-hpc-journal/1"


class JournalError(PearlError):
    """The journal cannot be read (missing, corrupt, or from another release)."""


def write_journal(path: str | Path, state: dict[str, Any], *, time_s: float) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": JOURNAL_FORMAT, "written_at_s": time_s, "state": state}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_journal(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise JournalError(f"{path}: no journal here (was the run started?)") from None
    except json.JSONDecodeError as exc:
        raise JournalError(f"{path}: corrupt journal ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != JOURNAL_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise JournalError(f"{path}: journal format {found!r} is not {JOURNAL_FORMAT!r}")
    state = doc["state"]
    assert isinstance(state, dict)
    return state
