"""Factories that keep tests short: profiles, tables and a recording executor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.table import ElasticSource, RoleTable
from pearl_hpc.core.types import PDConfig, Role, Status, Zone

PROFILE_DEFAULTS: dict[str, Any] = dict(
    batch_size=64,
    turns=40,
    new_tokens_per_turn=600,
    gen_tokens_per_turn=150,
    prefill_s_per_token=12e-6,
    decode_fixed_s=0.008,
    decode_per_seq_s=0.00025,
    overhead_s_per_turn=0.05,
    env_s=120.0,
    decode_bubble_ratio=1.0,
    kv_bytes_per_token=98304,
    transfer_bytes_per_s=50e9,
    kv_bytes_per_trajectory=1.6e9,
    kv_capacity_bytes_per_worker=85e9,
)


def make_profile(**overrides: Any) -> WorkloadProfile:
    return WorkloadProfile(**{**PROFILE_DEFAULTS, **overrides})


def gpus(slot: int, per_worker: int = 2, prefix: str = "n") -> tuple[str, ...]:
    return tuple(f"{prefix}{slot}:{g}" for g in range(per_worker))


def make_table(
    config: PDConfig | None = None,
    *,
    num_training_gpus: int = 0,
    num_overlap_workers: int = 0,
    elastic: ElasticSource | None = None,
    status: Status = Status.ACTIVE,
) -> RoleTable:
    """A table with ``config``'s dedicated workers (2 GPUs each, prefill first), training
    GPUs ``t:0..`` and inactive overlap workers on them (2 GPUs each)."""
    table = RoleTable()
    if num_training_gpus:
        table.add_worker(
            [f"t:{i}" for i in range(num_training_gpus)],
            zone=Zone.OVERLAP,
            role=Role.TRAINING,
            status=Status.INACTIVE,
        )
    for i in range(num_overlap_workers):
        table.add_worker(
            [f"t:{2 * i}", f"t:{2 * i + 1}"],
            zone=Zone.OVERLAP,
            role=Role.COLOCATED,
            status=Status.INACTIVE,
        )
    if config is not None:
        roles = config.roles()
        for i, role in enumerate(roles):
            table.add_worker(gpus(i), zone=Zone.DEDICATED, role=role, status=status, source=elastic)
    return table


@dataclass
class RecordingExecutor:
    """A hand-written fake executor: records every call, in order."""

    calls: list[tuple[str, Any]] = field(default_factory=list)

    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        self.calls.append(("start_workers", [a.slot_id for a in adds]))

    def admit(self, slot_ids: Sequence[int]) -> None:
        self.calls.append(("admit", list(slot_ids)))

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        self.calls.append(("change_roles", [(s, r.value) for s, r in changes]))

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        self.calls.append(("stop_workers", list(slot_ids)))

    def start_training(self, step: int) -> None:
        self.calls.append(("start_training", step))

    def release_capacity(self, source: ElasticSource) -> None:
        self.calls.append(("release_capacity", source.tag))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def take(self) -> list[tuple[str, Any]]:
        out, self.calls = self.calls, []
        return out


class ManualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, delta_s: float) -> None:
        self.now_s += delta_s


def uneven_batch() -> list[Any]:
    """8 finished trajectories in 2 GRPO groups from raw token ids, of very different
    lengths (3 to 24 generated tokens): split over data-parallel ranks, the ranks hold
    different numbers of policy tokens. Every other one has behaviour log-probs (near the
    untrained tiny model's -log(vocabulary), some far enough for the cap to act)."""
    import math

    from pearl_hpc.rollout.types import Segment, Trajectory

    out = []
    for i in range(8):
        group = i // 4
        prompt = tuple(range(40 + 5 * group, 46 + 5 * group))
        generated = tuple(200 + 13 * i + k for k in range(3 + 3 * i))
        mu = tuple(-11.9 + 1.2 * math.sin(3 * i + k) for k in range(len(generated)))
        tail = tuple(range(90, 90 + i % 3))  # an environment observation (no loss)
        policy = Segment(generated, True, mu if i % 2 == 0 else (), weight_version=0)
        segments = [Segment(prompt, False), policy, Segment(tail, False)]
        reward = float((i * 7) % 5) / 4
        out.append(Trajectory(f"u{i}", f"g{group}", segments, reward, True, {0}))
    return out


def run_reporting(
    procs: Sequence[Any], out: Any, want: set[Any], timeout_s: float
) -> dict[Any, Any]:
    """Start ``procs`` (multiprocessing processes that each put ``(key, report)`` on
    ``out``), collect one report per key of ``want`` within ``timeout_s``, join them (a
    process left alive is killed). A report that is a string is a member's traceback:
    the test fails with every one of them."""
    import queue
    import time

    import pytest

    results: dict[Any, Any] = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < len(want):
            try:
                key, report = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{sorted(map(str, want - set(results)))} did not report in time")
            results[key] = report
        for proc in procs:
            proc.join(timeout=15)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    failed = {k: r for k, r in results.items() if isinstance(r, str)}
    assert not failed, "\n".join(f"--- {k}\n{r}" for k, r in failed.items())
    return results
