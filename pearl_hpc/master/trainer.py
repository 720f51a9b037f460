"""The trainer ranks as one trainer, for the master: TRAIN, PUBLISH, RELEASE, CATCH_UP
over :class:`~pearl_hpc.comm.members.Members`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pearl_hpc.comm.members import Members
from pearl_hpc.comm.messages import OFF_POLICY_FIGURES, Op
from pearl_hpc.comm.mpi import PlaneError
from pearl_hpc.rollout.types import Trajectory


@dataclass(frozen=True)
class TrainResult:
    """What the trainer ranks report of a step (trainer 0's numbers)."""

    version: int
    mean_reward: float
    max_staleness: int
    loss: float
    wall_s: float
    # the step's off-policy figures (train/objective.py)
    clip_frac: float = 0.0
    mismatch_mean: float = 0.0
    mismatch_max: float = 0.0
    capped_frac: float = 0.0
    behaviour_coverage: float = 0.0
    handover_s: float = 0.0  # the slowest rank's onload of its lent GPU in this step


class RemoteTrainer:
    """The trainer ranks as one trainer: every rank trains each step (data parallel);
    trainer 0 also carries the weights to the engines."""

    def __init__(self, members: Members) -> None:
        self.members = members
        self.ranks = members.of_kind("trainer")
        if not self.ranks:
            raise PlaneError("the run's world has no trainer rank")
        versions = {int(members.hellos[r]["version"]) for r in self.ranks}
        if len(versions) != 1:
            raise PlaneError(f"trainer ranks resumed different versions: {sorted(versions)}")
        self.version = versions.pop()
        self.lead = self.ranks[0]

    async def train(self, step: int, trajectories: list[Trajectory]) -> TrainResult:
        batch = [t.to_dict() for t in trajectories]
        acks = await asyncio.gather(
            *[self.members.call(r, Op.TRAIN, step=step, trajectories=batch) for r in self.ranks]
        )
        handover_s = 0.0
        for rank, ack in zip(self.ranks, acks, strict=True):  # GPU hand-overs, measured
            moved = {k: v for k, v in ack.items() if k.startswith(("offload_", "onload_"))}
            if moved:
                self.members.events("handover", rank=rank, step=step, **moved)
                handover_s = max(handover_s, float(moved.get("onload_s", 0.0)))
        lead = acks[0]
        if any(a["version"] != lead["version"] for a in acks):
            raise PlaneError(f"trainer ranks disagree on the version after step {step}: {acks}")
        self.version = int(lead["version"])
        return TrainResult(
            version=self.version,
            mean_reward=float(lead["mean_reward"]),
            max_staleness=int(lead["max_staleness"]),
            loss=float(lead["loss"]),
            wall_s=float(lead["wall_s"]),
            handover_s=handover_s,
            **{k: float(lead.get(k, 0.0)) for k in OFF_POLICY_FIGURES},
        )

    async def publish(
        self, version: int, serving: Mapping[str, tuple[str, int]]
    ) -> tuple[float, list[str]]:
        """The weights of ``version`` to every serving engine; returns the broadcast's
        seconds (on trainer 0) and the engines trainer 0 could not reach (dead)."""
        members = {name: [host, port] for name, (host, port) in serving.items()}
        ack = await self.members.call(self.lead, Op.PUBLISH, version=version, members=members)
        self.members.events(
            "publish",
            version=version,
            members=len(members),
            mapped=int(ack.get("mapped", 0)),  # of them, on trainer 0's node: shared memory
            s=round(float(ack["seconds"]), 4),
            form_s=round(float(ack["form_s"]), 4),
            unreachable=ack.get("unreachable", []),
        )
        return float(ack["seconds"]), list(ack.get("unreachable", []))

    async def lend(self, gpu_ids: Sequence[str]) -> None:
        """The trainer ranks on ``gpu_ids`` move their tensors to host memory, so an
        overlap engine can wake there (measured, journalled; nothing moves on cpu). They
        come back with the next step."""
        ranks = [
            r for r in self.ranks if set(self.members.hellos[r].get("gpu_ids", ())) & set(gpu_ids)
        ]
        acks = await asyncio.gather(*[self.members.call(r, Op.RELEASE) for r in ranks])
        for rank, ack in zip(ranks, acks, strict=True):
            if ack.get("offload_s") is not None:
                moved = {k: v for k, v in ack.items() if k.startswith("offload_")}
                self.members.events("handover", rank=rank, gpus=list(gpu_ids), **moved)

    async def catch_up(self, name: str, address: tuple[str, int]) -> float:
        """The latest weights to one engine (point to point)."""
        host, port = address
        ack = await self.members.call(self.lead, Op.CATCH_UP, name=name, host=host, port=port)
        return float(ack["seconds"])
