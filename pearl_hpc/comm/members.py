"""The master's side of the run's MPI world, for its asyncio loop.

    MasterPlane (comm/mpi.py)      hellos, joins, commands, reports, Comm.Split, shutdown
        └── Members                 a poll task resolves each command's ack by its seq
              └── RemoteTrainer     the trainer ranks (pearl_hpc/master/trainer.py)

    elastic rank ──joins/<group>.json──> poll: Accept (one at a time) ──> LINKED
                 ──all fresh──> admit: the universe grows (Create_intercomm + Merge)
                 ──LEAVE + Disconnect (its job given back)──> GONE ──> shrink
    a member silent past the heartbeat timeout, or whose engine socket died: FAILED,
    shrunk away before the next collective call
    a plan applied ──> PARTITION to every member ──> they Comm.Split among themselves
                 ──acks (group sizes, seconds)──> the "split" event

The master never waits inside MPI for a member's work: commands are sent, acks arrive
through :meth:`Members.poll` (every few ms, beside heartbeats). The re-partition after a
plan is the members' collective alone (the master sends colours): a member slow to
enter it delays its peers, not the master's loop; while it runs its members are not
judged silent (they cannot heartbeat from inside it), and one that does not finish in
``COLLECTIVE_TIMEOUT_S`` fails the run (a member died inside it: MPI cannot recover;
``--resume``). The collectives the master takes part in (admit, shrink) block its loop,
so they are entered only once every member answered a PREPARE just before (a member
busy without its control thread, or dead, would hold the master in them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from pearl_hpc.comm.membership import Member, MemberState
from pearl_hpc.comm.messages import (
    Ack,
    CollectiveAck,
    CommandBody,
    Failed,
    Hello,
    Op,
    Prepare,
    Report,
    ReportBody,
)
from pearl_hpc.comm.mpi import COLLECTIVE_TIMEOUT_S, MasterPlane, PlaneError
from pearl_hpc.slurm.client import FORK_LOCK

log = logging.getLogger(__name__)
_A = TypeVar("_A", bound=ReportBody)

POLL_S = 0.005
LEAVE_TIMEOUT_S = 15.0  # members that do not ack LEAVE by then are cancelled anyway
READY_S = 1.0  # a PREPARE round answered longer ago than this is asked again


@dataclass
class _Prepare:
    """One PREPARE round: the members asked, those yet to answer."""

    members: tuple[str, ...]
    seqs: set[int]
    waiting: set[str]
    answered_s: float | None = None


@dataclass
class _Split:
    """The re-partition the members are making: who has not acked yet."""

    epoch: int
    groups: dict[str, list[int]]  # role -> ranks
    waiting: set[str]
    sent_s: float
    seconds: dict[str, float]  # each member's time inside it (the least: the member
    # that entered last, the one the others waited for)


class Members:
    """Commands to members as awaitables; joins, admission, leaving; ``Comm.Split``
    after each plan."""

    def __init__(
        self,
        plane: MasterPlane,
        events: Callable[..., None],
        *,
        roles: Callable[[], Mapping[str, str]] = dict,
        on_failed: Callable[[Member], None] = lambda member: None,
        split_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        """``events(kind, **fields)`` logs; ``roles()`` is each member's group after
        the plan now applied (what a split partitions by); ``on_failed(member)`` is told
        of every member declared failed."""
        self.plane = plane
        self.events = events
        self.split_timeout_s = split_timeout_s  # a re-partition not acked by then: fatal
        self.hellos: dict[str, Hello] = {}  # member id -> what its hello said
        self.roles = roles
        self.on_failed = on_failed
        self._waiting: dict[int, asyncio.Future[ReportBody]] = {}
        self._expected: dict[int, dict[str, int]] = {}  # epoch -> member -> group size
        self._to_admit: list[str] = []  # linked groups waiting to enter the universe
        self._given_back: set[str] = set()  # groups told to leave (one joining late too)
        self._split_wanted = False
        self._splitting: _Split | None = None
        self._prepare: _Prepare | None = None

    def start(self, since_s: float) -> None:
        """Every base rank said hello (blocking: before the loop serves anything);
        ``since_s``: when this rank started (``time.monotonic``), for the world's start
        latency."""
        for member in self.plane.start_base():
            self.hellos[member.member_id] = _hello_of(member)
        self.events(
            "world",
            ranks=1 + len(self.hellos),
            trainers=len(self.of_kind("trainer")),
            engines=len(self.of_kind("engine")),
            nodes={str(self.rank(m)): h.node for m, h in self.hellos.items()},
            start_s=round(time.monotonic() - since_s, 3),
        )

    def rank(self, member_id: str) -> int:
        """The member's rank in the universe now (base ranks keep theirs until a shrink)."""
        return self.plane.membership.rank_of(member_id)

    def of_kind(self, kind: str) -> list[str]:
        """Live members of the universe running ``kind`` (trainer, engine), in rank
        order."""
        membership = self.plane.membership
        return sorted(
            (
                m
                for m, h in self.hellos.items()
                if h.process == kind
                and m in membership.universe
                and membership.members[m].state is MemberState.MEMBER
            ),
            key=self.rank,
        )

    def engine_on(self, gpu_ids: tuple[str, ...]) -> tuple[str, Hello] | None:
        """The admitted engine rank on ``gpu_ids``: its member id and hello (None: none
        yet)."""
        for member_id in self.of_kind("engine"):
            if self.hellos[member_id].gpu_ids == gpu_ids:
                return member_id, self.hellos[member_id]
        return None

    def group_state(self, group: str) -> set[MemberState]:
        return {m.state for m in self.plane.membership.group(group)}

    # ------------------------------------------------------------------ the poll
    async def poll_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.poll()
            await asyncio.sleep(POLL_S)

    def poll(self) -> None:
        """Joins, reports, silent members, then the collective calls now due."""
        if self.plane.joins_waiting():
            self._accept_joins()
        for report in self.plane.poll():
            self._on_report(report)
        self._hold_splitting()
        for member in self.plane.overdue():
            self._on_failed(member, "silent past the heartbeat timeout")
        if self._splitting is not None:
            return  # admit, shrink and the next split wait until the members are out
        self._admit_joined()
        if self._split_wanted and not self._to_admit and self._ready():
            if self.plane.membership.needs_shrink():
                self._shrink()  # the next poll splits the survivors
            else:
                self._split()

    def _hold_splitting(self) -> None:
        """Members inside the re-partition cannot heartbeat: not silent meanwhile, up to
        ``split_timeout_s``; past it the run cannot go on."""
        split = self._splitting
        if split is None:
            return
        now = time.monotonic()
        if now - split.sent_s > self.split_timeout_s:
            raise PlaneError(
                f"re-partition {split.epoch}: {sorted(split.waiting)} did not finish in "
                f"{self.split_timeout_s:g} s (a member died inside the collective; MPI "
                "cannot recover from that): resume the run"
            )
        for member_id in split.waiting:
            self.plane.membership.heard(member_id, self.plane.clock())

    def _ready(self, joining: str | None = None) -> bool:
        """May the master enter a collective call now? Only once every member it spans
        (and the ``joining`` group) answered a PREPARE within ``READY_S``: a member
        whose control thread does not run (its process busy starting an engine on shared
        cores), or that died, would hold the master's loop inside the call -- or for
        good. Sends the round when none is out for these members; True consumes it."""
        if not self.plane.all_fresh(joining=joining):
            return False
        membership = self.plane.membership
        members = [
            m for m in membership.universe[1:] if membership.members[m].state is MemberState.MEMBER
        ]
        if joining is not None:
            members += [m.member_id for m in membership.group(joining)]
        key = tuple(members)
        now = time.monotonic()
        prep = self._prepare
        stale = prep is not None and prep.answered_s is not None and now - prep.answered_s > READY_S
        if prep is None or prep.members != key or stale:
            seqs = {self.plane.send(m, Prepare()) for m in members}
            self._prepare = _Prepare(key, seqs, set(members), None if members else now)
            return not members
        if prep.waiting:
            return False
        self._prepare = None
        return True

    def _accept_joins(self) -> None:
        # MPICH crashed in Accept while a child forked after MPI_Init was alive (seen
        # with squeue): no Slurm command runs meanwhile, and none is waited for
        if not FORK_LOCK.acquire(blocking=False):
            return
        try:
            groups = self.plane.poll_joins()
        finally:
            FORK_LOCK.release()
        for group in groups:
            members = self.plane.membership.group(group)
            for member in members:
                self.hellos[member.member_id] = _hello_of(member)
            self.events(
                "joined", group=group, members={m.member_id: _hello_of(m).pid for m in members}
            )
            if group in self._given_back:  # its capacity went back before it joined
                self.leave(group)
                continue
            self._to_admit.append(group)

    def _admit_joined(self) -> None:
        """Grow the universe with the joined groups, while every member is fresh."""
        while self._to_admit and self._ready(joining=self._to_admit[0]):
            group = self._to_admit.pop(0)
            if self.group_state(group) != {MemberState.LINKED}:
                continue  # failed or left before it could be admitted
            seconds = self.plane.admit(group)
            members = [m.member_id for m in self.plane.membership.group(group)]
            self.events("admitted", group=group, members=members, s=round(seconds, 4))
            self._split_wanted = True  # the newcomers take their group (idle until placed)

    def _on_report(self, report: Report) -> None:
        body = report.body
        if isinstance(body, CollectiveAck) and body.op is Op.PARTITION:
            self._check_split(report.member_id, body)
            self._split_acked(report.member_id, body.seconds)
        prep = self._prepare
        if prep is not None and isinstance(body, Ack) and report.seq in prep.seqs:
            prep.waiting.discard(report.member_id)
            if not prep.waiting:
                prep.answered_s = time.monotonic()
        future = self._waiting.pop(report.seq, None)
        if future is None or future.done():
            return
        if isinstance(body, Failed):
            future.set_exception(PlaneError(f"{report.member_id}: {body.message}"))
        else:
            future.set_result(body)

    # ------------------------------------------------------------ failures, leaving
    def fail(self, member_id: str, reason: str) -> None:
        """A member known dead (its engine socket died): out of the next collective."""
        member = self.plane.membership.fail(member_id)
        if member is not None:
            self._on_failed(member, reason)

    def _on_failed(self, member: Member, reason: str) -> None:
        self.events("member_failed", member=member.member_id, group=member.group, reason=reason)
        self._split_acked(member.member_id, None)  # its peers may still finish the split
        if member.group != "base" and self.group_state(member.group) <= {
            MemberState.FAILED,
            MemberState.GONE,
        }:
            self.plane.drop_group(member.group)
        self._split_wanted = True
        self.on_failed(member)

    def leave(self, group: str) -> None:
        """The group's job is given back: its members leave the plane (LEAVE, then both
        sides Disconnect); the universe shrinks at the next collective call. A group
        that has not joined yet is sent away when it does (never admitted)."""
        self._given_back.add(group)
        if group in self._to_admit:
            self._to_admit.remove(group)
        if self.plane.leave(group):
            self.events("leave", group=group)

    def left(self, group: str) -> bool:
        """Every member of ``group`` acked LEAVE (or died)."""
        return self.group_state(group) <= {MemberState.GONE, MemberState.FAILED}

    def leave_all(self, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
        """Every elastic group leaves (the run ends; blocking, bounded)."""
        groups = {m.group for m in self.plane.membership.live() if m.group != "base"}
        for group in sorted(groups):
            self.leave(group)
        deadline = time.monotonic() + timeout_s
        while not all(self.left(g) for g in groups) and time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)

    # ------------------------------------------------------------ commands, split
    async def call(self, member_id: str, body: CommandBody, ack: type[_A]) -> _A:
        """Send one command; its ack, of type ``ack`` (a PlaneError if the member failed
        the command or answered it with something else)."""
        seq = self.plane.send(member_id, body)
        future: asyncio.Future[ReportBody] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = future
        answer = await future
        if not isinstance(answer, ack):
            raise PlaneError(f"{member_id}: {type(body).__name__} answered with {answer!r}"[:300])
        return answer

    def split(self) -> None:
        """Ask for a re-partition of the members into role groups (``Comm.Split``), made
        by the poll as soon as every member is fresh, with the roles of that moment."""
        self._split_wanted = True
        self.poll()

    def flush(self, timeout_s: float = 30.0) -> None:
        """The split still wanted, made and acked before the run ends (blocking,
        bounded)."""
        deadline = time.monotonic() + timeout_s
        while (self._split_wanted or self._splitting) and time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)

    def _split(self) -> None:
        """Send the members their role groups; the "split" event (each group's ranks,
        the slowest member's seconds inside it) is logged once all acked. Every member's
        count of its group is checked as its ack comes."""
        self._split_wanted = False
        universe = self.plane.membership.universe
        roles = {m: r for m, r in self.roles().items() if m in universe}
        epoch, asked = self.plane.partition(roles)
        groups: dict[str, list[int]] = {}
        for member_id, role in roles.items():
            groups.setdefault(role, []).append(self.rank(member_id))
        self._expected[epoch] = {m: len(groups[r]) for m, r in roles.items()}
        self._splitting = _Split(epoch, groups, set(asked), time.monotonic(), {})
        self._split_done()  # no member at all: done at once

    def _split_acked(self, member_id: str, seconds: float | None) -> None:
        """``member_id`` acked the split (``seconds`` inside it) or failed (None)."""
        if self._splitting is not None:
            self._splitting.waiting.discard(member_id)
            if seconds is not None:
                self._splitting.seconds[member_id] = seconds
            self._split_done()

    def _split_done(self) -> None:
        split = self._splitting
        if split is None or split.waiting:
            return
        self._splitting = None
        self.events(
            "split",
            epoch=split.epoch,
            groups={r: sorted(ranks) for r, ranks in sorted(split.groups.items())},
            s=round(max(split.seconds.values(), default=0.0), 4),
            wait_s=round(time.monotonic() - split.sent_s, 4),
            last=min(split.seconds, key=split.seconds.__getitem__, default=""),
        )

    def _shrink(self) -> None:
        seconds = self.plane.shrink()
        self.events("shrink", ranks=len(self.plane.membership.universe), s=round(seconds, 4))

    def _check_split(self, member_id: str, ack: CollectiveAck) -> None:
        want = self._expected.get(ack.epoch, {}).get(member_id)
        if want is not None and ack.group_size != want:
            self.events(
                "split_mismatch",
                member=member_id,
                epoch=ack.epoch,
                group_size=ack.group_size,
                expected=want,
            )

    def shutdown(self) -> None:
        self.plane.shutdown()


def _hello_of(member: Member) -> Hello:
    if member.hello is None:  # the plane links a member only with its hello
        raise PlaneError(f"{member.member_id}: linked without a hello")
    return member.hello
