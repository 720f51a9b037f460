"""Membership of the MPI control plane: pure bookkeeping with a hand-driven clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl_hpc.comm.membership import Member, Membership, MemberState
from pearl_hpc.errors import TransitionError

TIMEOUT = 5.0


def base_members(n: int) -> list[Member]:
    return [Member(f"base:{r}", "base", r, node="n0") for r in range(1, n + 1)]


def member(group: str, link_rank: int) -> Member:
    return Member(f"{group}:{link_rank - 1}", group, link_rank, node="n1")


def started(n_base: int = 2, now_s: float = 0.0) -> Membership:
    m = Membership(heartbeat_timeout_s=TIMEOUT)
    m.join(base_members(n_base), now_s)
    return m


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Membership(0)
    with pytest.raises(ValueError):
        Membership(-1.0)


def test_join_makes_members_live_in_join_order() -> None:
    m = started(2, now_s=7.0)
    m.join([member("3+0", 1), member("3+0", 2)], 8.0)
    assert [x.member_id for x in m.live()] == ["base:1", "base:2", "3+0:0", "3+0:1"]
    assert all(x.state is MemberState.MEMBER for x in m.members.values())
    assert m.members["base:1"].joined_s == m.members["base:1"].last_seen_s == 7.0
    assert m.members["3+0:1"].joined_s == 8.0
    assert [x.member_id for x in m.group("3+0")] == ["3+0:0", "3+0:1"]


def test_joining_twice_raises() -> None:
    m = started(1)
    m.join([member("3+0", 1)], 0.0)
    with pytest.raises(TransitionError, match="twice"):
        m.join([member("3+0", 1)], 1.0)
    with pytest.raises(TransitionError, match="twice"):
        m.join([Member("base:1", "base", 1)], 1.0)


# ------------------------------------------------------------ heartbeats


def test_overdue_marks_only_members_silent_past_the_timeout() -> None:
    m = started(2, now_s=0.0)
    m.join([member("8+0", 1)], now_s=0.0)
    m.heard("base:1", 4.0)
    m.heard("8+0:0", 3.0)
    # at t=9: base:2 silent 9 s (> 5), 8+0:0 silent 6 s (> 5), base:1 silent 5 s (not >)
    late = m.overdue(9.0)
    assert sorted(x.member_id for x in late) == ["8+0:0", "base:2"]
    assert m.members["base:2"].state is MemberState.FAILED
    assert m.members["8+0:0"].state is MemberState.FAILED
    assert m.members["base:1"].state is MemberState.MEMBER


def test_recently_heard_member_is_not_overdue() -> None:
    m = started(1, now_s=0.0)
    for t in (2.0, 4.0, 6.0, 8.0, 10.0):
        m.heard("base:1", t)
        assert m.overdue(t + TIMEOUT - 0.01) == []
    assert m.members["base:1"].last_seen_s == 10.0


def test_heard_never_moves_the_clock_back_and_ignores_strangers() -> None:
    m = started(1, now_s=0.0)
    m.heard("base:1", 10.0)
    m.heard("base:1", 3.0)  # a late-delivered, older heartbeat
    assert m.members["base:1"].last_seen_s == 10.0
    m.heard("nobody", 11.0)  # no error, no new member
    assert "nobody" not in m.members


def test_heard_all_forgives_a_deaf_master_but_not_the_failed() -> None:
    m = started(2, now_s=0.0)
    m.fail("base:2")
    m.heard_all(20.0)
    assert m.members["base:1"].last_seen_s == 20.0
    assert m.members["base:2"].last_seen_s == 0.0
    assert m.overdue(24.0) == []


def test_overdue_is_reported_once() -> None:
    m = started(1, now_s=0.0)
    assert [x.member_id for x in m.overdue(6.0)] == ["base:1"]
    assert m.overdue(7.0) == []
    m.heard("base:1", 101.0)  # a failed member heard again stays failed
    assert m.members["base:1"].state is MemberState.FAILED
    assert m.overdue(200.0) == []


def test_leaving_member_can_still_go_overdue() -> None:
    m = started(1, now_s=0.0)
    m.join([member("2+0", 1)], 0.0)
    m.leave("2+0")
    m.heard("base:1", 5.0)
    assert [x.member_id for x in m.overdue(6.0)] == ["2+0:0"]
    assert m.members["2+0:0"].state is MemberState.FAILED


# ------------------------------------------------------------ leave / fail / end


def test_leave_moves_live_members_to_leaving() -> None:
    m = started(1)
    m.join([member("6+0", 1), member("6+0", 2), member("6+0", 3)], 0.0)
    m.fail("6+0:1")
    left = m.leave("6+0")
    assert [x.member_id for x in left] == ["6+0:0", "6+0:2"]
    assert m.members["6+0:1"].state is MemberState.FAILED  # untouched
    assert m.leave("6+0") == []  # nobody live is left
    assert m.live() == [m.members["base:1"]]
    assert not m.ended("6+0")
    m.gone("6+0:0")
    m.gone("6+0:2")
    assert m.ended("6+0")


def test_fail_returns_the_member_once() -> None:
    m = started(2)
    assert m.fail("base:2") is m.members["base:2"]
    assert m.fail("base:2") is None
    assert m.fail("nobody") is None


def test_gone_only_ends_a_leaving_member() -> None:
    m = started(1)
    m.gone("base:1")  # an ack of LEAVE never sent: ignored
    assert m.members["base:1"].state is MemberState.MEMBER
    m.fail("base:1")
    m.gone("base:1")
    assert m.members["base:1"].state is MemberState.FAILED


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (MemberState.MEMBER, MemberState.MEMBER),
        (MemberState.MEMBER, MemberState.GONE),
        (MemberState.LEAVING, MemberState.MEMBER),
        (MemberState.FAILED, MemberState.MEMBER),
        (MemberState.FAILED, MemberState.LEAVING),
        (MemberState.GONE, MemberState.MEMBER),
        (MemberState.GONE, MemberState.FAILED),
    ],
)
def test_transition_table_rejects(start: MemberState, to: MemberState) -> None:
    m = Membership(TIMEOUT)
    x = Member("x", "g", 1, state=start)
    with pytest.raises(TransitionError):
        m._move(x, to)
    assert x.state is start


OPS = st.lists(
    st.tuples(
        st.sampled_from(["join", "leave", "fail", "gone", "overdue"]),
        st.integers(min_value=0, max_value=2),  # group index
        st.integers(min_value=0, max_value=30),  # member pick
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(n_base=st.integers(min_value=0, max_value=3), ops=OPS)
def test_invariants_under_any_operation_sequence(
    n_base: int, ops: list[tuple[str, int, int]]
) -> None:
    m = started(n_base)
    now = 0.0
    for i, (op, g, pick) in enumerate(ops):
        group = f"{g}+0"
        now += 1.0
        ids = sorted(m.members)
        if op == "join":
            m.join([Member(f"{group}:{i}", group, i + 1)], now)
        elif op == "leave":
            m.leave(group)
        elif op == "fail" and ids:
            m.fail(ids[pick % len(ids)])
        elif op == "gone" and ids:
            m.gone(ids[pick % len(ids)])
        elif op == "overdue":
            m.overdue(now + pick)
        live = m.live()
        assert all(x.state is MemberState.MEMBER for x in live)
        assert len({x.member_id for x in live}) == len(live)
        # an ended group holds nobody live or leaving
        for x in m.members.values():
            if m.ended(x.group):
                assert x.state in (MemberState.GONE, MemberState.FAILED)
