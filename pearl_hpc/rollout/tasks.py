"""Task datasets: the prompts a run trains on, read from local files (``run.tasks``).

    run:
      tasks:
        path: data/problems.jsonl     # .jsonl, .parquet, or a `datasets` save_to_disk dir
        eval_path: ''                 # a held-out file; else eval_fraction of path is held out
        eval_fraction: 0.1
        shuffle: true                 # a new seeded order every pass over the tasks

Each row is a JSON object (a Parquet or ``datasets`` row: its columns) handed whole to
the environment's ``reset(seed, task)``; ``"id"`` is the row's ``id`` or ``task_id``
column, else ``<file stem>-<row>``, and must be unique. Group ``g`` of step ``s`` gets
the ``(s * num_groups + g)``-th task of the training split, in pass ``p``'s order, a
permutation drawn from ``(seed, p)``; so the schedule is a pure function of the step and
a resumed run continues the dataset exactly where its journal's last step left it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearl_hpc.config.run import RunSettings
from pearl_hpc.errors import ConfigError

Task = dict[str, Any]


@dataclass(frozen=True)
class TaskSet:
    """The training and held-out tasks of a run, and the order they are drawn in."""

    train: tuple[Task, ...]
    eval: tuple[Task, ...] = ()
    shuffle: bool = True
    seed: int = 0
    _orders: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.train:
            raise ConfigError("run.tasks: the training split has no tasks")

    def index(self, step: int, group: int, num_groups: int) -> int:
        """Which training task group ``group`` of step ``step`` gets."""
        epoch, position = divmod(step * num_groups + group, len(self.train))
        return self._order(epoch)[position]

    def for_group(self, step: int, group: int, num_groups: int) -> Task:
        return self.train[self.index(step, group, num_groups)]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.train)))
            if self.shuffle:
                random.Random(f"tasks:{self.seed}:{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]


def load_task_set(
    path: str,
    *,
    eval_path: str = "",
    eval_fraction: float = 0.0,
    shuffle: bool = True,
    seed: int = 0,
    base: Path | None = None,
) -> TaskSet:
    """Read ``path`` (and ``eval_path``, relative to ``base``); errors name the field."""
    rows = read_tasks(_resolve(path, base), field="run.tasks.path")
    if eval_path:
        held_out = read_tasks(_resolve(eval_path, base), field="run.tasks.eval_path")
        return TaskSet(tuple(rows), tuple(held_out), shuffle, seed)
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"run.tasks.eval_fraction must be in [0, 1), got {eval_fraction}")
    order = list(range(len(rows)))
    random.Random(f"split:{seed}").shuffle(order)
    n_eval = math.ceil(len(rows) * eval_fraction)
    held = set(order[:n_eval])
    train = tuple(r for i, r in enumerate(rows) if i not in held)
    return TaskSet(train, tuple(r for i, r in enumerate(rows) if i in held), shuffle, seed)


def _resolve(path: str, base: Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p


def read_tasks(path: Path, field: str = "run.tasks.path") -> list[Task]:
    """Rows of a JSONL or Parquet file or a ``datasets`` directory, each with its id."""
    if not path.exists():
        raise ConfigError(f"{field}: {path} does not exist; give a .jsonl or .parquet file")
    if path.is_dir():
        rows = _datasets_rows(path, field)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path, field)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(path, field)
    else:
        raise ConfigError(
            f"{field}: {path.name}: use a .jsonl or .parquet file or a datasets directory"
        )
    if not rows:
        raise ConfigError(f"{field}: {path} holds no tasks")
    return _with_ids(rows, path.stem, field)


def _jsonl_rows(path: Path, field: str) -> list[Task]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{field}: {path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{field}: {path}:{number}: a task is a JSON object")
            rows.append(row)
    return rows


def _parquet_rows(path: Path, field: str) -> list[Task]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ConfigError(f"{field}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        return list(pq.read_table(path).to_pylist())
    except Exception as e:
        raise ConfigError(f"{field}: {path}: not a Parquet file ({e})") from None


def _datasets_rows(path: Path, field: str) -> list[Task]:
    """A ``Dataset.save_to_disk`` directory (a ``DatasetDict``'s: its ``train`` split)."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise ConfigError(
            f"{field}: {path} is a directory; reading a datasets directory needs "
            "`pip install datasets` (or give a .jsonl / .parquet file)"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise ConfigError(f"{field}: {path}: not a datasets directory ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"{field}: {path}: no 'train' split (has {sorted(loaded)})")
        loaded = loaded["train"]
    return list(loaded.to_list())


def _with_ids(rows: Sequence[Task], stem: str, field: str) -> list[Task]:
    out, seen = [], set()
    for i, row in enumerate(rows):
        task_id = str(row.get("id", row.get("task_id", f"{stem}-{i}")))
        if task_id in seen:
            raise ConfigError(f"{field}: task id {task_id!r} appears twice; ids must be unique")
        seen.add(task_id)
        out.append({**row, "id": task_id})
    return out


def load_tasks(run: RunSettings) -> TaskSet | None:
    """``run.tasks`` read (None when unset)."""
    t = run.tasks
    if not t.path:
        if t.eval_path:
            raise ConfigError("run.tasks.eval_path is set without run.tasks.path; set both")
        return None
    return load_task_set(
        t.path,
        eval_path=t.eval_path,
        eval_fraction=t.eval_fraction,
        shuffle=t.shuffle,
        seed=run.seed,
    )
