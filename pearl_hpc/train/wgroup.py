"""Weight groups outside torch.distributed's default world.

An in-process vLLM engine initialises torch.distributed's *default* process group for
itself (world size 1), and rebuilds it on every restart (role change, release/restore).
A weight group in the same process must therefore not touch the default group: joining
one there made the next engine start hang inside vLLM's world setup. A
:class:`WeightGroup` is a bare ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) over a
prefixed ``TCPStore`` — the approach vLLM's own stateless groups take — so any number of
them can live beside the engine, one per membership epoch.

The trainer owns the store (:class:`WeightStore`); each group is a fresh key prefix with
ranks ``0 .. size-1`` where 0 is the trainer. Weights travel as the header (the
:class:`~pearl_hpc.train.weights.WeightsHeader` dict of plain values as msgpack, length
first: a receiver decodes data, never code) and then one flat buffer
(:func:`~pearl_hpc.train.weights.pack`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from pearl_hpc.train.weights import WeightsHeader, WeightSyncError, pack, unpack

BACKENDS = ("gloo", "nccl")


class WeightStore:
    """The trainer's rendezvous store (a TCPStore server) for weight groups."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0) -> None:
        self.host = host
        self.store = dist.TCPStore(
            host,
            port,
            None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self.port = int(self.store.port)


class WeightGroup:
    """One group of ranks ``0..size-1`` under ``prefix`` of the store at ``host:port``."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        rank: int,
        size: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        store: Any = None,
    ) -> None:
        if backend not in BACKENDS:
            raise WeightSyncError(f"weight group backend {backend!r}: use one of {BACKENDS}")
        if not 0 <= rank < size:
            raise WeightSyncError(f"weight group {prefix}: rank {rank} not in 0..{size - 1}")
        timeout = timedelta(seconds=timeout_s)
        base = (
            store
            if store is not None
            else dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
        )
        prefixed = dist.PrefixStore(prefix, base)
        self.rank, self.size, self.prefix, self.backend = rank, size, prefix, backend
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # else NCCL's 10-minute default, not timeout_s
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place (the default reduce op)."""
        self.pg.allreduce([tensor]).wait()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.pg.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.pg.recv([tensor], src, 0).wait()

    # ------------------------------------------------------------------ objects

    def _object_tensors(self, obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
        data = msgspec.msgpack.encode(obj)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        return torch.tensor([len(data)], dtype=torch.int64, device=self.device), payload

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            size, payload = self._object_tensors(obj)
            self.broadcast(size, src)
            self.broadcast(payload, src)
            return obj
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload, src)
        return msgspec.msgpack.decode(payload.cpu().numpy().tobytes())

    def send_object(self, obj: Any, dst: int) -> None:
        size, payload = self._object_tensors(obj)
        self.send(size, dst)
        self.send(payload, dst)

    def recv_object(self, src: int) -> Any:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.recv(size, src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.recv(payload, src)
        return msgspec.msgpack.decode(payload.cpu().numpy().tobytes())


def group_broadcast_weights(
    group: WeightGroup,
    state: Mapping[str, torch.Tensor] | None,
    version: int | None,
    src: int = 0,
) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Collective over ``group``: the header, then one flat buffer, from ``src``."""
    where = f"weights broadcast in {group.prefix} (rank {group.rank})"
    try:
        if group.rank == src:
            if state is None or version is None:
                raise WeightSyncError(f"{where}: the source passes the state and its version")
            header, flat = pack(state, version=version, device=group.device)
            group.broadcast_object(header.to_dict(), src)
        else:
            header = WeightsHeader.from_dict(group.broadcast_object(None, src))
            flat = torch.empty(header.num_bytes, dtype=torch.uint8, device=group.device)
        group.broadcast(flat, src)
    except RuntimeError as exc:
        raise WeightSyncError(f"{where} failed: {exc}") from exc
    return header.version, unpack(header, flat)


def group_send_weights(
    group: WeightGroup, state: Mapping[str, torch.Tensor], version: int, dst: int
) -> None:
    header, flat = pack(state, version=version, device=group.device)
    try:
        group.send_object(header.to_dict(), dst)
        group.send(flat, dst)
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weights send in {group.prefix} to rank {dst} failed: {exc}"
        ) from exc


def group_recv_weights(
    group: WeightGroup, src: int = 0
) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    try:
        header = WeightsHeader.from_dict(group.recv_object(src))
        flat = torch.empty(header.num_bytes, dtype=torch.uint8, device=group.device)
        group.recv(flat, src)
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weights recv in {group.prefix} from rank {src} failed: {exc}"
        ) from exc
    return header.version, unpack(header, flat)
