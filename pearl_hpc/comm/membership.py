"""Who is in the MPI control plane: pure bookkeeping, clock passed in.

Lifecycle of one member::

    from \\ to  LEAVING   GONE      FAILED
    MEMBER      leave     -         heartbeat overdue, an undelivered command, a dead socket
    LEAVING     -         left      heartbeat overdue
    FAILED      -         -         -

A member is a MEMBER from its hello on: the base job's ranks over the base world, an
elastic component's ranks once their hellos proved they hold the run's key. No
communicator spans members: each talks to the master over its own link, so a member's
death touches nobody else. :attr:`Membership.order` is the order members joined in (the
base job's ranks first): the order :meth:`live` lists them in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from pearl_hpc.comm.messages import Hello
from pearl_hpc.errors import TransitionError

MASTER_ID = "master"


class MemberState(StrEnum):
    MEMBER = "member"
    LEAVING = "leaving"
    GONE = "gone"
    FAILED = "failed"


_LEGAL = {
    MemberState.MEMBER: {MemberState.LEAVING, MemberState.FAILED},
    MemberState.LEAVING: {MemberState.GONE, MemberState.FAILED},
    MemberState.FAILED: set(),
    MemberState.GONE: set(),
}


@dataclass
class Member:
    member_id: str
    group: str  # "base" or the elastic job component's tag, e.g. "123+1"
    link_rank: int  # rank in the link communicator (the master is rank 0 there)
    node: str = ""
    gpu_ids: tuple[str, ...] = ()
    state: MemberState = MemberState.MEMBER
    last_seen_s: float = 0.0
    joined_s: float = 0.0
    hello: Hello | None = None  # what it said when it joined


class Membership:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.members: dict[str, Member] = {}  # every member the run had (ids are unique)
        # the members not yet gone or failed, and each group's: what every poll reads
        # stays the size of the run's live members after thousands of joins
        self._active: dict[str, Member] = {}
        self._groups: dict[str, list[Member]] = {}

    # ------------------------------------------------------------------ inputs
    def join(self, members: Iterable[Member], now_s: float) -> None:
        """Members whose hellos arrived (a whole link's at once)."""
        for member in members:
            if member.member_id in self.members:
                raise TransitionError(f"member {member.member_id} joined twice")
            member.last_seen_s = member.joined_s = now_s
            self.members[member.member_id] = member
            self._active[member.member_id] = member
            self._groups.setdefault(member.group, []).append(member)

    def heard(self, member_id: str, now_s: float) -> None:
        member = self.members.get(member_id)
        if member is not None:
            member.last_seen_s = max(member.last_seen_s, now_s)

    def heard_all(self, now_s: float) -> None:
        """The master itself was deaf until now: nobody is late because of that."""
        for member in self.live():
            member.last_seen_s = max(member.last_seen_s, now_s)

    def overdue(self, now_s: float) -> list[Member]:
        """Members silent for longer than the heartbeat timeout: marked FAILED."""
        late = [
            m for m in self._active.values() if now_s - m.last_seen_s > self.heartbeat_timeout_s
        ]
        for member in late:
            self._move(member, MemberState.FAILED)
        return late

    def fail(self, member_id: str) -> Member | None:
        """Declared failed (once): the member, or None if it was failed or gone."""
        member = self.members.get(member_id)
        if member is None or member.state in (MemberState.GONE, MemberState.FAILED):
            return None
        self._move(member, MemberState.FAILED)
        return member

    def leave(self, group: str) -> list[Member]:
        """The group is given back: its live members leave (LEAVING)."""
        leaving = [m for m in self.group(group) if m.state is MemberState.MEMBER]
        for member in leaving:
            self._move(member, MemberState.LEAVING)
        return leaving

    def gone(self, member_id: str) -> None:
        member = self.members[member_id]
        if member.state is MemberState.LEAVING:
            self._move(member, MemberState.GONE)

    # ------------------------------------------------------------------ queries
    def group(self, group: str) -> list[Member]:
        return list(self._groups.get(group, ()))

    def live(self) -> list[Member]:
        """Members in service (not leaving, gone or failed), in join order."""
        return [m for m in self._active.values() if m.state is MemberState.MEMBER]

    def leaving(self) -> bool:
        """Whether a member is leaving (its LEAVE not acknowledged yet)."""
        return any(m.state is MemberState.LEAVING for m in self._active.values())

    def ended(self, group: str) -> bool:
        """Every member of ``group`` is gone or failed: its link can be freed."""
        return all(m.state in (MemberState.GONE, MemberState.FAILED) for m in self.group(group))

    def _move(self, member: Member, state: MemberState) -> None:
        if state not in _LEGAL[member.state]:
            raise TransitionError(f"member {member.member_id}: {member.state} -> {state}")
        member.state = state
        if state in (MemberState.GONE, MemberState.FAILED):
            self._active.pop(member.member_id, None)
