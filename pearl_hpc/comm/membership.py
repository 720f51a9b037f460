"""Who is in the MPI control plane: pure bookkeeping, clock passed in.

Lifecycle of one member::

    from \\ to  MEMBER   LEAVING   GONE          FAILED
    LINKED      admit    leave     -             heartbeat overdue
    MEMBER      -        leave     shrunk away   heartbeat overdue
    LEAVING     -        -         left          heartbeat overdue
    FAILED      -        -         shrunk away   -

A member is LINKED once its group connected to the master's port and said hello, a
MEMBER once the universe (the communicator all members share) was extended to it.
The universe's rank order is the order of :attr:`Membership.universe`: the master
first, then the base job's ranks, then each joined group in the order it was admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from pearl_hpc.comm.messages import Hello
from pearl_hpc.errors import TransitionError

MASTER_ID = "master"


class MemberState(StrEnum):
    LINKED = "linked"
    MEMBER = "member"
    LEAVING = "leaving"
    GONE = "gone"
    FAILED = "failed"


_LEGAL = {
    MemberState.LINKED: {MemberState.MEMBER, MemberState.LEAVING, MemberState.FAILED},
    MemberState.MEMBER: {MemberState.LEAVING, MemberState.GONE, MemberState.FAILED},
    MemberState.LEAVING: {MemberState.GONE, MemberState.FAILED},
    MemberState.FAILED: {MemberState.GONE},
    MemberState.GONE: set(),
}


@dataclass
class Member:
    member_id: str
    group: str  # "base" or the elastic job component's tag, e.g. "123+1"
    link_rank: int  # rank in the link communicator (the master is rank 0 there)
    node: str = ""
    gpu_ids: tuple[str, ...] = ()
    state: MemberState = MemberState.LINKED
    last_seen_s: float = 0.0
    joined_s: float = 0.0
    hello: Hello | None = None  # what it said when it joined (None: not yet)


class Membership:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.members: dict[str, Member] = {}
        self.universe: list[str] = [MASTER_ID]

    # ------------------------------------------------------------------ inputs
    def link(self, member: Member, now_s: float) -> None:
        if member.member_id in self.members:
            raise TransitionError(f"member {member.member_id} joined twice")
        member.last_seen_s = member.joined_s = now_s
        self.members[member.member_id] = member

    def start_base(self, members: Iterable[Member], now_s: float) -> None:
        """The base job's ranks: members of the universe from the start."""
        for member in members:
            self.link(member, now_s)
            self._move(member, MemberState.MEMBER)
            self.universe.append(member.member_id)

    def heard(self, member_id: str, now_s: float) -> None:
        member = self.members.get(member_id)
        if member is not None:
            member.last_seen_s = max(member.last_seen_s, now_s)

    def overdue(self, now_s: float) -> list[Member]:
        """Members silent for longer than the heartbeat timeout: marked FAILED."""
        late = [
            m
            for m in self.members.values()
            if m.state in (MemberState.LINKED, MemberState.MEMBER, MemberState.LEAVING)
            and now_s - m.last_seen_s > self.heartbeat_timeout_s
        ]
        for member in late:
            self._move(member, MemberState.FAILED)
        return late

    def fail(self, member_id: str) -> Member | None:
        member = self.members.get(member_id)
        if member is None or member.state in (MemberState.GONE, MemberState.FAILED):
            return None
        self._move(member, MemberState.FAILED)
        return member

    # ------------------------------------------------------------- universe
    def admit(self, group: str) -> list[str]:
        """The group's linked members join the universe, in link-rank order."""
        joining = sorted(
            (m for m in self.group(group) if m.state is MemberState.LINKED),
            key=lambda m: m.link_rank,
        )
        if not joining:
            raise TransitionError(f"group {group} has no linked member to admit")
        for member in joining:
            self._move(member, MemberState.MEMBER)
            self.universe.append(member.member_id)
        return [m.member_id for m in joining]

    def leave(self, group: str) -> list[Member]:
        """The group is given back: its live members leave (LEAVING)."""
        leaving = [
            m for m in self.group(group) if m.state in (MemberState.LINKED, MemberState.MEMBER)
        ]
        for member in leaving:
            self._move(member, MemberState.LEAVING)
        return leaving

    def gone(self, member_id: str) -> None:
        member = self.members[member_id]
        if member.state is not MemberState.GONE:
            self._move(member, MemberState.GONE)

    def needs_shrink(self) -> bool:
        return any(self._stale(i) for i in self.universe[1:])

    def shrink(self) -> list[str]:
        """Drop leaving, failed and gone members from the universe; returns the
        survivors in their new rank order. Failed members become GONE; leaving ones stay
        LEAVING until :meth:`gone`."""
        survivors = [i for i in self.universe if i == MASTER_ID or not self._stale(i)]
        for member_id in self.universe[1:]:
            if member_id not in survivors and self.members[member_id].state is MemberState.FAILED:
                self._move(self.members[member_id], MemberState.GONE)
        self.universe = survivors
        return list(survivors)

    def rank_of(self, member_id: str) -> int:
        return self.universe.index(member_id)

    def group(self, group: str) -> list[Member]:
        return [m for m in self.members.values() if m.group == group]

    def live(self) -> list[Member]:
        return [
            m for m in self.members.values() if m.state in (MemberState.LINKED, MemberState.MEMBER)
        ]

    def colors(self, roles: Mapping[str, str]) -> dict[str, int]:
        """``Comm.Split`` colours for the universe: one per role name (sorted, so every
        run numbers them alike); the master and members without a role get colour 0,
        the ``control`` group."""
        names = sorted(set(roles.values()))
        color = {name: i + 1 for i, name in enumerate(names)}
        return {i: color[roles[i]] if i in roles else 0 for i in self.universe}

    def _stale(self, member_id: str) -> bool:
        return self.members[member_id].state in (
            MemberState.LEAVING,
            MemberState.FAILED,
            MemberState.GONE,
        )

    def _move(self, member: Member, state: MemberState) -> None:
        if state not in _LEGAL[member.state]:
            raise TransitionError(f"member {member.member_id}: {member.state} -> {state}")
        member.state = state
