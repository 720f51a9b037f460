"""The master's durable state: the journal, the trajectory log, the run directory.

    RUN_DIR/config.yaml            the run config (what ``--resume`` reads)
            lock                   flock of the live master (its pid inside)
            journal.json           status, pid, next step, version, counters, controller
            trajectories/step-N    every trajectory after each of its turns
            snapshots/vN           weights after step N-1 (the newest two kept)

The controller (pure) produces and consumes plain dicts (``Controller.snapshot()`` /
``restore()``); this module is the only place that touches the journal file. A write
goes to a temporary file in the same directory, is fsynced and renamed over the old one,
so a crash leaves either the old or the new journal, never a torn one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pearl_hpc.errors import ConfigError, PearlError
from pearl_hpc.master.records import read_jsonl
from pearl_hpc.rollout.types import Trajectory

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
    except UnicodeDecodeError:
        raise JournalError(f"{path}: corrupt journal (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise JournalError(f"{path}: corrupt journal ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != JOURNAL_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise JournalError(f"{path}: journal format {found!r} is not {JOURNAL_FORMAT!r}")
    state = doc.get("state")
    if not isinstance(state, dict):
        raise JournalError(f"{path}: corrupt journal (no state mapping)")
    return state


# what ``status`` and ``--resume`` read of a run's state, and its type
_STATE_FIELDS: dict[str, type] = {
    "status": str, "pid": int, "next_step": int, "steps": int, "version": int, "t_s": float,
    "elastic_workers": int, "controller": dict, "counters": dict,
}  # fmt: skip


def read_run_state(run_dir: Path) -> dict[str, Any]:
    """The run's journal (``journal.json``), or a clear error naming what is missing."""
    path = Path(run_dir) / "journal.json"
    if not path.exists():
        raise ConfigError(
            f"{run_dir}: no journal.json; pass the run directory that `pearl-hpc run` "
            "printed (runs/NAME-DATE)"
        )
    state = read_journal(path)
    _check_run_state(path, state)
    return state


def _check_run_state(path: Path, state: dict[str, Any]) -> None:
    """What ``status`` and ``--resume`` read of a run's state: there, of its type."""
    for key, kind in _STATE_FIELDS.items():
        if key not in state:
            raise JournalError(f"{path}: corrupt journal (no {key})")
        value = state[key]
        accepted = (int, float) if kind is float else kind
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise JournalError(f"{path}: corrupt journal ({key}: {value!r} is not {kind.__name__})")
        if isinstance(value, int) and not 0 <= value < 1 << 62:
            raise JournalError(f"{path}: corrupt journal ({key}: {value!r} is out of range)")


def new_run_dir(runs_dir: str | Path, name: str, config_path: Path) -> Path:
    """``RUNS_DIR/NAME-DATE`` (``-2``, ``-3``... when a run of that name started in the
    same second) with a copy of the run YAML (what ``--resume`` reads)."""
    runs = Path(runs_dir)
    if runs.exists() and not runs.is_dir():
        raise ConfigError(f"runs_dir {runs}: is a file; set runs_dir to a directory")
    try:
        runs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"runs_dir {runs}: cannot create it ({exc.strerror})") from None
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        run_dir = runs / (stem if n == 1 else f"{stem}-{n}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        (run_dir / "config.yaml").write_text(Path(config_path).read_text())
        return run_dir
    raise ConfigError(f"runs_dir {runs}: 999 runs named {stem} already; pick another name")


def lock_held(run_dir: Path) -> bool | None:
    """Does a live process hold ``RUN_DIR/lock``? (None: the run has no lock file.)"""
    import fcntl

    try:
        lock = (run_dir / "lock").open("r")
    except OSError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


class RunDirBusy(ConfigError):
    """Another live master holds the run directory."""


def lock_run_dir(run_dir: Path) -> Any:
    """Hold ``RUN_DIR/lock`` (an exclusive ``flock``) for this process's life; returns
    the open file (keep it). The kernel drops a dead holder's lock, so a killed master's
    directory is free to resume at once; a live one's is refused with one line."""
    import fcntl

    lock = (run_dir / "lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RunDirBusy(
            f"{run_dir}: in use by a live master (pid {holder}); wait for it to end, or "
            f"stop it (pearl-hpc status {run_dir})"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


class TrajectoryLog:
    """Every trajectory of a step after each of its turns, one JSON line per record
    (``trajectories/step-NNNNN.jsonl``): a restarted master keeps the finished ones and
    resumes the unfinished ones from their last turn. Lines are flushed as written, so a
    killed master loses at most the turn in flight."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "trajectories"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._step = -1

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:05d}.jsonl"

    def record(self, step: int, traj: Trajectory) -> None:
        if step != self._step:
            self.close()
            self._file, self._step = self.path(step).open("a"), step
        self._file.write(json.dumps(traj.to_dict()) + "\n")
        self._file.flush()

    def load(self, step: int) -> dict[str, Trajectory]:
        """The last record of each trajectory of ``step`` (a torn last line is skipped)."""
        out: dict[str, Trajectory] = {}
        for record in read_jsonl(self.path(step)):
            try:
                traj = Trajectory.from_dict(record)
            except (KeyError, TypeError):
                continue
            out[traj.trajectory_id] = traj
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_lines(path: Path, lines: list[str]) -> None:
    """Replace a text file atomically with ``lines``."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def prune_snapshots(root: Path, keep: int) -> None:
    """Weight snapshots are only for resuming: keep the newest ``keep``."""
    for old in sorted(root.glob("v[0-9]*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def drop_unrecorded_snapshots(root: Path, version: int) -> None:
    """A snapshot newer than the journal's ``version`` is of a step trained but never
    recorded (the master died in between): that step is trained again from its log."""
    for newer in root.glob("v[0-9]*"):
        if newer.name[1:].isdigit() and int(newer.name[1:]) > version:
            shutil.rmtree(newer)
