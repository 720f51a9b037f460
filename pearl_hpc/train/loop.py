"""GRPO over real engines: rollout a batch, train on it, push the weights to the workers.

    for step in range(steps):
        trajectories = rollout_batch(router, env, ...)     # engines, version v (or v-1)
        stats = trainer.train_step(trajectories)            # version v+1 (in a thread)
        await sync.publish(sync.stage(trainer.state_dict(), v+1))   # to serving workers

:class:`WeightSync` is the trainer side of the weight propagation. Engines on trainer 0's
node (they read its probe in shared memory) map each version from the file it was staged
in (:mod:`pearl_hpc.train.shm`); the others are ranks of a torch.distributed weight group
(gloo on CPU, NCCL on GPU) whose rank 0 is the trainer, and take each version in one
broadcast. A worker outside the broadcast group (released, or joined late) is not waited
for and catches up when it activates (lazy propagation): from shared memory, or with a
point-to-point copy. :class:`~pearl_hpc.train.weights.WeightVersions` keeps who holds what.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import cast

import torch

from pearl_hpc.engine.client import EngineClient
from pearl_hpc.rollout.agent import ChatFormat, Env, RolloutConfig, rollout_batch
from pearl_hpc.rollout.router import Router
from pearl_hpc.train.grpo import GRPOTrainer, TrainStats
from pearl_hpc.train.shm import SharedStore, Staged, stage_private
from pearl_hpc.train.weights import BUCKET_BYTES, WeightSyncError, WeightVersions
from pearl_hpc.train.wgroup import WeightGroup, WeightStore, send_weights


class WeightSync:
    """Trainer-side weight propagation to engine workers.

    :meth:`stage` makes the engines' copy of a version (in ``shared`` memory when the
    trainer has a :class:`SharedStore`); :meth:`form` sorts a new membership epoch's
    serving workers into those on this node (they map each version) and the rest, over
    whom it builds the broadcast group (trainer = rank 0). A worker outside the epoch
    (released, or joined late) is not waited for: :meth:`catch_up` gives it the latest
    version (mapped, or point to point in a two-member group), and the next :meth:`form`
    includes it.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        max_staleness: int = 1,
        bucket_bytes: int = BUCKET_BYTES,
        shared: SharedStore | None = None,
    ) -> None:
        self.store = WeightStore(host)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.shared = shared
        self.versions = WeightVersions(max_staleness=max_staleness)
        self.members: dict[str, EngineClient] = {}
        self.nearby: set[str] = set()  # members that map versions from shared memory
        self.latest: Staged | None = None
        self.timings: list[tuple[str, int, float]] = []  # (how, version, seconds)
        self._group: WeightGroup | None = None
        self._epoch = 0
        self._p2p = 0
        # client -> whether its engine sees this store's shared memory (asked once)
        self._shares: weakref.WeakKeyDictionary[EngineClient, bool] = weakref.WeakKeyDictionary()

    def stage(
        self, state: Mapping[str, torch.Tensor], version: int, dtype: torch.dtype | None = None
    ) -> Staged:
        """The engines' copy of ``version`` (floating tensors in ``dtype``, default as
        given): in shared memory when there is a store, else in this process's."""
        if self.shared is None:
            return stage_private(state, version, dtype)
        return self.shared.stage(state, version, dtype)

    async def _group_of(
        self, name: str, prefix: str, members: Mapping[str, EngineClient], backend: str
    ) -> WeightGroup:
        size = 1 + len(members)
        host, port = self.store.host, self.store.port
        trainer_side = asyncio.to_thread(
            WeightGroup, host, port, prefix, 0, size, backend, store=self.store.store
        )
        joined = await asyncio.gather(
            trainer_side,
            *[
                client.join_weights_group(name, host, port, prefix, rank, size, backend)
                for rank, client in enumerate(members.values(), start=1)
            ],
        )
        return cast(WeightGroup, joined[0])

    async def _sees_shared(self, client: EngineClient) -> bool:
        """Whether ``client``'s engine reads the store's probe (asked once per client)."""
        if self.shared is None:
            return False
        if client not in self._shares:
            self._shares[client] = await client.shares_memory(*self.shared.probe)
        return self._shares[client]

    async def form(self, members: Mapping[str, EngineClient]) -> None:
        """A new epoch over ``members`` (the serving workers): those on this node map each
        version; a broadcast group over the others (none if every one is here)."""
        self._epoch += 1
        self.members = dict(members)
        sees = await asyncio.gather(*[self._sees_shared(c) for c in self.members.values()])
        self.nearby = {name for name, near in zip(self.members, sees, strict=True) if near}
        remote = {n: c for n, c in self.members.items() if n not in self.nearby}
        if self._group is not None:
            self._group.close()
            self._group = None
        if remote:
            prefix = f"bcast/{self._epoch}/"
            self._group = await self._group_of("broadcast", prefix, remote, self.backend)

    def seed(self, staged: Staged) -> None:
        """Start from ``staged`` (a resumed trainer): workers catch up to it as they join."""
        self.latest = staged
        self.versions.published(staged.version)

    async def publish(self, staged: Staged) -> float:
        """``staged`` to every serving member (one broadcast to the remote ones, a mapping
        for the nearby ones); returns the wall time."""
        if not self._epoch:
            raise WeightSyncError("WeightSync.publish before form(): no members")
        t0 = time.perf_counter()
        self.latest = staged
        self.versions.published(staged.version)
        sends: list[Awaitable[object]] = [
            self._deliver_nearby(n, c, staged) for n, c in self.members.items() if n in self.nearby
        ]
        if self._group is not None:
            sends.append(asyncio.to_thread(self._send, self._group, staged, None))
            sends += [
                c.receive_weights("broadcast")
                for n, c in self.members.items()
                if n not in self.nearby
            ]
        await asyncio.gather(*sends)
        for wid in self.members:
            self.versions.loaded(wid, staged.version)
        if self.shared is not None:  # every member holds it: older files can go
            self.shared.unlink_before(staged.version)
        wall_s = time.perf_counter() - t0
        self.timings.append(("broadcast", staged.version, wall_s))
        return wall_s

    def _send(self, group: WeightGroup, staged: Staged, dst: int | None) -> None:
        send_weights(group, staged.state, staged.version, dst=dst, bucket_bytes=self.bucket_bytes)

    async def _deliver_nearby(self, worker_id: str, client: EngineClient, staged: Staged) -> None:
        """A nearby worker maps the version's file (one staged privately, without room in
        shared memory, goes point to point)."""
        if staged.path is not None and staged.header is not None:
            await client.map_weights(staged.path, staged.header)
        else:  # host-staged: NCCL would refuse an engine on the trainer's own GPU
            await self._point_to_point(worker_id, client, staged, "gloo")

    async def _point_to_point(
        self, worker_id: str, client: EngineClient, staged: Staged, backend: str
    ) -> None:
        self._p2p += 1
        name = f"p2p-{self._p2p}"
        group = await self._group_of(name, f"p2p/{self._p2p}/", {worker_id: client}, backend)
        try:
            await asyncio.gather(
                asyncio.to_thread(self._send, group, staged, 1),
                client.receive_weights(name, p2p=True),
            )
            await client.leave_weights_group(name)
        finally:
            group.close()

    async def catch_up(self, worker_id: str, client: EngineClient) -> float:
        """The latest version to a worker that missed broadcasts: mapped from shared
        memory if it is on this node, else point to point."""
        if self.latest is None:
            return 0.0
        staged = self.latest
        t0 = time.perf_counter()
        if await self._sees_shared(client):
            await self._deliver_nearby(worker_id, client, staged)
        else:
            await self._point_to_point(worker_id, client, staged, self.backend)
        self.versions.loaded(worker_id, staged.version)
        wall_s = time.perf_counter() - t0
        self.timings.append(("p2p", staged.version, wall_s))
        return wall_s

    def close(self) -> None:
        """Tear down the broadcast group and remove the shared files (engines that
        mapped one keep it until they drop it)."""
        if self._group is not None:
            self._group.close()
            self._group = None
        if self.shared is not None:
            self.shared.close()


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
    sync: WeightSync,
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
        sync_s = await sync.publish(sync.stage(trainer.state_dict(), stats.version))
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
