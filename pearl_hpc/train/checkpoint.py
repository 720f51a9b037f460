"""The trainer's checkpoints: sharded and asynchronous, with ``torch.distributed.checkpoint``.

    checkpoints/v000006/   the state after 6 updates (steps 0..5), DCP's layout:
        __R_0.distcp        trainer rank R's shards of the weights and of AdamW's state
        .metadata           DCP's index of them
        meta.json           written last, by trainer 0, once every rank's shards are on
                            disk: a directory without it (a save that was killed) is
                            never loaded and is removed at the next resume

What a checkpoint holds is all a trainer's state: the weights and AdamW's moments and
step counts (sharded as FSDP2 shards them; replicated weights are saved once, by trainer
0), and the version. The rest is a function of the version: the learning rate (its
schedule), the minibatch permutation (seeded by the run's seed and the version), the
tasks of each step (by step index) -- so nothing else is saved.

A save stages the rank's state in host memory (pinned on cuda) while the caller waits,
then writes it in a background thread while training goes on; one save is in flight at
a time (a save waits for the previous one). Loading reshards: a checkpoint of N ranks
loads on M (DCP reads each rank's rows of each tensor, FSDP2 or not).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pearl_hpc.rundir import CHECKPOINT_META, complete_checkpoints, version_dir
from pearl_hpc.train.objective import TrainError

if TYPE_CHECKING:
    from pearl_hpc.train.grpo import GRPOTrainer

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1  # meta.json "format"; bump when the layout changes


def latest_checkpoint(root: Path | str) -> Path | None:
    """The complete checkpoint with the highest version under ``root``, or None."""
    kept = complete_checkpoints(root)
    return kept[max(kept)] if kept else None


def checkpoint_of_version(root: Path | str, version: int) -> Path:
    """The complete checkpoint of ``version``; a missing one is a :class:`TrainError`
    naming those kept."""
    kept = complete_checkpoints(root)
    if version in kept:
        return kept[version]
    steps = ", ".join(str(v - 1) for v in sorted(kept)) or "none"
    raise TrainError(
        f"no checkpoint of the weights after step {version - 1} in {root} (kept: after steps "
        f"{steps}; a run keeps train.keep_checkpoints of them, every train.checkpoint_every "
        "steps and after the last)"
    )


def read_meta(checkpoint: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint directory, checked."""
    path = checkpoint / CHECKPOINT_META
    if not path.is_file():
        raise TrainError(f"{checkpoint} is not a complete checkpoint (no {CHECKPOINT_META})")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TrainError(f"{path} is not valid JSON: {exc}") from exc
    if meta.get("format") != CHECKPOINT_FORMAT or not isinstance(meta.get("version"), int):
        raise TrainError(
            f"{path}: format {meta.get('format')!r} / version {meta.get('version')!r} not "
            f"understood (this code reads format {CHECKPOINT_FORMAT})"
        )
    return dict(meta)


def _state(trainer: GRPOTrainer) -> dict[str, Any]:
    """The trainer's model and optimizer state dicts (DTensor shards under FSDP2), by
    parameter name (torch's checkpoint wrapper's prefix dropped): what DCP saves and
    loads. AdamW's state exists from the first update on (DCP initialises it before)."""
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def last_line(exc: BaseException) -> str:
    """An exception's last line (DCP's carries each rank's whole traceback)."""
    lines = str(exc).strip().splitlines()
    return lines[-1].strip() if lines else type(exc).__name__


def load_checkpoint(trainer: GRPOTrainer, checkpoint: Path) -> None:
    """Resume ``trainer`` (built from the model directory, on this rank's group) from
    ``checkpoint``: its weights, AdamW state and version, resharded to this group."""
    meta = read_meta(checkpoint)
    state = _state(trainer)
    try:
        dcp.load(state, checkpoint_id=checkpoint, no_dist=not trainer.sharded)
    except (Exception, CheckpointException) as exc:  # names the missing or mis-shaped key
        raise TrainError(
            f"checkpoint {checkpoint} does not fit the model in {trainer.model_dir}: "
            f"{last_line(exc)}"
        ) from exc
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    trainer.version = int(meta["version"])


class Checkpointer:
    """One trainer rank's saves into ``root``: staged while the caller waits, written in
    the background, at most one in flight; trainer 0 completes each (``meta.json``) and
    keeps the newest ``keep``.

    Under FSDP2 every rank writes its shards, coordinated over a gloo group of its own
    (created here: collective over the trainer ranks, so every rank constructs one), so
    the save's collectives never interleave with training's; replicated weights are
    saved by trainer 0 alone."""

    def __init__(
        self, root: Path | str, keep: int, *, sharded: bool, lead: bool, saved: int | None = None
    ) -> None:
        if keep < 2:
            raise TrainError(f"keep_checkpoints must be >= 2, got {keep}")
        self.root, self.keep, self.lead = Path(root), keep, lead
        self.saves = sharded or lead  # replicated: trainer 0's copy is every rank's
        self.sharded = sharded
        self.group = dist.new_group(backend="gloo") if sharded else None
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.pending: concurrent.futures.Future[int] | None = None
        self.saved: list[int] = []  # versions completed since :meth:`take_saved`
        # the version of the newest save started (or loaded: ``saved``), the same on every
        # rank: a version is saved once (a complete checkpoint is never written over)
        self.last = saved

    def save(self, trainer: GRPOTrainer) -> float:
        """Start saving ``trainer``'s state at its version; returns the seconds the caller
        waited (for the previous save to finish, then for the staging)."""
        if not self.saves:
            return 0.0
        t0 = time.perf_counter()
        self.wait()
        version = trainer.version
        if version == self.last:  # saved already (Slurm's warning, then the step's own)
            return time.perf_counter() - t0
        self.last = version
        path = version_dir(self.root, version)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        started = time.time()
        written = dcp.async_save(
            _state(trainer),
            checkpoint_id=path,
            process_group=self.group,
            async_stager=self.stager,
            no_dist=not self.sharded,
        )
        staged_s = time.perf_counter() - t0
        self.pending = self.writer.submit(self._complete, written, path, version, started, staged_s)
        return staged_s

    def _complete(
        self, written: Any, path: Path, version: int, started: float, staged_s: float
    ) -> int:
        """(The writer thread.) Once DCP has every rank's shards on disk: trainer 0
        makes the checkpoint visible (``meta.json``, durable) and drops old ones."""
        written.result()
        if self.lead:
            files = [p for p in path.iterdir() if p.is_file()]  # DCP fsynced them
            meta = {
                "format": CHECKPOINT_FORMAT,
                "version": version,
                "ranks": dist.get_world_size() if self.sharded else 1,
                "bytes": sum(f.stat().st_size for f in files),
                "started_at": round(started, 3),
                "staged_s": round(staged_s, 4),
                "written_at": round(time.time(), 3),
            }
            tmp = path / f".{CHECKPOINT_META}.tmp"
            tmp.write_text(json.dumps(meta, indent=1) + "\n")
            with tmp.open("rb") as handle:
                os.fsync(handle.fileno())
            tmp.replace(path / CHECKPOINT_META)
            kept = complete_checkpoints(self.root)
            for old in sorted(kept)[: -self.keep]:
                shutil.rmtree(kept[old], ignore_errors=True)
        self.saved.append(version)
        return version

    def wait(self) -> None:
        """Until the save in flight (if any) is complete; its failure is raised here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def take_saved(self) -> list[int]:
        """The versions whose saves completed since the last call."""
        out, self.saved = self.saved, []
        return out

    def close(self) -> None:
        """Finish the save in flight, then free the staging buffers."""
        try:
            self.wait()
        finally:
            self.writer.shutdown(wait=True)
            self.stager.close()
