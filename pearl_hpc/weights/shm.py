"""A weight version in the node's shared memory, which the engines on trainer 0's node map
instead of receiving it over a weight group.

    trainer 0 (after each step)                      an engine on the same node
    ───────────────────────────                      ──────────────────────────
    staged = store.stage(full, version, dtype)
      one file per version in /dev/shm: the
      tensors cast straight into it
    ── path + header (RPC) ──────────────────────▶   named = map_version(path, header)
                                                     the engine loads the views and keeps
                                                     them as its host copy (no copy made)
    a later version published: older files
    unlinked (a mapping stays valid until dropped)

Why shared memory and not CUDA IPC or a weight group: trainer 0's copy of each version is
in host memory anyway (gathered there once per step, in the engines' dtype), and an engine keeps
a host copy for its restarts and wakes. A same-node engine maps the very pages the trainer
wrote: no network, no copy on either side, one copy in the node's memory however many
engines share it, and no communicator (NCCL refuses two ranks on one GPU, which an overlap
engine on trainer 0's GPU would be). Engines on other nodes get the version over the weight
group as before.

Which engines share the trainer's memory is tested, not guessed from host names: the
store writes a probe file with a random token; an engine that reads that token back sees
the same ``/dev/shm`` (:meth:`SharedStore.probe`).

Space is reserved with ``posix_fallocate`` before anything is written: a full tmpfs makes
a write into a mapping fail with SIGBUS, which no handler can turn into an error; a
version that does not fit is staged in private memory instead and reaches every engine
over the network (:attr:`Staged.path` is then ``None``).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pearl_hpc.weights.leftovers import SHM_ROOT, sweep
from pearl_hpc.weights.wire import WeightsHeader, WeightSyncError, describe, digest, unpack

log = logging.getLogger(__name__)

ONE_BUCKET = 1 << 62  # a version's file is one bucket: every tensor at its aligned offset


@dataclass(frozen=True)
class Staged:
    """The weights the engines get next: ``state`` in the engines' dtype (views into the
    shared file when ``path`` is set), at ``version``."""

    state: dict[str, torch.Tensor]
    version: int
    path: str | None = None  # the shared file, for engines on this node
    header: dict[str, Any] | None = None  # its layout (WeightsHeader.to_dict)
    digest: Future[bytes] | None = None  # being hashed since it was staged (None: not asked)


class SharedStore:
    """Trainer 0's directory of weight versions in shared memory (one per run)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=False)
        self.token = secrets.token_hex(16)
        self.probe_path = directory / "probe"
        self.probe_path.write_text(self.token)

    @classmethod
    def create(cls, name: str, root: Path = SHM_ROOT) -> SharedStore | None:
        """The store of run ``name`` under ``root``, after removing what an earlier
        trainer of that run on this node left behind when it died (None, with a log line,
        where there is no such tmpfs: every engine then gets the weights over the
        network)."""
        if not root.is_dir():
            log.info("weights: no %s here; engines get every version over the network", root)
            return None
        sweep(root)
        mine = root / f"pearl-{name}-{os.getpid()}"
        shutil.rmtree(mine, ignore_errors=True)  # a reused pid's: that trainer is gone
        return cls(mine)

    @property
    def probe(self) -> tuple[str, str]:
        """(path, token): an engine that reads the token at the path shares this memory."""
        return str(self.probe_path), self.token

    def stage(
        self,
        state: Mapping[str, torch.Tensor],
        version: int,
        dtype: torch.dtype | None = None,
        *,
        digest: bool = False,
    ) -> Staged:
        """``state`` (host tensors) as the engines' copy of ``version``, written once into
        this version's file (floating tensors cast to ``dtype`` on the way, if given;
        ``digest``: hashed in the background once it is written -- not beside the
        writes, whose parallel copies the hashing threads would slow several-fold)."""
        made = self.allocate(describe(_like(state, dtype), version, bucket_bytes=ONE_BUCKET))
        if made is None:
            return stage_private(state, version, dtype, digest=digest)
        path, header, named = made
        views = dict(named)
        for name, view in views.items():
            view.copy_(state[name])  # the cast, straight into shared memory
        return Staged(views, version, path, header.to_dict(), _hashing(views) if digest else None)

    def allocate(
        self, layout: WeightsHeader
    ) -> tuple[str, WeightsHeader, list[tuple[str, torch.Tensor]]] | None:
        """The file of ``layout``'s version (its tensors as one bucket, in their order):
        its path, that one-bucket header and the zeroed views to fill; None where the
        tmpfs has no room (logged)."""
        whole = layout.whole()
        path = self.directory / f"v{whole.version:06d}"
        if not _reserve(path, whole.num_bytes):
            return None
        flat = torch.from_file(str(path), shared=True, size=whole.num_bytes, dtype=torch.uint8)
        return str(path), whole, unpack(whole, 0, flat)

    def unlink(self, version: int) -> None:
        """Remove ``version``'s file (one that was refused)."""
        (self.directory / f"v{version:06d}").unlink(missing_ok=True)

    def unlink_before(self, version: int) -> None:
        """Remove the files of versions older than ``version`` (engines that mapped one
        keep it until they drop it)."""
        for path in self.directory.glob("v*"):
            if path.name[1:].isdigit() and int(path.name[1:]) < version:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def stage_private(
    state: Mapping[str, torch.Tensor],
    version: int,
    dtype: torch.dtype | None = None,
    *,
    digest: bool = False,
) -> Staged:
    """``state`` in this process's own memory (no shared file), floating tensors cast to
    ``dtype`` if given (``to`` copies nothing that is already in it); ``digest``: hashed
    in the background once cast."""
    cast = {
        k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
        for k, v in state.items()
    }
    return Staged(cast, version, digest=_hashing(cast) if digest else None)


_HASHING = ThreadPoolExecutor(1, thread_name_prefix="version-digest")  # one version at a time


def _hashing(state: Mapping[str, torch.Tensor]) -> Future[bytes]:
    """``state``'s :func:`~pearl_hpc.weights.wire.digest`, computed in the background."""
    return _HASHING.submit(digest, list(state.items()))


def shares_memory(probe_path: str, token: str) -> bool:
    """Engine side: whether the trainer's probe file is here with its token."""
    try:
        return Path(probe_path).read_text() == token
    except OSError:
        return False


def map_version(path: str, header: Mapping[str, Any]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Engine side: the version at ``path`` as ``(name, tensor)`` views of a private,
    read-on-demand mapping of it (nothing copied; writes would not reach the file)."""
    layout = WeightsHeader.from_dict(header)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise WeightSyncError(
            f"weights v{layout.version}: cannot open {path} ({exc.strerror}); the trainer "
            "removed it or this engine is not on the trainer's node"
        ) from exc
    if size != layout.num_bytes:
        raise WeightSyncError(
            f"weights v{layout.version}: {path} has {size} bytes, the header says "
            f"{layout.num_bytes}; it belongs to another version"
        )
    flat = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    return layout.version, unpack(layout, 0, flat)


def _like(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Shape-only stand-ins of ``state``, floating tensors in ``dtype`` if given (for the
    header: nothing allocated)."""
    return {
        name: torch.empty(
            t.shape, dtype=dtype if dtype and t.is_floating_point() else t.dtype, device="meta"
        )
        for name, t in state.items()
    }


def _reserve(path: Path, size: int) -> bool:
    """Create ``path`` with ``size`` bytes allocated (False, with a log line, if the
    tmpfs has no room: the version then goes over the network)."""
    # a new inode, never the old one truncated: an engine touching a page of a mapping
    # past a truncated end dies of SIGBUS (a version staged again, say)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return True
    except OSError as exc:
        log.warning(
            "weights: no room for %.1f MiB in %s (%s); this version goes over the network",
            size / 2**20, path.parent, exc.strerror,
        )  # fmt: skip
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)
