"""Which trajectories a trainer rank forwards, and how they are packed.

A minibatch's rows are split over the data-parallel ranks by tokens (longest first, each
to the rank holding the fewest), and each rank's share is packed into micro-batches of at
most ``budget`` tokens (longest first, each into the first that has room; a trajectory
longer than the budget is a micro-batch of its own). A micro-batch is one row of
concatenated trajectories whose position ids restart at each trajectory: the model's
attention stays within each trajectory (block-diagonal causal), so nothing is padded.

Every rank holds the step's whole batch, so every rank computes every rank's split and
packing the same way: an FSDP rank knows, without a collective, how many forwards the
others run and pads its own with empty ones (each forward is a collective).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def split_rows(lengths: Sequence[int], rows: Sequence[int], world: int) -> list[list[int]]:
    """``rows`` over ``world`` ranks, balanced by ``lengths[row]`` (longest first, each to
    the rank with the fewest tokens so far; ties to the lower rank). Each share is sorted."""
    heap = [(0, rank) for rank in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        tokens, rank = heapq.heappop(heap)
        shares[rank].append(row)
        heapq.heappush(heap, (tokens + lengths[row], rank))
    return [sorted(share) for share in shares]


def micro_batches(lengths: Sequence[int], rows: Sequence[int], budget: int) -> list[list[int]]:
    """``rows`` packed into micro-batches of at most ``budget`` tokens (first fit,
    longest first; a row longer than the budget alone)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        for i, left in enumerate(room):
            if lengths[row] <= left:
                bins[i].append(row)
                room[i] -= lengths[row]
                break
        else:
            bins.append([row])
            room.append(budget - lengths[row])
    return bins


@dataclass(frozen=True)
class Packed:
    """One micro-batch as the model takes it."""

    rows: list[int]  # the batch rows, in packing order
    input_ids: torch.Tensor  # [1, N]: the rows' tokens one after another
    position_ids: torch.Tensor  # [1, N]: 0.. within each row
    targets: torch.Tensor  # [N]: the next token of the same row (0 at a row's last token)
    index: torch.Tensor  # [k, L - 1]: where row i's prediction of token t + 1 sits in [N]
    valid: torch.Tensor  # [k, L - 1]: False past row i's last prediction
    width: int  # L - 1: the longest row's predictions

    def per_row(self, flat: torch.Tensor) -> torch.Tensor:
        """``[N]`` values of the packed positions as ``[k, L - 1]`` rows (0 past a row's
        end)."""
        index, valid = self.index.to(flat.device), self.valid.to(flat.device)
        return torch.where(valid, flat[index], flat.new_zeros(()))


def pack(token_ids: torch.Tensor, lengths: Sequence[int], rows: Sequence[int]) -> Packed:
    """``rows`` of the right-padded ``token_ids`` ``[B, T]`` as one packed micro-batch."""
    width = max(lengths[r] for r in rows) - 1
    ids, positions, targets, index, valid = [], [], [], [], []
    offset = 0
    for r in rows:
        n = lengths[r]
        row = token_ids[r, :n]
        ids.append(row)
        positions.append(torch.arange(n))
        targets.append(torch.cat([row[1:], row.new_zeros(1)]))
        # prediction t of the row sits at offset + t; past the row's end, its last one
        index.append(offset + torch.arange(width).clamp(max=n - 2))
        valid.append(torch.arange(width) < n - 1)
        offset += n
    return Packed(
        rows=list(rows),
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(positions)[None],
        targets=torch.cat(targets),
        index=torch.stack(index),
        valid=torch.stack(valid),
        width=width,
    )
