"""Weight groups outside torch.distributed's default world.

An in-process vLLM engine initialises torch.distributed's *default* process group for
itself (world size 1), and rebuilds it on every restart (role change, release/restore).
A weight group in the same process must therefore not touch the default group: joining
one there made the next engine start hang inside vLLM's world setup. A
:class:`WeightGroup` is a bare ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) over a
prefix of a store — the approach vLLM's own stateless groups take — so any number of
them can live beside the engine, one per membership epoch.

The trainer owns the store (:class:`~pearl_hpc.engine.store.KeyStore`: the run's key
first, then a key or value); each group is a fresh, unguessable key prefix with ranks
``0 .. size-1`` where 0 is the trainer. Weights travel as the header (the
:class:`~pearl_hpc.weights.wire.WeightsHeader` dict of plain values as msgpack, length
first: a receiver decodes data, never code) and then one flat buffer
(:func:`~pearl_hpc.weights.wire.pack`).

A member that dies inside a transfer must not take the others with it. :meth:`WeightGroup.
close` aborts the communicator (NCCL's ``ncclCommAbort`` ends a collective blocked on a
dead peer; gloo's ends when the dead peer's socket closes, or at the timeout), and an
NCCL group is made with torch's error handling in its clean-up-only mode (2: a watchdog
timeout aborts the communicator without tearing the process down, whatever the
process's other groups do), so the trainer and the surviving engines outlive a group
that broke; the trainer then forms the next epoch's group without the dead
(:mod:`pearl_hpc.train.sync`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from pearl_hpc.weights.wire import (
    BUCKET_BYTES,
    WeightsHeader,
    WeightSyncError,
    describe,
    pack_bucket,
    unpack,
)

BACKENDS = ("gloo", "nccl")
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # read by each group as it is made
CLEAN_UP_ONLY = "2"  # abort the communicator on a watchdog timeout; the process lives
_ENV = threading.Lock()


class WeightGroup:
    """One group of ranks ``0..size-1`` under ``prefix`` of ``store`` (a
    ``torch.distributed.Store`` the caller keeps open while the group lives: NCCL meets
    in it again for each new communicator)."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        size: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        if backend not in BACKENDS:
            raise WeightSyncError(f"weight group backend {backend!r}: use one of {BACKENDS}")
        if not 0 <= rank < size:
            raise WeightSyncError(f"weight group {prefix}: rank {rank} not in 0..{size - 1}")
        timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(prefix, store)
        self.rank, self.size, self.prefix, self.backend = rank, size, prefix, backend
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # else NCCL's 10-minute default, not timeout_s
            with _ENV:  # this group's handling only (FSDP's own groups keep theirs)
                before = os.environ.get(NCCL_ERROR_HANDLING)
                os.environ[NCCL_ERROR_HANDLING] = CLEAN_UP_ONLY
                try:
                    self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, size, options)
                finally:
                    if before is None:
                        del os.environ[NCCL_ERROR_HANDLING]
                    else:
                        os.environ[NCCL_ERROR_HANDLING] = before
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def close(self) -> None:
        """Abort the communicator, a transfer in flight included: NCCL's ends at once
        (NCCL keeps a communicator per group until told); gloo's ends when its peer's
        socket does, or at the timeout."""
        self.pg.abort()

    def synchronize(self) -> None:
        """Wait for this thread's transfers (NCCL's ``wait()`` only makes the current
        stream wait for them: without this a transfer's seconds would be its enqueue
        time; the other streams -- the copies of another bucket -- go on)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

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


def send_weights(
    group: WeightGroup,
    state: Mapping[str, torch.Tensor],
    version: int,
    *,
    dst: int | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> WeightsHeader:
    """The source's side of one sync: the header, then each bucket, broadcast from this
    rank over ``group`` (or sent to ``dst`` alone), through one staging buffer of the
    largest bucket's size, freed when it returns."""
    how = "broadcast" if dst is None else f"send to rank {dst}"
    header = describe(state, version, bucket_bytes=bucket_bytes)
    try:
        _send_buckets(group, header, state, dst)
    except RuntimeError as exc:
        raise WeightSyncError(f"weights {how} in {group.prefix} failed: {exc}") from exc
    finally:
        _release_cached(group.device)
    return header


def _send_buckets(
    group: WeightGroup, header: WeightsHeader, state: Mapping[str, torch.Tensor], dst: int | None
) -> None:
    if dst is None:
        group.broadcast_object(header.to_dict(), group.rank)
    else:
        group.send_object(header.to_dict(), dst)
    most = max(header.bucket_bytes(b) for b in range(header.num_buckets))
    staging = [torch.empty(most, dtype=torch.uint8, device=group.device) for _ in range(2)]
    side = _side_stream(group.device)
    sent: list[Any] = [None, None]  # each buffer's last send, as an event (CUDA)

    def pack(b: int) -> torch.Tensor:  # on a stream of its own: copies beside the sends
        with _current(side):
            if sent[b % 2] is not None:  # not over a buffer a send still reads
                side.wait_event(sent[b % 2])
            return pack_bucket(header, b, state, out=staging[b % 2])

    with ThreadPoolExecutor(1, thread_name_prefix="pack") as packer:
        packed = packer.submit(pack, 0)
        for b in range(header.num_buckets):
            flat = packed.result()
            _wait_for(side, group.device)  # the send waits for its bucket's copies
            if b + 1 < header.num_buckets:  # into the other buffer, as this one is sent
                packed = packer.submit(pack, b + 1)
            if dst is None:
                group.broadcast(flat, group.rank)
            else:
                group.send(flat, dst)
            sent[b % 2] = _recorded(group.device)
    group.synchronize()


class WeightStream:
    """The receiving side of one sync: the header arrives on construction, the buckets
    as the stream is iterated (``(name, tensor)`` views of one bucket at a time), bucket
    ``b + 1`` arriving on a thread (and CUDA stream) of its own while the consumer copies
    bucket ``b`` out (:func:`receive_weights` copies them to host memory): two buckets on
    the device. :meth:`finish` receives what the consumer did not ask for: the transfer
    is a collective, and a receiver that stops early would leave the others waiting;
    :meth:`close` stops one whose consumer failed."""

    def __init__(self, group: WeightGroup, src: int = 0, *, p2p: bool = False) -> None:
        self.group, self.src, self.p2p = group, src, p2p
        self.recv_s = 0.0  # seconds waiting on the network (the rest is the loader's)
        self._next = 0  # the first bucket not yet asked for
        self._coming: Future[torch.Tensor] | None = None  # the one arriving meanwhile
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="recv")
        self._side = _side_stream(group.device)
        self.header = WeightsHeader.from_dict(
            self._transfer(
                lambda: group.recv_object(src) if p2p else group.broadcast_object(None, src)
            )
        )

    @property
    def version(self) -> int:
        return self.header.version

    def _transfer(self, fn: Any) -> Any:
        how = f"recv from rank {self.src}" if self.p2p else "broadcast"
        t0 = time.perf_counter()
        try:
            out = fn()
            self.group.synchronize()
            return out
        except RuntimeError as exc:
            raise WeightSyncError(
                f"weights {how} in {self.group.prefix} (rank {self.group.rank}) failed: {exc}"
            ) from exc
        finally:
            self.recv_s += time.perf_counter() - t0

    def _receive(self, b: int) -> torch.Tensor:
        """Bucket ``b`` (on the fetching thread, on its own stream)."""
        with _current(self._side):
            size = self.header.bucket_bytes(b)
            flat = torch.empty(size, dtype=torch.uint8, device=self.group.device)
            if self.p2p:
                self._transfer(lambda: self.group.recv(flat, self.src))
            else:
                self._transfer(lambda: self.group.broadcast(flat, self.src))
        return flat

    def _bucket(self) -> torch.Tensor:
        """The next bucket; the one after it starts arriving before this returns (the
        consumer copies one out while the next lands: two buckets on the device)."""
        coming = self._coming or self._fetcher.submit(self._receive, self._next)
        self._coming = None
        flat = coming.result()
        self._next += 1
        if self._next < self.header.num_buckets:
            self._coming = self._fetcher.submit(self._receive, self._next)
        return flat

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._next < self.header.num_buckets:
            b = self._next
            yield from unpack(self.header, b, self._bucket())

    def finish(self) -> None:
        """Receive (and drop) the buckets not yet iterated; free the device cache."""
        try:
            while self._next < self.header.num_buckets:
                self._bucket()
        finally:
            self.close()

    def close(self) -> None:
        """Stop receiving (a consumer that failed: the group's abort or timeout ends a
        bucket still arriving) and free the device cache."""
        if self._coming is not None:
            self._coming.cancel()
            self._coming = None
        self._fetcher.shutdown(wait=False)
        _release_cached(self.group.device)


def receive_weights(
    group: WeightGroup, src: int = 0, *, p2p: bool = False
) -> tuple[int, list[tuple[str, torch.Tensor]], float]:
    """The receiving side of one sync, into host memory: each bucket is copied out while
    the next lands (the device holds two), so the engine keeps generating during the
    transfer and loads the version afterwards. Returns the version, the tensors, and the
    seconds spent waiting on the network."""
    stream = WeightStream(group, src, p2p=p2p)
    try:
        named = [(name, tensor.to("cpu", copy=True)) for name, tensor in stream]
    except BaseException:
        stream.close()
        raise
    stream.finish()
    return stream.version, named, stream.recv_s


def _side_stream(device: torch.device) -> Any:
    """A stream of its own for a bucket's copies (None off CUDA: gloo's calls block)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _current(stream: Any) -> Any:
    """``stream`` as this thread's current one (nothing off CUDA)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _wait_for(side: Any, device: torch.device) -> None:
    """The current stream waits for the work on ``side`` (a bucket's copies)."""
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)


def _recorded(device: torch.device) -> Any:
    """An event after the current stream's work so far (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _release_cached(device: torch.device) -> None:
    """Give the caching allocator's freed bucket memory back to the device (an engine
    sized to free memory may wake on it next)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
