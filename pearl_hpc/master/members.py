"""The master's side of the run's MPI world, for its asyncio loop.

    MasterPlane (comm/mpi.py)      hellos, commands, reports, Comm.Split, shutdown
        └── Members                 a poll task resolves each command's ack by its seq
              └── RemoteTrainer     the trainer ranks: TRAIN, PUBLISH, CATCH_UP

The master never waits inside MPI for a member's work: commands are sent, acks arrive
through :meth:`Members.poll` (every few ms, beside heartbeats). Only ``Comm.Split``
blocks the loop, for as long as the members take to enter it (their control threads
answer within milliseconds, whatever their engine or trainer is doing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pearl_hpc.comm.messages import Kind, Op, Report
from pearl_hpc.comm.mpi import MasterPlane, PlaneError
from pearl_hpc.master.records import EventLog
from pearl_hpc.rollout.types import Trajectory

POLL_S = 0.005


class Members:
    """Commands to members as awaitables; ``Comm.Split`` after each plan."""

    def __init__(self, plane: MasterPlane, events: EventLog) -> None:
        self.plane = plane
        self.events = events
        self.hellos: dict[str, dict[str, Any]] = {}  # member id -> what its hello said
        self.rank_of: dict[str, int] = {}  # member id -> its rank in the base world
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._expected: dict[int, dict[str, int]] = {}  # epoch -> member -> group size

    def start(self, since_s: float) -> None:
        """Every base rank said hello (blocking: before the loop serves anything);
        ``since_s``: when this rank started (``time.monotonic``), for the world's start
        latency."""
        for member in self.plane.start_base():
            self.hellos[member.member_id] = member.info
            self.rank_of[member.member_id] = member.link_rank
        self.events(
            "world",
            ranks=1 + len(self.hellos),
            trainers=len(self.of_kind("trainer")),
            engines=len(self.of_kind("engine")),
            nodes={str(self.rank_of[m]): str(h.get("node", "")) for m, h in self.hellos.items()},
            start_s=round(time.monotonic() - since_s, 3),
        )

    def of_kind(self, kind: str) -> list[str]:
        return sorted(
            (m for m, h in self.hellos.items() if h.get("process") == kind),
            key=lambda m: self.rank_of[m],
        )

    async def poll_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.poll()
            await asyncio.sleep(POLL_S)

    def poll(self) -> None:
        for report in self.plane.poll():
            self._on_report(report)

    def _on_report(self, report: Report) -> None:
        if report.kind is Kind.ACK and report.args.get("op") == Op.PARTITION:
            self._check_split(report)
        future = self._waiting.pop(report.seq, None)
        if future is None or future.done():
            return
        if report.kind is Kind.ERROR:
            future.set_exception(
                PlaneError(f"{report.member_id}: {report.args.get('message', 'failed')}")
            )
        else:
            future.set_result(dict(report.args))

    async def call(self, member_id: str, op: Op, **args: Any) -> dict[str, Any]:
        """Send one command; its ack's arguments (a PlaneError if the member failed it)."""
        seq = self.plane.send(member_id, op, **args)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = future
        return await future

    def split(self, roles: Mapping[str, str]) -> None:
        """Re-partition the members into role groups (``Comm.Split``); logged with each
        group's ranks; every member's count of its group is checked as its ack comes."""
        seconds = self.plane.partition(dict(roles))
        epoch = self.plane.epoch
        groups: dict[str, list[int]] = {}
        for member_id, role in roles.items():
            groups.setdefault(role, []).append(self.rank_of[member_id])
        self._expected[epoch] = {m: len(groups[r]) for m, r in roles.items()}
        self.events(
            "split",
            epoch=epoch,
            groups={r: sorted(ranks) for r, ranks in sorted(groups.items())},
            s=round(seconds, 4),
        )

    def _check_split(self, report: Report) -> None:
        expected = self._expected.get(int(report.args.get("epoch", -1)), {})
        want = expected.get(report.member_id)
        if want is not None and int(report.args.get("group_size", -1)) != want:
            self.events(
                "split_mismatch",
                member=report.member_id,
                epoch=report.args.get("epoch"),
                group_size=report.args.get("group_size"),
                expected=want,
            )

    def shutdown(self) -> None:
        self.plane.shutdown()


@dataclass(frozen=True)
class TrainResult:
    """What the trainer ranks report of a step (trainer 0's numbers)."""

    version: int
    mean_reward: float
    max_staleness: int
    loss: float
    wall_s: float


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
        )

    async def publish(self, version: int, serving: Mapping[str, tuple[str, int]]) -> float:
        """The weights of ``version`` to every serving engine; returns the broadcast's
        seconds (on trainer 0)."""
        members = {name: [host, port] for name, (host, port) in serving.items()}
        ack = await self.members.call(self.lead, Op.PUBLISH, version=version, members=members)
        self.members.events(
            "publish",
            version=version,
            members=len(members),
            s=round(float(ack["seconds"]), 4),
            form_s=round(float(ack["form_s"]), 4),
        )
        return float(ack["seconds"])

    async def catch_up(self, name: str, address: tuple[str, int]) -> float:
        """The latest weights to one engine (point to point)."""
        host, port = address
        ack = await self.members.call(self.lead, Op.CATCH_UP, name=name, host=host, port=port)
        return float(ack["seconds"])
