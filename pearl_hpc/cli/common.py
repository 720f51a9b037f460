"""What every subcommand shares: the parser class (one-line errors, exit 2), number
argument types, shipped-profile names."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, NoReturn

from pearl_hpc.config import REPO_CONFIGS
from pearl_hpc.errors import ConfigError

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def number(kind: type, minimum: float, maximum: float | None = None) -> Any:
    """An argparse type: ``kind`` (int or float), finite, >= ``minimum`` and, when given,
    <= ``maximum`` (what a machine can hold and finish)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (value >= minimum and value != float("inf")):
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        return value

    return parse


MAX_WORKERS = 50_000  # rollout / borrowable workers of one plan (50,000: ~0.1 s)
MAX_BATCH = 1 << 16  # trajectories of one simulated batch
positive_int = number(int, 1)
non_negative_int = number(int, 0)
non_negative_float = number(float, 0.0)
worker_count = number(int, 1, MAX_WORKERS)
borrowable_count = number(int, 0, MAX_WORKERS)


def _creatable(path: Path) -> str | None:
    """Why ``path`` cannot be made as a folder or file (None: it can): its nearest
    existing ancestor must be a writable folder."""
    for above in path.parents:
        if above.exists():
            if not above.is_dir():
                return f"{above} is a file, not a folder"
            if not os.access(above, os.W_OK | os.X_OK):
                return f"{above} is not writable"
            return None
    return None


def out_dir(text: str) -> Path:
    """An argparse type: a folder the command writes into (checked before any work)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give a folder")
    if path.is_dir():
        return path if os.access(path, os.W_OK | os.X_OK) else _refuse(f"{path} is not writable")
    why = _creatable(path)
    return path if why is None else _refuse(why)


def out_file(text: str) -> Path:
    """An argparse type: a file the command writes (checked before any work)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give a file path")
    why = _creatable(path)
    return path if why is None else _refuse(why)


def existing_run_dir(text: str) -> Path:
    """An argparse type: an existing run directory (``pearl-hpc run`` printed it)."""
    path = Path(text)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{path} {what}; give the run directory `run` printed")
    return path


def _refuse(why: str) -> NoReturn:
    raise argparse.ArgumentTypeError(why)


def resolve_profile(name_or_path: str, flag: str = "--profile") -> Path:
    """A profile path, or the name of a shipped profile in ``configs/profiles``."""
    return _resolve_shipped("profiles", flag, name_or_path)


def resolve_workload(name_or_path: str) -> Path:
    """A workload path, or the name of a shipped workload in ``configs/workloads``."""
    return _resolve_shipped("workloads", "--workload", name_or_path)


def _resolve_shipped(folder: str, flag: str, name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        return path
    shipped = REPO_CONFIGS / folder / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in (REPO_CONFIGS / folder).glob("*.yaml"))
    kind = folder.rstrip("s")
    raise ConfigError(
        f"{flag} {name_or_path!r}: no such file or shipped {kind}; shipped: {', '.join(names)}"
    )
