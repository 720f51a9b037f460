"""The weights of one version as a header and bounded buckets, and who holds which.

Data flow (the groups themselves are :mod:`pearl_hpc.weights.group`'s)::

    trainer (rank 0 of a weight group)               rollout engine (any other rank)
    ──────────────────────────────────               ───────────────────────────────
    state = trainer.state_dict(engine dtype)
    header = describe(state, version)
    send the header (msgpack)        ── header ──▶   header (names, shapes, dtypes, buckets)
    for each bucket b:                               for each bucket b:
        flat = pack_bucket(header, b, state)             flat = empty(bucket_bytes(b))
        send(flat)                   ── bucket ──▶       recv(flat)
                                                         host copy of unpack(header, b, flat)
                                                     engine loads the version (host copy)
    versions.published(v)                            versions.loaded(worker_id, v)

    later, for a worker that joined (or missed a sync) after the broadcast: the same,
    point to point

Decisions (and why):

- **Bounded buckets, not one buffer per sync.** A model has hundreds of tensors; one
  collective per tensor pays the backend's per-call latency hundreds of times, while one
  buffer of the whole model is 16 GB on each side for an 8B model in bf16 (32 GB in
  fp32), held through the engine's next sleep. Tensors are packed into buckets of at most
  :data:`BUCKET_BYTES`, 512 MiB (vLLM's own NCCL weight transfer streams through 1 GiB
  buffers); each side holds two at a time (:data:`BUCKETS_IN_FLIGHT`, 1 GiB on the
  device): the source packs bucket b + 1 while b is sent, a receiver copies bucket b
  into host memory while b + 1 arrives (the copies on a stream of their own on CUDA, so
  they overlap the transfer; :mod:`pearl_hpc.weights.group`), and the engine keeps
  generating while the version
  arrives (it loads it afterwards, from the host copy it keeps for restarts anyway; the
  receive runs off the engine thread, so a broadcast whose source gave up never blocks
  the engine). :func:`unpack` returns *views* into a bucket, in the ``(name, tensor)``
  form vLLM's ``reload_weights(weights_iterator=...)`` takes.
- **A bucket never splits a block.** vLLM loads a layer's checkpoint tensors (q/k/v into
  one fused ``qkv_proj``, every expert of a MoE layer) and processes the layer once all of
  them arrived; a loader fed straight from the buckets would keep a straddling layer's
  views into a buffer the next bucket overwrites. Tensors are grouped by :func:`block_of` (the
  transformer block ``model.layers.N``, else the module) and a bucket boundary only
  falls between groups; a group larger than the bound is a bucket of its own.
- **The engine's dtype on the wire.** The trainer's copy is in the dtype the engine holds
  (bf16 for a bf16 model on GPU, fp32 on CPU engines), so a sync moves half the bytes of
  fp32 and the engine's result is the same (its loader would round to bf16 anyway).
- **Every tensor starts on a 16-byte boundary** (:data:`ALIGN_BYTES`), so a view of any
  dtype is legal and vectorised copies out of it stay aligned. The offsets are a pure
  function of the header, so the header does not carry them.
- **The header is a dict of plain values** (names, shapes, dtype names, bucket ends);
  receivers rebuild and validate the :class:`WeightsHeader`, so a corrupted or mismatched
  header fails here with a message instead of as a wrong-sized tensor inside the engine.
- **Lazy propagation.** Broadcasting to everyone after every step would stall workers in
  the middle of a turn. :class:`~pearl_hpc.train.sync.WeightVersions` records which
  worker holds which version; a worker within ``max_staleness`` versions of the latest
  may keep generating, and one that falls behind (or joins later) gets the weights point
  to point before its next turn.
- **Devices.** With NCCL the buckets live on the current CUDA device; with gloo on the CPU.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pearl_hpc.config.memory import BUCKET_BYTES, BUCKETS_IN_FLIGHT
from pearl_hpc.errors import PearlError

ALIGN_BYTES = 16  # every tensor's first byte in a bucket is a multiple of this

# dtypes a weights bucket may carry, by the name the header uses
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}


class WeightSyncError(PearlError):
    """A weights header is inconsistent, a transfer failed, or a worker's version
    bookkeeping was asked for an impossible move; the message says which and why."""


# --------------------------------------------------------------------------- packing


@dataclass(frozen=True, slots=True)
class WeightsHeader:
    """What a receiver needs to allocate each bucket and cut it back into tensors."""

    version: int  # trainer version of these weights (0 = the model directory's weights)
    names: tuple[str, ...]  # state-dict names, in transfer order
    shapes: tuple[tuple[int, ...], ...]  # one per name
    dtypes: tuple[str, ...]  # torch dtype names without "torch.", e.g. "bfloat16"
    bucket_ends: tuple[int, ...]  # bucket b holds names[bucket_ends[b-1]:bucket_ends[b]]

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise WeightSyncError(f"weights header: version must be an int, got {self.version!r}")
        if self.version < 0:
            raise WeightSyncError(f"weights header: version must be >= 0, got {self.version}")
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise WeightSyncError(
                f"weights header: {len(self.names)} names, {len(self.shapes)} shapes and "
                f"{len(self.dtypes)} dtypes; they must have one entry per tensor"
            )
        if len(set(self.names)) != len(self.names):
            dupes = sorted({n for n in self.names if self.names.count(n) > 1})
            raise WeightSyncError(f"weights header: duplicate tensor names {dupes}")
        for name, dtype in zip(self.names, self.dtypes, strict=True):
            if dtype not in _DTYPES:
                raise WeightSyncError(
                    f"weights header: tensor {name!r} has dtype {dtype!r}; supported: "
                    f"{', '.join(_DTYPES)}"
                )
        for name, shape in zip(self.names, self.shapes, strict=True):
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                raise WeightSyncError(f"weights header: tensor {name!r} has bad shape {shape!r}")
        ends = self.bucket_ends
        if (
            not self.names
            or not ends
            or ends[-1] != len(self.names)
            or any(not isinstance(e, int) or isinstance(e, bool) for e in ends)
            or any(b <= a for a, b in zip((0, *ends), ends, strict=False))
        ):
            raise WeightSyncError(
                f"weights header: bucket ends {list(ends)} must rise strictly to the "
                f"{len(self.names)} tensors; sender and receiver disagree on the layout"
            )

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_ends)

    def bucket(self, b: int) -> range:
        """The tensor indices of bucket ``b``."""
        return range(self.bucket_ends[b - 1] if b else 0, self.bucket_ends[b])

    def bucket_bytes(self, b: int) -> int:
        """Bytes of bucket ``b``, alignment padding included."""
        idx = self.bucket(b)
        return _layout(self.shapes[idx.start : idx.stop], self.dtypes[idx.start : idx.stop])[1]

    def whole(self) -> WeightsHeader:
        """The same tensors as one bucket, in their order (a version's file)."""
        return WeightsHeader(self.version, self.names, self.shapes, self.dtypes, (len(self.names),))

    @property
    def num_bytes(self) -> int:
        """Bytes of every bucket together (what one sync moves)."""
        return sum(self.bucket_bytes(b) for b in range(self.num_buckets))

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (what goes over the wire as msgpack)."""
        return {
            "version": self.version,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "bucket_ends": list(self.bucket_ends),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightsHeader:
        """Rebuild (and validate) a header received from a peer."""
        try:
            return cls(
                version=data["version"],
                names=tuple(str(n) for n in data["names"]),
                shapes=tuple(tuple(s) for s in data["shapes"]),
                dtypes=tuple(str(d) for d in data["dtypes"]),
                bucket_ends=tuple(data["bucket_ends"]),
            )
        except (KeyError, TypeError) as exc:
            raise WeightSyncError(
                f"weights header from a peer is malformed ({exc!r}); sender and receiver "
                "must run the same pearl_hpc version"
            ) from exc


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _num_bytes(shape: tuple[int, ...], dtype: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPES[dtype].itemsize


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def _layout(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> tuple[list[int], int]:
    """Byte offset of each tensor of one bucket, and the bucket's size (pure)."""
    offsets, end = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        start = _align(end)
        offsets.append(start)
        end = start + _num_bytes(shape, dtype)
    return offsets, end


def block_of(name: str) -> str:
    """The group a bucket keeps whole: the name up to its first numeric part (the
    transformer block, ``model.layers.3``, with every expert of a MoE layer), else its
    module (``model.embed_tokens``, ``lm_head``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def plan_buckets(names: Sequence[str], sizes: Sequence[int], limit: int) -> tuple[int, ...]:
    """Bucket ends over ``names`` (already grouped by block) with ``sizes`` in bytes: a
    bucket closes before a block that would take it past ``limit`` (pure)."""
    if limit <= 0:
        raise WeightSyncError(f"bucket size must be > 0 bytes, got {limit}")
    ends: list[int] = []
    used, i = 0, 0
    while i < len(names):
        block, j, size = block_of(names[i]), i, 0
        while j < len(names) and block_of(names[j]) == block:
            size += _align(sizes[j])
            j += 1
        if used and used + size > limit:
            ends.append(i)
            used = 0
        used += size
        i = j
    ends.append(len(names))
    return tuple(ends)


def describe(
    state: Mapping[str, torch.Tensor], version: int = 0, *, bucket_bytes: int = BUCKET_BYTES
) -> WeightsHeader:
    """The header of ``state`` at ``version``: tensors grouped by block (first appearance
    order), in buckets of at most ``bucket_bytes`` (pure)."""
    if not state:
        raise WeightSyncError("weights: the state dict is empty; there are no weights to send")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        if _dtype_name(tensor.dtype) not in _DTYPES:
            raise WeightSyncError(
                f"weights: tensor {name!r} has dtype {tensor.dtype}; supported: "
                f"{', '.join(_DTYPES)}"
            )
    first: dict[str, int] = {}
    for i, name in enumerate(state):
        first.setdefault(block_of(name), i)
    names = tuple(sorted(state, key=lambda n: first[block_of(n)]))  # stable: blocks whole
    shapes = tuple(tuple(state[n].shape) for n in names)
    dtypes = tuple(_dtype_name(state[n].dtype) for n in names)
    sizes = [_num_bytes(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    ends = plan_buckets(names, sizes, bucket_bytes)
    return WeightsHeader(version, names, shapes, dtypes, ends)


def pack_bucket(
    header: WeightsHeader,
    b: int,
    state: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bucket ``b`` of ``state`` as one flat ``uint8`` tensor on ``device`` (default: the
    CPU), or in the front of ``out`` (a staging buffer the source reuses for every
    bucket); each tensor is copied once, straight into its slot."""
    size = header.bucket_bytes(b)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=device or "cpu")
    flat = out[:size]
    flat.zero_()  # the alignment padding is sent too, and should not leak old memory
    for name, slot in unpack(header, b, flat):
        tensor = state[name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise WeightSyncError(
                f"weights: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)} but the "
                f"header says {slot.dtype} {tuple(slot.shape)}; it changed after describe()"
            )
        slot.copy_(tensor.detach())  # handles strides and devices
    return flat


def unpack(header: WeightsHeader, b: int, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Cut bucket ``b`` back into ``(name, tensor)`` pairs: views, no copy, on ``flat``'s
    device. They alias the bucket: copy them (an engine's weight loader does) before
    reusing its memory."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise WeightSyncError(
            f"unpack: expected a 1-d uint8 buffer, got {flat.dtype} of shape {tuple(flat.shape)}"
        )
    if flat.numel() != header.bucket_bytes(b):
        raise WeightSyncError(
            f"unpack: bucket {b} has {flat.numel()} bytes but the header (version "
            f"{header.version}) says {header.bucket_bytes(b)}; it belongs to another sync"
        )
    idx = header.bucket(b)
    names = header.names[idx.start : idx.stop]
    shapes = header.shapes[idx.start : idx.stop]
    dtypes = header.dtypes[idx.start : idx.stop]
    offsets, _ = _layout(shapes, dtypes)
    out = []
    for name, shape, dtype, start in zip(names, shapes, dtypes, offsets, strict=True):
        size = _num_bytes(shape, dtype)
        out.append((name, flat[start : start + size].view(_DTYPES[dtype]).view(shape)))
    return out


__all__ = [
    "ALIGN_BYTES",
    "BUCKETS_IN_FLIGHT",
    "BUCKET_BYTES",
    "WeightSyncError",
    "WeightsHeader",
    "block_of",
    "describe",
    "pack_bucket",
    "plan_buckets",
    "unpack",
]


def digest(named: Iterable[tuple[str, torch.Tensor]], threads: int | None = None) -> bytes:
    """SHA-256 of a version: each tensor's name, dtype, shape and bytes, in name order
    (the order it travelled in does not count). The trainer sends it over the
    authenticated RPC and a receiver compares it with what arrived before loading: gloo
    and NCCL carry no MAC of their own. Tensors hash in parallel threads (hashlib lets go
    of the GIL): about 1.8 GB/s a core, so an 8B model in bf16 (16.4 GB) takes ~1.2 s on
    8 cores; one on a GPU is copied to the host first."""
    tensors = dict(named)
    with ThreadPoolExecutor(max_workers=threads or HASH_THREADS) as pool:
        hashed = pool.map(tensor_digest, tensors, tensors.values())
        return combine(dict(zip(tensors, hashed, strict=True)))


HASH_THREADS = min(8, len(os.sched_getaffinity(0)))  # this rank's CPUs (Slurm binds them)


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """SHA-256 of one tensor's name, dtype, shape and bytes (a part of :func:`digest`;
    a receiver hashes each as it lands)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    h = hashlib.sha256(f"{name}|{_dtype_name(tensor.dtype)}|{tuple(tensor.shape)}".encode())
    h.update(flat.numpy().data)
    return h.digest()


def combine(parts: Mapping[str, bytes]) -> bytes:
    """The version's digest from its tensors' (:func:`tensor_digest`), in name order."""
    return hashlib.sha256(b"".join(parts[name] for name in sorted(parts))).digest()


class Hasher:
    """:func:`digest` of tensors given one at a time as they arrive (each hashed in
    threads while the next arrives): ready with the last one, not a second pass over the
    version. For a receiver, whose copies out of a GPU bucket are DMA; beside host
    copies of torch's own threads the hashing threads would slow both."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="hash")
        self._parts: dict[str, Any] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Hash ``tensor`` (it must not change until :meth:`result`)."""
        self._parts[name] = self._pool.submit(tensor_digest, name, tensor)

    def result(self) -> bytes:
        try:
            return combine({name: part.result() for name, part in self._parts.items()})
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
