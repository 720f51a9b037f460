"""A tensor-parallel engine's weights as a file its worker processes map, so that a
version reaches them as a path and a header instead of pickled tensors.

    engine process (EngineRunner)                      each TP worker (vLLM mp executor)
    ─────────────────────────────                      ─────────────────────────────────
    a version arrives: mapped from the trainer's (or
      a neighbour engine's) shared file (held open),
      or received over the network straight into a
      file of its own in /dev/shm (the node's other
      engines may map it) or, without room there, an
      anonymous memfd (bytes: copied into one), off
      the engine thread
    collective_rpc("pearl_load_weights",
        (/proc/<pid>/fd/<fd>, header))  ──path──▶     map the file (read on demand);
                                                       reload_weights from the views: each
                                                       rank's loader reads only its shard

With one worker (the ``uni`` executor, in the engine's own process) the tensors go to
``reload_weights`` directly (views of the file, which stays mapped while they live). The
file stays open for as long as the version is the engine's host copy: a restarted engine
(role change, wake) re-applies it from the same path, even after the trainer removed its
name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pearl_hpc.weights.shm import ONE_BUCKET, SharedStore, map_version
from pearl_hpc.weights.wire import Hasher, WeightsHeader, describe, unpack

LOAD_METHOD = "pearl_load_weights"  # the worker extension's method (collective_rpc)


class WeightFile:
    """One version in a file this process holds open (its name may be gone)."""

    def __init__(self, fd: int, header: dict[str, Any]) -> None:
        self.fd, self.header = fd, header

    @classmethod
    def of_mapping(cls, path: str, header: Mapping[str, Any]) -> WeightFile:
        """The trainer's shared file of a version (it may unlink it: the fd keeps it)."""
        return cls(os.open(path, os.O_RDONLY | os.O_CLOEXEC), dict(header))

    @classmethod
    def of_tensors(
        cls, named: Sequence[tuple[str, torch.Tensor]], version: int
    ) -> tuple[WeightFile, list[tuple[str, torch.Tensor]]]:
        """``named`` copied into an anonymous in-memory file; returns it and views of the
        copy (they replace ``named`` as the host copy: one copy in memory, not two)."""
        state = dict(named)
        file, views = cls.allocate(describe(state, version, bucket_bytes=ONE_BUCKET))
        for name, view in views:
            view.copy_(state[name])
        return file, views

    @classmethod
    def allocate(cls, layout: WeightsHeader) -> tuple[WeightFile, list[tuple[str, torch.Tensor]]]:
        """An anonymous in-memory file (``memfd``) for ``layout``'s tensors, as one bucket
        in their order, and the (zeroed) views to fill."""
        whole = layout.whole()
        fd = os.memfd_create(f"pearl-weights-v{layout.version}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, whole.num_bytes)
            flat = torch.from_file(
                _fd_path(fd), shared=True, size=whole.num_bytes, dtype=torch.uint8
            )
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, whole.to_dict()), unpack(whole, 0, flat)

    @property
    def path(self) -> str:
        """The file, as another process of this user opens it."""
        return _fd_path(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WeightFileLoader:
    """vLLM worker extension (``worker_extension_cls``): a TP worker loads a version from
    a :class:`WeightFile`'s path."""

    def pearl_load_weights(self, path: str, header: dict[str, Any]) -> None:
        _version, named = map_version(path, header)
        self.reload_weights(weights_iterator=named)  # type: ignore[attr-defined]


def _fd_path(fd: int) -> str:
    return f"/proc/{os.getpid()}/fd/{fd}"


@dataclass
class Received:
    """A version that arrived over a weight group, in a file."""

    version: int
    named: list[tuple[str, torch.Tensor]]  # views of the file
    recv_s: float  # seconds waiting on the network
    file: WeightFile
    shared: dict[str, Any] | None  # in the engine's store: its path and header
    digest: bytes  # of what arrived (:func:`~pearl_hpc.weights.wire.digest`)


def receive_into_file(
    group: Any, src: int = 0, *, p2p: bool = False, store: SharedStore | None = None
) -> Received:
    """A version from the trainer over ``group`` straight into a new file, bucket by
    bucket: in ``store`` (the engine's directory in shared memory, where the other
    engines of its node can map it) when it has room, else an anonymous one. Each
    bucket's tensors are hashed in threads as the next bucket arrives, so the digest is
    ready with the last bucket (not a second pass over the version after it)."""
    from pearl_hpc.weights.group import WeightStream

    stream = WeightStream(group, src, p2p=p2p)
    made = store.allocate(stream.header) if store is not None else None
    shared = None
    if made is None:
        file, views = WeightFile.allocate(stream.header)
    else:
        path, whole, views = made
        header = whole.to_dict()
        shared = {"path": path, "header": header}
        file = WeightFile.of_mapping(path, header)
    into, hasher = dict(views), Hasher()
    try:
        for name, tensor in stream:
            hasher.add(name, into[name].copy_(tensor))
        stream.finish()
        check = hasher.result()
    except BaseException:
        hasher.close()
        stream.close()
        file.close()
        if store is not None and shared is not None:
            store.unlink(stream.version)
        raise
    return Received(stream.version, views, stream.recv_s, file, shared, check)


def file_for(
    tensor_parallel_size: int,
    named: Sequence[tuple[str, torch.Tensor]],
    version: int,
    mapped: tuple[str, Mapping[str, Any]] | None = None,
) -> tuple[WeightFile | None, list[tuple[str, torch.Tensor]]]:
    """The file a TP engine's workers load ``named`` from (the shared file they are views
    of, held open, or a copy), and the host copy to keep; none for one worker."""
    if tensor_parallel_size == 1:
        return None, list(named)
    if mapped is not None:
        return WeightFile.of_mapping(*mapped), list(named)
    return WeightFile.of_tensors(named, version)
