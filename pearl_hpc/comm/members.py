"""The master's side of the run's MPI world, for its asyncio loop.

    MasterPlane (comm/mpi.py)      the pump thread: every MPI call, joins, hellos
        └── Members                 membership, commands as awaitables, failures
              └── RemoteTrainer     the trainer ranks (pearl_hpc/master/trainer.py)

    elastic rank ──joins/<group>.json──> the pump: go + nonce, Accept, proven hellos
                 ──> Joined: MEMBER ──LEAVE + Disconnect (its job given back)──> GONE

The master never waits on MPI: commands are queued for the pump, what arrives is taken
by :meth:`Members.poll` (every few ms). The role partition is the master's table: after
each applied plan the members' role groups are logged as a ``partition`` event (each
group's members); nothing spans two members' links, so no member's death or delay can
hold another member or the master.

Failures: one funnel, :meth:`Members._failed`. It marks the member FAILED, fails every
command still waiting for its ack (the awaiting step sees a :class:`PlaneError` at once),
frees its link once no member of it is left, logs ``member_failed`` and tells the
master (``on_failed``: an engine's slot is replaced).

    detector                                   -> funnel  -> effect
    heartbeat silent past heartbeat_timeout_s     _failed    slot replaced / step fails
    a command undelivered in send_timeout_s       _failed    (same)
    its engine socket died (backends/ranks.py)    fail()     (same)
    its engine socket silent 10 s, calls in        fail()     (same)
      flight (engine/rpc.py's liveness pings)
    its Slurm job component ended (squeue)        fail()     (same)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import msgspec

from pearl_hpc.comm.layout import domain_of
from pearl_hpc.comm.membership import Member, Membership, MemberState
from pearl_hpc.comm.messages import (
    Ack,
    CommandBody,
    Failed,
    Heartbeat,
    Hello,
    Leave,
    Op,
    ReportBody,
    Shutdown,
    decode_report,
)
from pearl_hpc.comm.mpi import (
    Abandoned,
    Arrival,
    Broken,
    Dropped,
    Joined,
    LinkFailed,
    MasterPlane,
    PlaneError,
    Received,
    Undelivered,
    member_id_at,
)

log = logging.getLogger(__name__)
_A = TypeVar("_A", bound=ReportBody)

POLL_S = 0.005
LEAVE_TIMEOUT_S = 15.0  # members that do not ack LEAVE by then are cancelled anyway
HEARTBEAT_TIMEOUT_S = 10.0


SAY_EVERY_S = 5.0  # start-up lines: at most one this often


class Members:
    """Commands to members as awaitables; joins, leaving, failures; the role partition
    after each plan."""

    def __init__(
        self,
        plane: MasterPlane,
        events: Callable[..., None],
        *,
        roles: Callable[[], Mapping[str, str]] = dict,
        on_failed: Callable[[Member], None] = lambda member: None,
        on_joined: Callable[[str], None] = lambda group: None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        """``events(kind, **fields)`` logs; ``roles()`` is each member's group after
        the plan now applied; ``on_failed(member)`` is told of every member declared
        failed, ``on_joined(group)`` of every group that joined after the base world."""
        self.plane = plane
        self.events = events
        self.membership = Membership(heartbeat_timeout_s)
        self.hellos: dict[str, Hello] = {}  # member id -> what its hello said
        self.roles = roles
        self.on_failed = on_failed
        self.on_joined = on_joined
        self._waiting: dict[int, tuple[str, asyncio.Future[ReportBody]]] = {}
        self._given_back: set[str] = set()  # groups told to leave (one joining late too)
        self._groups: dict[str, list[str]] = {}  # the last partition logged
        self.epoch = 0
        self._base_joined = False
        self._shutdown: dict[int, str] = {}  # SHUTDOWN seq -> member, until acked

    def start(
        self,
        since_s: float,
        timeout_s: float = 900.0,
        say: Callable[[str], None] | None = None,
        *,
        trainers: int = 0,
        engines: int = 0,
    ) -> None:
        """Every rank of the base world said hello, and the ``trainers`` trainer ranks
        and ``engines`` base engine ranks (launches of their own) joined (blocking: before
        the loop serves anything);
        ``since_s``: when this rank started (``time.monotonic``), for the world's start
        latency; ``say``: a line each time more ranks are up (a trainer once its weights
        are loaded, an engine once it serves)."""
        deadline = time.monotonic() + timeout_s
        seen: tuple[int, int] | None = None
        said_s = 0.0
        while (
            not self._base_joined
            or len(self.of_kind("trainer")) < trainers
            or len(self.base_engines()) < engines
        ):
            self.poll()
            count = self._up(trainers + engines) if say is not None else seen
            # a line when more are up, at most every SAY_EVERY_S (512 ranks: not 512 lines)
            if (
                say is not None
                and count is not None
                and count != seen
                and (count[0] == count[1] or time.monotonic() - said_s >= SAY_EVERY_S)
            ):
                seen, said_s = count, time.monotonic()
                say(f"starting: {count[0]}/{count[1]} ranks up ({said_s - since_s:.0f} s)")
            if time.monotonic() > deadline:
                raise PlaneError(f"the base ranks did not all join in {timeout_s:g} s")
            time.sleep(POLL_S)
        self.events(
            "world",
            ranks=1 + len(self.hellos),
            trainers=len(self.of_kind("trainer")),
            engines=len(self.of_kind("engine")),
            nodes={str(h.rank): h.node for h in self.hellos.values() if h.rank >= 0},
            start_s=round(time.monotonic() - since_s, 3),
        )
        if say is not None:
            say(f"started: {1 + len(self.hellos)} ranks up in {time.monotonic() - since_s:.0f} s")

    def _up(self, launched: int) -> tuple[int, int]:
        """(ranks up, ranks besides the master) while the run starts; ``launched``:
        the ranks of the launches besides the master's world."""
        world = self.plane.base_hellos() or (0, 0)
        up = len(self.of_kind("trainer")) + len(self.base_engines())
        return world[0] + up, world[1] + launched

    def of_kind(self, kind: str) -> list[str]:
        """Live members running ``kind`` (trainer, engine), in join order (the base
        job's in rank order)."""
        return [
            m.member_id for m in self.membership.live() if self.hellos[m.member_id].process == kind
        ]

    def base_engines(self) -> list[str]:
        """Live base engine ranks (launches of their own: :func:`domain_of`)."""
        members = self.membership.members
        return [m for m in self.of_kind("engine") if domain_of(members[m].group) is not None]

    def engine_on(self, gpu_ids: tuple[str, ...]) -> tuple[str, Hello] | None:
        """The live engine rank on ``gpu_ids``: its member id and hello (None: none
        yet)."""
        for member_id in self.of_kind("engine"):
            if self.hellos[member_id].gpu_ids == gpu_ids:
                return member_id, self.hellos[member_id]
        return None

    def group_state(self, group: str) -> set[MemberState]:
        return {m.state for m in self.membership.group(group)}

    # ------------------------------------------------------------------ the poll
    async def poll_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.poll()
            await asyncio.sleep(POLL_S)

    def poll(self) -> None:
        """What the pump received, then the members silent past the timeout."""
        for arrival in self.plane.take():
            self._arrived(arrival)
        now = time.monotonic()
        if self.plane.deaf_s() > self.membership.heartbeat_timeout_s / 4:
            self.membership.heard_all(now)  # the pump was held (Accept): it heard nobody
            return
        for member in self.membership.overdue(now):
            self._failed(member, "silent past the heartbeat timeout")

    def _arrived(self, arrival: Arrival) -> None:
        if isinstance(arrival, Received):
            self._received(arrival)
        elif isinstance(arrival, Joined):
            self._joined(arrival)
        elif isinstance(arrival, Dropped):
            self.events("connection_dropped", reason=arrival.reason, group=arrival.group)
        elif isinstance(arrival, Abandoned):
            self.events("join_abandoned", group=arrival.group)
        elif isinstance(arrival, Undelivered):
            member_id = self._member_at(arrival.group, arrival.rank)
            if member_id is not None:
                s = self.plane.send_timeout_s
                self.fail(member_id, f"a command was not delivered in {s:g} s")
        elif isinstance(arrival, LinkFailed):
            for member in self.membership.group(arrival.group):
                self.fail(member.member_id, f"an MPI error on its link: {arrival.error}")
        elif isinstance(arrival, Broken):
            raise PlaneError(f"the control plane failed: {arrival.error}")

    def _member_at(self, group: str, rank: int) -> str | None:
        member_id = member_id_at(group, rank)
        return member_id if member_id in self.membership.members else None

    def _joined(self, joined: Joined) -> None:
        members = [
            Member(
                r.member_id,
                joined.group,
                rank,
                node=r.body.node,
                gpu_ids=r.body.gpu_ids,
                hello=r.body,
            )
            for rank, r in joined.hellos.items()
            if isinstance(r.body, Hello)
        ]
        self.membership.join(members, time.monotonic())
        for member in members:
            self.hellos[member.member_id] = _hello_of(member)
        if joined.group == "base":
            self._base_joined = True
            return
        pids = {m.member_id: _hello_of(m).pid for m in members}
        self.events("joined", group=joined.group, members=pids, s=round(joined.seconds, 4))
        if joined.group in self._given_back:  # its capacity went back before it joined
            self.leave(joined.group)
            return
        self.on_joined(joined.group)

    def _received(self, received: Received) -> None:
        try:
            report = decode_report(received.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("control plane: dropped a malformed message on %s: %s", received.group, exc)
            return
        sender = self.membership.members.get(report.member_id)
        if sender is None or sender.group != received.group or sender.link_rank != received.source:
            log.warning("control plane: %s on %s's link: dropped", report.member_id, received.group)
            return  # one speaks for itself only
        self.membership.heard(report.member_id, time.monotonic())
        body = report.body
        if isinstance(body, Heartbeat):
            return
        if isinstance(body, Ack) and body.op is Op.SHUTDOWN:
            self._shutdown.pop(report.seq, None)
        if isinstance(body, Ack) and body.op is Op.LEAVE:
            self.membership.gone(report.member_id)
            self._close_if_ended(sender.group)
        entry = self._waiting.pop(report.seq, None)
        if entry is None or entry[1].done():
            return
        if isinstance(body, Failed):
            entry[1].set_exception(PlaneError(f"{report.member_id}: {body.message}"))
        else:
            entry[1].set_result(body)

    # ------------------------------------------------------------ failures, leaving
    def fail(self, member_id: str, reason: str) -> None:
        """A member known dead (its engine socket died, its job ended...)."""
        member = self.membership.fail(member_id)
        if member is not None:
            self._failed(member, reason)

    def _failed(self, member: Member, reason: str) -> None:
        """The one place a member is declared failed (already marked FAILED)."""
        self.events("member_failed", member=member.member_id, group=member.group, reason=reason)
        for seq, (member_id, future) in list(self._waiting.items()):
            if member_id == member.member_id:
                del self._waiting[seq]
                if not future.done():
                    future.set_exception(PlaneError(f"{member_id} failed: {reason}"))
        for seq in [s for s, m in self._shutdown.items() if m == member.member_id]:
            del self._shutdown[seq]
        self._close_if_ended(member.group)
        self.on_failed(member)

    def _close_if_ended(self, group: str) -> None:
        """Every member of an elastic ``group`` left or failed: its link goes (both
        sides Disconnect if all left, else the master frees its side)."""
        if group == "base" or not self.membership.ended(group):
            return
        left = all(m.state is MemberState.GONE for m in self.membership.group(group))
        self.plane.close_link(group, left=left)

    def leave(self, group: str) -> None:
        """The group's job is given back: its members leave the plane (LEAVE, then both
        sides Disconnect). A group that has not joined yet is sent away when it does."""
        self._given_back.add(group)
        leaving = self.membership.leave(group)
        for member in leaving:
            self._send(member, Leave())
        if leaving:
            self.events("leave", group=group)

    def left(self, group: str) -> bool:
        """Every member of ``group`` acked LEAVE (or died)."""
        return self.membership.ended(group) and bool(self.membership.group(group))

    def leave_all(self, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
        """Every elastic group leaves (the run ends; blocking, bounded)."""
        groups = {m.group for m in self.membership.live() if m.group != "base"}
        for group in sorted(groups):
            self.leave(group)
        deadline = time.monotonic() + timeout_s
        while not all(self.left(g) for g in groups) and time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)

    # ------------------------------------------------------------ commands, partition
    def _send(self, member: Member, body: CommandBody) -> int:
        return self.plane.send(member.group, member.link_rank, body)

    async def call(self, member_id: str, body: CommandBody, ack: type[_A]) -> _A:
        """Send one command; its ack, of type ``ack`` (a PlaneError if the member failed
        the command, answered it with something else, or failed meanwhile)."""
        member = self.membership.members[member_id]
        if member.state is not MemberState.MEMBER:
            raise PlaneError(f"{member_id} is {member.state}: {type(body).__name__} not sent")
        seq = self._send(member, body)
        future: asyncio.Future[ReportBody] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = (member_id, future)
        answer = await future
        if not isinstance(answer, ack):
            raise PlaneError(f"{member_id}: {type(body).__name__} answered with {answer!r}"[:300])
        return answer

    def partition(self) -> None:
        """The plan applied: log the members' role groups when they changed (the
        ``partition`` event: each role's members, in join order)."""
        roles = self.roles()
        groups: dict[str, list[str]] = {}
        for member in self.membership.live():
            if member.member_id in roles:
                groups.setdefault(roles[member.member_id], []).append(member.member_id)
        groups = dict(sorted(groups.items()))
        if groups != self._groups:
            self._groups = groups
            self.epoch += 1
            self.events("partition", epoch=self.epoch, groups=groups)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tell every live member to exit and wait (bounded) until they and the members
        already leaving have acknowledged; then the pump stops."""
        waiting = self._shutdown
        waiting.update({self._send(m, Shutdown()): m.member_id for m in self.membership.live()})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(PlaneError):
                self.poll()
            if not waiting and not self.membership.leaving():
                break
            time.sleep(0.01)
        else:
            log.warning("no shutdown ack from %s", ", ".join(sorted(waiting.values())))
        self.plane.close()


def _hello_of(member: Member) -> Hello:
    if member.hello is None:  # the plane links a member only with its hello
        raise PlaneError(f"{member.member_id}: linked without a hello")
    return member.hello
