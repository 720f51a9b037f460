"""The trainer ranks as one trainer, for the master: TRAIN, PUBLISH, RELEASE, CATCH_UP
over :class:`~pearl_hpc.comm.members.Members`.

The trainer ranks are one failure domain (:mod:`pearl_hpc.backends.domains`): when one
of them fails, the master fails them all (:meth:`RemoteTrainer.lost`), their launcher
starts them again from the newest checkpoint the journal covers, and they join as a new
group (:meth:`RemoteTrainer.adopt`). A call that meets the loss raises
:class:`TrainerLost`: the step pipeline trains the recorded steps the new ranks lack from
their logs and sends the step again (:meth:`~pearl_hpc.master.steps.StepPipeline.train`);
RELEASE and CATCH_UP wait for the new ranks and go to them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

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

T = TypeVar("T")


class TrainerLost(PlaneError):
    """A trainer rank failed: the ranks are started again (from a checkpoint)."""


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
        self.ready = asyncio.Event()  # the ranks are in (cleared while they are lost)
        self.epoch = 0  # one more at each loss and each adoption
        self.adopt(members.of_kind("trainer"))

    def adopt(self, ranks: list[str]) -> None:
        """``ranks`` (member ids, trainer 0 first) are the trainer ranks from now: their
        hellos' version (the checkpoint they loaded) is the trainer's."""
        if not ranks:
            raise PlaneError("the run has no trainer rank")
        versions = {self.members.hellos[r].version for r in ranks}
        if len(versions) != 1:
            raise PlaneError(f"trainer ranks resumed different versions: {sorted(versions)}")
        self.ranks = ranks
        self.version = versions.pop()
        self.lead = ranks[0]
        self.lent: set[str] = set()  # ranks whose GPU an overlap engine holds (to the next step)
        self.save_next = False  # a checkpoint asked for while a GPU was lent: after the next step
        self.epoch += 1
        self.ready.set()

    def lost(self) -> None:
        """A trainer rank failed: calls raise :class:`TrainerLost` until :meth:`adopt`."""
        self.epoch += 1
        self.ready.clear()

    async def _gather(self, calls: list[Awaitable[T]]) -> list[T]:
        """The calls' answers; :class:`TrainerLost` where the ranks were lost meanwhile
        (every call is settled first: none is left behind)."""
        if not self.ready.is_set():
            for call in calls:  # (coroutines never awaited)
                getattr(call, "close", lambda: None)()
            raise TrainerLost("the trainer ranks are lost (being started again)")
        epoch = self.epoch
        answers = await asyncio.gather(*calls, return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors and self.epoch != epoch:  # the ranks called were lost meanwhile
            raise TrainerLost(str(errors[0])) from errors[0]
        if errors:
            raise errors[0]
        return answers  # type: ignore[return-value]

    async def _on_new_ranks(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, made again on the new ranks where it met their loss."""
        while True:
            await self.ready.wait()
            try:
                return await call()
            except TrainerLost:
                continue

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
        acks = await self._gather([self.members.call(r, batch, TrainAck) for r in self.ranks])
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
        acks = await self._gather([self.members.call(r, Save(), SaveAck) for r in self.ranks])
        seconds = max(a.seconds for a in acks)
        self.members.events("checkpoint_saved", version=acks[0].version, s=round(seconds, 3))
        return seconds

    async def publish(
        self, version: int, serving: Mapping[str, tuple[str, int]]
    ) -> tuple[float, list[str]]:
        """The weights of ``version`` to every serving engine; returns the broadcast's
        seconds (on trainer 0) and the engines trainer 0 could not reach (dead)."""
        publish = Publish(version, dict(serving))
        (ack,) = await self._gather([self.members.call(self.lead, publish, PublishAck)])
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
        come back with the next step (ranks lost meanwhile: the new ones do)."""
        await self._on_new_ranks(lambda: self._lend(gpu_ids))

    async def _lend(self, gpu_ids: Sequence[str]) -> None:
        ranks = [r for r in self.ranks if set(self.members.hellos[r].gpu_ids) & set(gpu_ids)]
        self.lent.update(ranks)  # from now: a save queued behind the lend would find no state
        acks = await self._gather([self.members.call(r, Release(), ReleaseAck) for r in ranks])
        for rank, ack in zip(ranks, acks, strict=True):
            if ack.offload is None:  # nothing moved (cpu): its state is still there
                self.lent.discard(rank)
            else:
                fields = ack.offload.fields()
                self.members.events("handover", rank=rank, gpus=list(gpu_ids), **fields)

    async def catch_up(self, name: str, address: tuple[str, int]) -> float:
        """The latest weights to one engine (point to point; ranks lost meanwhile: from
        the new trainer 0, once they joined)."""
        host, port = address

        async def call() -> float:
            body = CatchUp(name, host, port)
            (ack,) = await self._gather([self.members.call(self.lead, body, CatchUpAck)])
            return ack.seconds

        return await self._on_new_ranks(call)
