"""The weights of one version as a header and one flat buffer, and who holds which.

Data flow (the groups themselves are :mod:`pearl_hpc.train.wgroup`'s)::

    trainer (rank 0 of a weight group)               rollout engine (any other rank)
    ──────────────────────────────────               ───────────────────────────────
    state = trainer.state_dict()
    header, flat = pack(state, version)
    broadcast the header (msgpack)   ── header ──▶   header (names, shapes, dtypes, bytes)
                                                     flat = empty(header.num_bytes, uint8)
    broadcast(flat)                  ── 1 buffer ─▶  flat
                                                     engine.reload_weights(unpack(header, flat))
    versions.published(v)                            versions.loaded(worker_id, v)

    later, for a worker that joined (or missed a sync) after the broadcast: the same,
    point to point

Decisions (and why):

- **One flat byte buffer per sync.** A model has hundreds of tensors; one collective per
  tensor pays the backend's per-call latency hundreds of times. Packing costs one copy of
  the weights on the source and none on the receivers: :func:`unpack` returns *views* into
  the received buffer, in the ``(name, tensor)`` form vLLM's
  ``reload_weights(weights_iterator=...)`` takes.
- **Every tensor starts on a 16-byte boundary** (:data:`ALIGN_BYTES`), so a view of any
  dtype is legal and vectorised copies out of it stay aligned. The offsets are a pure
  function of the header, so the header does not carry them.
- **The header is a dict of plain values** (names, shapes, dtype names); receivers
  rebuild and validate the :class:`WeightsHeader`, so a corrupted or mismatched header
  fails here with a message instead of as a wrong-sized tensor inside the engine.
- **Lazy propagation.** Broadcasting to everyone after every step would stall workers in
  the middle of a turn. :class:`WeightVersions` records which worker holds which version;
  a worker within ``max_staleness`` versions of the latest may keep generating, and one
  that falls behind (or joins later) gets the weights point to point before its next turn.
- **Devices.** With NCCL the buffer lives on the current CUDA device; with gloo on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pearl_hpc.errors import ConfigError, PearlError

ALIGN_BYTES = 16  # every tensor's first byte in the flat buffer is a multiple of this

# dtypes a weights buffer may carry, by the name the header uses
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
    """What a receiver needs to allocate the flat buffer and cut it back into tensors."""

    version: int  # trainer version of these weights (0 = the model directory's weights)
    names: tuple[str, ...]  # state-dict names, in buffer order
    shapes: tuple[tuple[int, ...], ...]  # one per name
    dtypes: tuple[str, ...]  # torch dtype names without "torch.", e.g. "bfloat16"
    num_bytes: int  # length of the flat uint8 buffer, alignment padding included

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
        expected = _layout(self.shapes, self.dtypes)[1]
        if self.num_bytes != expected:
            raise WeightSyncError(
                f"weights header: num_bytes is {self.num_bytes}, but the shapes and dtypes "
                f"need {expected}; sender and receiver disagree on the layout"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (what goes over ``broadcast_object_list``)."""
        return {
            "version": self.version,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "num_bytes": self.num_bytes,
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
                num_bytes=data["num_bytes"],
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
    """Byte offset of each tensor, and the total buffer size (pure)."""
    offsets, end = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        start = _align(end)
        offsets.append(start)
        end = start + _num_bytes(shape, dtype)
    return offsets, end


def pack(
    state: Mapping[str, torch.Tensor],
    *,
    version: int = 0,
    device: torch.device | str | None = None,
) -> tuple[WeightsHeader, torch.Tensor]:
    """Copy ``state`` into one flat ``uint8`` buffer on ``device`` (default: the CPU) and
    describe it with a header carrying ``version``.

    The tensors may live on any device; each is copied once, straight into its slot."""
    if not state:
        raise WeightSyncError("pack: the state dict is empty; there are no weights to send")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"pack: {name!r} is a {type(tensor).__name__}, not a tensor")
        if _dtype_name(tensor.dtype) not in _DTYPES:
            raise WeightSyncError(
                f"pack: tensor {name!r} has dtype {tensor.dtype}; supported: {', '.join(_DTYPES)}"
            )
    names = tuple(state)
    shapes = tuple(tuple(t.shape) for t in state.values())
    dtypes = tuple(_dtype_name(t.dtype) for t in state.values())
    _, num_bytes = _layout(shapes, dtypes)
    header = WeightsHeader(version, names, shapes, dtypes, num_bytes)
    # zeros, not empty: the alignment padding is sent too, and should not leak old memory
    flat = torch.zeros(num_bytes, dtype=torch.uint8, device=device or "cpu")
    for (_, slot), tensor in zip(unpack(header, flat), state.values(), strict=True):
        slot.copy_(tensor.detach())  # handles strides and devices: one copy per tensor
    return header, flat


def unpack(header: WeightsHeader, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Cut ``flat`` back into ``(name, tensor)`` pairs: views, no copy, on ``flat``'s
    device. They alias the buffer: copy them (an engine's weight loader does) before
    reusing the buffer for the next version."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise WeightSyncError(
            f"unpack: expected a 1-d uint8 buffer, got {flat.dtype} of shape {tuple(flat.shape)}"
        )
    if flat.numel() != header.num_bytes:
        raise WeightSyncError(
            f"unpack: the buffer has {flat.numel()} bytes but the header (version "
            f"{header.version}) says {header.num_bytes}; it belongs to another sync"
        )
    offsets, _ = _layout(header.shapes, header.dtypes)
    out = []
    for name, shape, dtype, start in zip(
        header.names, header.shapes, header.dtypes, offsets, strict=True
    ):
        size = _num_bytes(shape, dtype)
        out.append((name, flat[start : start + size].view(_DTYPES[dtype]).view(shape)))
    return out


# --------------------------------------------------------------------------- transfers


class WeightVersions:
    """Which rollout worker holds which weight version; pure bookkeeping (no torch).

    Rules:

    - The latest version starts at 0: every engine starts from the model directory, which
      is the trainer's version 0. ``published`` moves it forward (never back).
    - ``loaded`` records what a worker now holds; it cannot be ahead of the latest, and a
      worker never goes back (a restarted worker is ``forget``-ed first).
    - A worker *may generate* while ``version >= latest - max_staleness``: the trainer
      accepts its trajectories (its own ``max_staleness`` should be the same value).
    - A worker is *stale* while ``version < latest``: it needs a lazy sync before its next
      turn, though it may finish the current one if it still may generate.
    - An unknown worker holds nothing: it may not generate and is not listed as stale (it
      gets the weights when it registers with ``loaded``).
    """

    def __init__(self, max_staleness: int = 1) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise ConfigError(f"max_staleness must be an int, got {max_staleness!r}")
        if max_staleness < 0:
            raise ConfigError(
                f"max_staleness must be >= 0 (0 = fully on-policy), got {max_staleness}"
            )
        self.max_staleness = max_staleness
        self._latest = 0
        self._held: dict[str, int] = {}

    @property
    def latest(self) -> int:
        return self._latest

    def version_of(self, worker_id: str) -> int | None:
        """The version ``worker_id`` holds, or None for an unknown worker."""
        return self._held.get(worker_id)

    def published(self, version: int) -> None:
        """The trainer made ``version`` available (re-publishing the latest is a no-op)."""
        _check_version(version, "published")
        if version < self._latest:
            raise WeightSyncError(
                f"published version {version} is older than the latest ({self._latest}); "
                "versions only move forward"
            )
        self._latest = version

    def loaded(self, worker_id: str, version: int) -> None:
        """``worker_id`` now serves ``version``."""
        _check_version(version, f"loaded by {worker_id!r}")
        if version > self._latest:
            raise WeightSyncError(
                f"{worker_id!r} cannot load version {version}: the latest published is "
                f"{self._latest}; call published({version}) first"
            )
        held = self._held.get(worker_id)
        if held is not None and version < held:
            raise WeightSyncError(
                f"{worker_id!r} holds version {held} and cannot go back to {version}; "
                "forget() a restarted worker before it loads again"
            )
        self._held[worker_id] = version

    def forget(self, worker_id: str) -> None:
        """``worker_id`` left (or restarted); forgetting an unknown worker is a no-op."""
        self._held.pop(worker_id, None)

    def stale(self) -> list[str]:
        """Workers behind the latest version, sorted by id."""
        return sorted(w for w, v in self._held.items() if v < self._latest)

    def may_generate(self, worker_id: str) -> bool:
        held = self._held.get(worker_id)
        return held is not None and held >= self._latest - self.max_staleness


def _check_version(version: int, what: str) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightSyncError(f"{what}: version must be an int >= 0, got {version!r}")


__all__ = [
    "ALIGN_BYTES",
    "WeightSyncError",
    "WeightVersions",
    "WeightsHeader",
    "pack",
    "unpack",
]
