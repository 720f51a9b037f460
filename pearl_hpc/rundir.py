"""The run directory: one object names every file of it (submitit's ``JobPaths``).

Every process of a run (the master, each rank, the launcher, an elastic job's batch step,
``pearl-hpc status``/``report``) finds a file of the run through :class:`RunDir`; no file
name of a run directory is written anywhere else. The table :data:`FILES` is what
``docs/running.md`` shows (generated: ``python -m pearl_hpc.rundir``).

It also owns the run directory's lifecycle: :meth:`RunDir.new` (``RUNS_DIR/NAME-DATE``),
:meth:`RunDir.lock` (one live master), and the journal (:func:`write_journal`,
:meth:`RunDir.read_state`). A journal write goes to a temporary file in the same
directory, is fsynced and renamed over the old one, so a crash leaves either the old or
the new journal, never a torn one.

Ground floor: imports nothing of pearl_hpc but :mod:`pearl_hpc.errors`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pearl_hpc.errors import ConfigError, PearlError

JOURNAL_FORMAT = "pearl-hpc-journal/1"

# (attribute, name in the run directory, what it holds): the run directory's contents
FILES: tuple[tuple[str, str, str], ...] = (
    ("config", "config.yaml", "the run config as started (what `--resume` reads)"),
    ("lock_file", "lock", "flock of the live master (its pid inside)"),
    ("journal", "journal.json", "status, pid, next step, weight version, counters, controller"),
    ("metrics", "metrics.jsonl", "one line per training step (rewards, timings, roles)"),
    ("events", "events.jsonl", "every decision, plan, start, stop, publish and failure"),
    ("summary", "summary.json", "the run's totals, written when it ends"),
    ("trajectories", "trajectories/", "step-NNNNN.jsonl: every trajectory after each turn"),
    ("snapshots", "snapshots/", "vN/: weights and optimizer after step N-1 (newest two)"),
    ("elastic", "elastic/", "elastic launches: the master's lease, Slurm job logs"),
    ("lease", "elastic/master.lease", "`<host> <pid> <unix time>`, touched every second"),
    ("rpc_key", "rpc.key", "the engine sockets' key (0600), written by the launcher"),
    ("world_log", "world.log", "the base world's mpiexec output"),
    ("hostfile", "hostfile", "Hydra's host file of a world over several nodes"),
    ("tensorboard", "tensorboard/", "TensorBoard event files (`dashboards.tensorboard`)"),
    ("report", "report/", "`pearl-hpc report`'s plots and tables"),
    ("", "rankR-KIND.log", "each rank's log (KIND: master, trainer, engine, elastic)"),
)


class JournalError(PearlError):
    """The journal cannot be read (missing, corrupt, or from another release)."""


class RunDirBusy(ConfigError):
    """Another live master holds the run directory."""


@dataclass(frozen=True)
class RunDir:
    """The files of one run directory (``RUNS_DIR/NAME-DATE``)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def lock_file(self) -> Path:
        return self.path / "lock"

    @property
    def journal(self) -> Path:
        return self.path / "journal.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def trajectories(self) -> Path:
        return self.path / "trajectories"

    def trajectory_log(self, step: int) -> Path:
        return self.trajectories / f"step-{step:05d}.jsonl"

    @property
    def snapshots(self) -> Path:
        return self.path / "snapshots"

    @property
    def elastic(self) -> Path:
        return self.path / "elastic"

    @property
    def lease(self) -> Path:
        return self.elastic / "master.lease"

    @property
    def rpc_key(self) -> Path:
        return self.path / "rpc.key"

    @property
    def world_log(self) -> Path:
        return self.path / "world.log"

    @property
    def hostfile(self) -> Path:
        return self.path / "hostfile"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def report(self) -> Path:
        return self.path / "report"

    def rank_log(self, rank: int, kind: str) -> Path:
        return self.path / f"rank{rank}-{kind}.log"

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    def new(cls, runs_dir: str | Path, name: str, config_path: Path) -> RunDir:
        """``RUNS_DIR/NAME-DATE`` (``-2``, ``-3``... when a run of that name started in
        the same second) with a copy of the run YAML (what ``--resume`` reads)."""
        runs = Path(runs_dir)
        if runs.exists() and not runs.is_dir():
            raise ConfigError(f"runs_dir {runs}: is a file; set runs_dir to a directory")
        try:
            runs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"runs_dir {runs}: cannot create it ({exc.strerror})") from None
        stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        for n in range(1, 1000):
            run = cls(runs / (stem if n == 1 else f"{stem}-{n}"))
            try:
                run.path.mkdir()
            except FileExistsError:
                continue
            run.config.write_text(Path(config_path).read_text())
            return run
        raise ConfigError(f"runs_dir {runs}: 999 runs named {stem} already; pick another name")

    def lock_held(self) -> bool | None:
        """Does a live process hold the lock? (None: the run has no lock file.)"""
        import fcntl

        try:
            lock = self.lock_file.open("r")
        except OSError:
            return None
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    def lock(self) -> IO[str]:
        """Hold the lock (an exclusive ``flock``) for this process's life; returns the
        open file (keep it). The kernel drops a dead holder's lock, so a killed master's
        directory is free to resume at once; a live one's is refused with one line."""
        import fcntl

        lock = self.lock_file.open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise RunDirBusy(
                f"{self.path}: in use by a live master (pid {holder}); wait for it to end, "
                f"or stop it (pearl-hpc status {self.path})"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        return lock

    def read_state(self) -> dict[str, Any]:
        """The run's journal, or a clear error naming what is missing."""
        if not self.journal.exists():
            raise ConfigError(
                f"{self.path}: no journal.json; pass the run directory that `pearl-hpc run` "
                "printed (runs/NAME-DATE)"
            )
        state = read_journal(self.journal)
        _check_run_state(self.journal, state)
        return state

    def drop_unrecorded_snapshots(self, version: int) -> None:
        """A snapshot newer than the journal's ``version`` is of a step trained but never
        recorded (the master died in between): that step is trained again from its log."""
        for newer in self.snapshots.glob("v[0-9]*"):
            if newer.name[1:].isdigit() and int(newer.name[1:]) > version:
                shutil.rmtree(newer)

    def prune_snapshots(self, keep: int) -> None:
        """Weight snapshots are only for resuming: keep the newest ``keep``."""
        for old in sorted(self.snapshots.glob("v[0-9]*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


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


def write_lines(path: Path, lines: list[str]) -> None:
    """Replace a text file atomically with ``lines``."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def files_table() -> str:
    """The run directory's contents as a Markdown table (``docs/running.md``)."""
    rows = ["| path | what it holds |", "|---|---|"]
    rows += [f"| `RUN_DIR/{name}` | {what} |" for _, name, what in FILES]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(files_table())
