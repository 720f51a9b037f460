"""The trainer ranks as one trainer, for the master: TRAIN, PUBLISH, RELEASE, CATCH_UP
over :class:`~pearl_hpc.comm.members.Members`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from pearl_hpc.comm.members import Members
from pearl_hpc.comm.messages import (
    CatchUp,
    CatchUpAck,
    Publish,
    PublishAck,
    Release,
    ReleaseAck,
    Save,
    SaveAck,
    Train,
    TrainAck,
)
from pearl_hpc.comm.mpi import PlaneError
from pearl_hpc.rollout.types import Trajectory


@dataclass(frozen=True)
class TrainResult:
    """What the trainer ranks report of a step."""

    lead: TrainAck  # trainer 0's ack (every rank's version agrees)
    handover_s: float = 0.0  # the slowest rank's onload of its lent GPU in this step

    @property
    def version(self) -> int:
        return self.lead.version


class RemoteTrainer:
    """The trainer ranks as one trainer: every rank trains each step (data parallel);
    trainer 0 also carries the weights to the engines."""

    def __init__(self, members: Members) -> None:
        self.members = members
        self.ranks = members.of_kind("trainer")
        if not self.ranks:
            raise PlaneError("the run's world has no trainer rank")
        versions = {members.hellos[r].version for r in self.ranks}
        if len(versions) != 1:
            raise PlaneError(f"trainer ranks resumed different versions: {sorted(versions)}")
        self.version = versions.pop()
        self.lead = self.ranks[0]
        self.lent: set[str] = set()  # ranks whose GPU an overlap engine holds (to the next step)
        self.save_next = False  # a checkpoint asked for while a GPU was lent: after the next step

    async def train(
        self,
        step: int,
        trajectories: list[Trajectory],
        *,
        checkpoint: bool = False,
        export: bool = False,
    ) -> TrainResult:
        """One step on every rank; with ``checkpoint`` the ranks then save the new
        version (staged before the ack, written while the run goes on), with ``export``
        trainer 0 writes it as a Hugging Face directory (``exports/``)."""
        checkpoint, self.save_next = checkpoint or self.save_next, False
        encoded = msgspec.msgpack.encode(trajectories)
        batch = Train(step, encoded, checkpoint, export)  # encoded once, for every rank
        acks = await asyncio.gather(*[self.members.call(r, batch, TrainAck) for r in self.ranks])
        if checkpoint:  # the slowest rank's wait: the save's share of the step
            blocked = max(a.checkpoint_s for a in acks)
            self.members.events("checkpoint", version=acks[0].version, blocked_s=round(blocked, 4))
        if export:
            self.members.events("exported", version=acks[0].version)
        for version in acks[0].saved:  # trainer 0 completes each save
            self.members.events("checkpoint_saved", version=version)
        handover_s = 0.0
        for rank, ack in zip(self.ranks, acks, strict=True):  # GPU hand-overs, measured
            if ack.onload is not None:
                self.members.events("handover", rank=rank, step=step, **ack.onload.fields())
                handover_s = max(handover_s, ack.onload.wall_s)
        self.lent.clear()  # each rank took its GPU back for the step
        lead = acks[0]
        if any(a.version != lead.version for a in acks):
            versions = [a.version for a in acks]
            raise PlaneError(f"trainer ranks disagree on the version after step {step}: {versions}")
        self.version = lead.version
        return TrainResult(lead, handover_s)

    async def save(self) -> float | None:
        """A checkpoint of the current version on every rank, complete when this returns
        (before the job's end: Slurm's warning signal); returns its seconds. While a rank's
        GPU is lent to an overlap engine its state is not there to save (every rank saves
        or none does): the checkpoint is taken after the next step instead (None)."""
        if self.lent:
            self.save_next = True
            self.members.events("checkpoint_deferred", lent=sorted(self.lent))
            return None
        acks = await asyncio.gather(*[self.members.call(r, Save(), SaveAck) for r in self.ranks])
        seconds = max(a.seconds for a in acks)
        self.members.events("checkpoint_saved", version=acks[0].version, s=round(seconds, 3))
        return seconds

    async def publish(
        self, version: int, serving: Mapping[str, tuple[str, int]]
    ) -> tuple[float, list[str]]:
        """The weights of ``version`` to every serving engine; returns the broadcast's
        seconds (on trainer 0) and the engines trainer 0 could not reach (dead)."""
        ack = await self.members.call(self.lead, Publish(version, dict(serving)), PublishAck)
        self.members.events(
            "publish",
            version=version,
            members=len(serving),
            mapped=ack.mapped,  # of them, on trainer 0's node: shared memory
            s=round(ack.seconds, 4),
            form_s=round(ack.form_s, 4),
            unreachable=ack.unreachable,
        )
        return ack.seconds, list(ack.unreachable)

    async def lend(self, gpu_ids: Sequence[str]) -> None:
        """The trainer ranks on ``gpu_ids`` move their tensors to host memory, so an
        overlap engine can wake there (measured, journalled; nothing moves on cpu). They
        come back with the next step."""
        ranks = [r for r in self.ranks if set(self.members.hellos[r].gpu_ids) & set(gpu_ids)]
        self.lent.update(ranks)  # from now: a save queued behind the lend would find no state
        acks = await asyncio.gather(*[self.members.call(r, Release(), ReleaseAck) for r in ranks])
        for rank, ack in zip(ranks, acks, strict=True):
            if ack.offload is None:  # nothing moved (cpu): its state is still there
                self.lent.discard(rank)
            else:
                fields = ack.offload.fields()
                self.members.events("handover", rank=rank, gpus=list(gpu_ids), **fields)

    async def catch_up(self, name: str, address: tuple[str, int]) -> float:
        """The latest weights to one engine (point to point)."""
        host, port = address
        ack = await self.members.call(self.lead, CatchUp(name, host, port), CatchUpAck)
        return ack.seconds
