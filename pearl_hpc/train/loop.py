"""GRPO over real engines: rollout a batch, train on it, push the weights to the workers.

    for step in range(steps):
        trajectories = rollout_batch(router, env, ...)     # engines, version v (or v-1)
        stats = trainer.train_step(trajectories)            # version v+1 (in a thread)
        await sync.publish(trainer.state_dict(), v+1)       # broadcast to serving workers

:class:`WeightSync` is the trainer side of the weight broadcast group: the trainer is rank
0 of a torch.distributed world (gloo on CPU, NCCL on GPU) whose other ranks are engine
workers. Serving workers take each new version in one broadcast; a worker outside the
broadcast group (released, or joined late) is not waited for and catches up with a
point-to-point copy of the latest version when it activates (lazy propagation).
:class:`~pearl_hpc.train.weights.WeightVersions` keeps who holds what.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import cast

import torch

from pearl_hpc.engine.client import EngineClient
from pearl_hpc.rollout.agent import ChatFormat, Env, RolloutConfig, rollout_batch
from pearl_hpc.rollout.router import Router
from pearl_hpc.train.grpo import GRPOTrainer, TrainStats
from pearl_hpc.train.weights import BUCKET_BYTES, WeightSyncError, WeightVersions
from pearl_hpc.train.wgroup import WeightGroup, WeightStore, send_weights


class WeightSync:
    """Trainer-side weight propagation to engine workers.

    The trainer owns a :class:`WeightStore`; :meth:`form` builds the broadcast group of
    the serving workers for a new membership epoch (trainer = rank 0). A worker outside it
    (released, or joined late) is not waited for: :meth:`catch_up` sends it the latest
    version point to point in a two-member group, and the next :meth:`form` includes it.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        max_staleness: int = 1,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.store = WeightStore(host)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.versions = WeightVersions(max_staleness=max_staleness)
        self.members: dict[str, EngineClient] = {}
        self.latest: tuple[dict[str, torch.Tensor], int] | None = None
        self.timings: list[tuple[str, int, float]] = []  # (how, version, seconds)
        self._group: WeightGroup | None = None
        self._epoch = 0
        self._p2p = 0

    async def _group_of(
        self, name: str, prefix: str, members: Mapping[str, EngineClient]
    ) -> WeightGroup:
        size = 1 + len(members)
        host, port = self.store.host, self.store.port
        trainer_side = asyncio.to_thread(
            WeightGroup, host, port, prefix, 0, size, self.backend, store=self.store.store
        )
        joined = await asyncio.gather(
            trainer_side,
            *[
                client.join_weights_group(name, host, port, prefix, rank, size, self.backend)
                for rank, client in enumerate(members.values(), start=1)
            ],
        )
        return cast(WeightGroup, joined[0])

    async def form(self, members: Mapping[str, EngineClient]) -> None:
        """New broadcast group over ``members`` (the serving workers)."""
        self._epoch += 1
        self.members = dict(members)
        if self._group is not None:
            self._group.close()
        self._group = await self._group_of("broadcast", f"bcast/{self._epoch}/", self.members)

    def seed(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Start from ``version`` (a resumed trainer): workers catch up to it as they join."""
        self.latest = (state, version)
        self.versions.published(version)

    async def publish(self, state: dict[str, torch.Tensor], version: int) -> float:
        """Broadcast ``version`` to every serving member; returns the wall time."""
        if self._group is None:
            raise WeightSyncError("WeightSync.publish before form(): no broadcast group")
        t0 = time.perf_counter()
        self.latest = (state, version)
        self.versions.published(version)
        await asyncio.gather(
            asyncio.to_thread(self._send, self._group, state, version, None),
            *[client.receive_weights("broadcast") for client in self.members.values()],
        )
        for wid in self.members:
            self.versions.loaded(wid, version)
        wall_s = time.perf_counter() - t0
        self.timings.append(("broadcast", version, wall_s))
        return wall_s

    def _send(
        self, group: WeightGroup, state: dict[str, torch.Tensor], version: int, dst: int | None
    ) -> None:
        send_weights(group, state, version, dst=dst, bucket_bytes=self.bucket_bytes)

    async def catch_up(self, worker_id: str, client: EngineClient) -> float:
        """Point-to-point copy of the latest version to a worker that missed broadcasts."""
        if self.latest is None:
            return 0.0
        state, version = self.latest
        t0 = time.perf_counter()
        self._p2p += 1
        name = f"p2p-{self._p2p}"
        group = await self._group_of(name, f"p2p/{self._p2p}/", {worker_id: client})
        await asyncio.gather(
            asyncio.to_thread(self._send, group, state, version, 1),
            client.receive_weights(name, p2p=True),
        )
        await client.leave_weights_group(name)
        group.close()
        self.versions.loaded(worker_id, version)
        wall_s = time.perf_counter() - t0
        self.timings.append(("p2p", version, wall_s))
        return wall_s


@dataclass(frozen=True)
class StepRecord:
    """One GRPO step as the curve and the benchmarks report it."""

    step: int
    mean_reward: float
    rollout_s: float
    train_s: float
    sync_s: float
    generated_tokens: int
    version: int  # trainer version after the step
    loss: float


async def grpo_steps(
    router: Router,
    chat: ChatFormat,
    make_env: Callable[[], Env],
    trainer: GRPOTrainer,
    rollout: RolloutConfig,
    *,
    steps: int,
    publish: Callable[[dict[str, torch.Tensor], int], Awaitable[float]],
    on_step: Callable[[StepRecord], None] | None = None,
) -> list[StepRecord]:
    """``steps`` synchronous GRPO steps; the curve is returned (and reported per step)."""
    records = []
    for step in range(steps):
        t0 = time.perf_counter()
        trajectories = await rollout_batch(router, make_env, chat, rollout, step=step)
        t1 = time.perf_counter()
        stats: TrainStats = await asyncio.to_thread(trainer.train_step, trajectories)
        t2 = time.perf_counter()
        sync_s = await publish(trainer.state_dict(), stats.version)
        record = StepRecord(
            step=step,
            mean_reward=stats.mean_reward,
            rollout_s=t1 - t0,
            train_s=t2 - t1,
            sync_s=sync_s,
            generated_tokens=sum(t.num_generated() for t in trajectories),
            version=stats.version,
            loss=stats.loss,
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records
