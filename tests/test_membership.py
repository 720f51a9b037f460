"""Membership of the MPI control plane: pure bookkeeping with a hand-driven clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl_hpc.comm.membership import MASTER_ID, Member, Membership, MemberState
from pearl_hpc.errors import TransitionError

TIMEOUT = 5.0


def base_members(n: int) -> list[Member]:
    return [Member(f"base:{r}", "base", r, node="n0") for r in range(1, n + 1)]


def member(group: str, link_rank: int) -> Member:
    return Member(f"{group}:{link_rank - 1}", group, link_rank, node="n1")


def started(n_base: int = 2, now_s: float = 0.0) -> Membership:
    m = Membership(heartbeat_timeout_s=TIMEOUT)
    m.start_base(base_members(n_base), now_s)
    return m


# ------------------------------------------------------------------ construction


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Membership(0)
    with pytest.raises(ValueError):
        Membership(-1.0)


def test_new_membership_holds_only_the_master() -> None:
    m = Membership(TIMEOUT)
    assert m.universe == [MASTER_ID]
    assert m.members == {}
    assert not m.needs_shrink()


def test_start_base_puts_base_members_after_the_master() -> None:
    m = started(3, now_s=7.0)
    assert m.universe == [MASTER_ID, "base:1", "base:2", "base:3"]
    assert all(x.state is MemberState.MEMBER for x in m.members.values())
    assert all(x.joined_s == x.last_seen_s == 7.0 for x in m.members.values())
    assert [m.rank_of(i) for i in m.universe] == [0, 1, 2, 3]
    assert [x.member_id for x in m.group("base")] == ["base:1", "base:2", "base:3"]


# ----------------------------------------------------------------- link / admit


def test_link_then_admit_appends_group_in_link_rank_order() -> None:
    m = started(2)
    # linked out of order: admission follows link rank, not arrival
    for rank in (3, 1, 2):
        m.link(member("12+0", rank), now_s=1.0)
    assert m.universe == [MASTER_ID, "base:1", "base:2"]  # linked is not yet a member
    assert {x.state for x in m.group("12+0")} == {MemberState.LINKED}

    admitted = m.admit("12+0")
    assert admitted == ["12+0:0", "12+0:1", "12+0:2"]
    assert m.universe == [MASTER_ID, "base:1", "base:2", "12+0:0", "12+0:1", "12+0:2"]
    assert all(x.state is MemberState.MEMBER for x in m.group("12+0"))


def test_groups_join_in_admission_order() -> None:
    m = started(1)
    m.link(member("7+1", 1), 0.0)
    m.link(member("7+0", 1), 0.0)
    m.admit("7+1")
    m.admit("7+0")
    assert m.universe == [MASTER_ID, "base:1", "7+1:0", "7+0:0"]
    assert m.rank_of("7+0:0") == 3


def test_admit_only_takes_members_still_linked() -> None:
    m = started(1)
    m.link(member("9+0", 1), 0.0)
    m.admit("9+0")
    m.link(member("9+0", 2), 1.0)  # a late rank of the same group
    assert m.admit("9+0") == ["9+0:1"]
    assert m.universe == [MASTER_ID, "base:1", "9+0:0", "9+0:1"]


def test_admit_group_with_no_linked_member_raises() -> None:
    m = started(1)
    with pytest.raises(TransitionError, match="no linked member"):
        m.admit("nobody+0")
    m.link(member("4+0", 1), 0.0)
    m.admit("4+0")
    with pytest.raises(TransitionError):  # already admitted: none left linked
        m.admit("4+0")
    m.link(member("5+0", 1), 0.0)
    m.leave("5+0")  # left before being admitted
    with pytest.raises(TransitionError):
        m.admit("5+0")


def test_joining_twice_raises() -> None:
    m = started(1)
    m.link(member("3+0", 1), 0.0)
    with pytest.raises(TransitionError, match="twice"):
        m.link(member("3+0", 1), 1.0)
    with pytest.raises(TransitionError, match="twice"):
        m.link(Member("base:1", "base", 1), 1.0)
    with pytest.raises(TransitionError):
        m.start_base([Member("base:1", "base", 1)], 1.0)


# ------------------------------------------------------------ heartbeats


def test_overdue_marks_only_members_silent_past_the_timeout() -> None:
    m = started(2, now_s=0.0)
    m.link(member("8+0", 1), now_s=0.0)
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
    assert m.members["base:1"].state is MemberState.MEMBER
    assert m.members["base:1"].last_seen_s == 10.0


def test_heard_never_moves_the_clock_back_and_ignores_strangers() -> None:
    m = started(1, now_s=0.0)
    m.heard("base:1", 10.0)
    m.heard("base:1", 3.0)  # a late-delivered, older heartbeat
    assert m.members["base:1"].last_seen_s == 10.0
    m.heard("nobody", 11.0)  # no error, no new member
    assert "nobody" not in m.members


def test_overdue_is_reported_once() -> None:
    m = started(1, now_s=0.0)
    assert [x.member_id for x in m.overdue(6.0)] == ["base:1"]
    assert m.overdue(7.0) == []
    assert m.overdue(100.0) == []
    m.heard("base:1", 101.0)  # a failed member heard again stays failed
    assert m.members["base:1"].state is MemberState.FAILED
    assert m.overdue(200.0) == []


def test_leaving_member_can_still_go_overdue() -> None:
    m = started(1, now_s=0.0)
    m.link(member("2+0", 1), 0.0)
    m.admit("2+0")
    m.leave("2+0")
    m.heard("base:1", 5.0)
    assert [x.member_id for x in m.overdue(6.0)] == ["2+0:0"]
    assert m.members["2+0:0"].state is MemberState.FAILED
    assert m.members["base:1"].state is MemberState.MEMBER


# ------------------------------------------------------------ leave / fail


def test_leave_moves_linked_and_members_to_leaving() -> None:
    m = started(1)
    m.link(member("6+0", 1), 0.0)
    m.link(member("6+0", 2), 0.0)
    m.admit("6+0")
    m.link(member("6+0", 3), 1.0)  # linked but not yet admitted
    m.fail("6+0:1")
    left = m.leave("6+0")
    assert [x.member_id for x in left] == ["6+0:0", "6+0:2"]
    assert m.members["6+0:0"].state is MemberState.LEAVING
    assert m.members["6+0:2"].state is MemberState.LEAVING
    assert m.members["6+0:1"].state is MemberState.FAILED  # untouched
    assert m.leave("6+0") == []  # nobody live is left
    assert m.members["base:1"].state is MemberState.MEMBER  # other groups untouched
    assert m.live() == [m.members["base:1"]]


def test_fail_returns_the_member_once() -> None:
    m = started(2)
    assert m.fail("base:2") is m.members["base:2"]
    assert m.fail("base:2") is None
    assert m.fail("nobody") is None
    m.shrink()
    assert m.members["base:2"].state is MemberState.GONE
    assert m.fail("base:2") is None


# ------------------------------------------------------------------ shrink


def test_shrink_drops_leaving_and_failed_keeps_order_and_master() -> None:
    m = started(3)
    for g in ("10+0", "10+1"):
        m.link(member(g, 1), 0.0)
        m.link(member(g, 2), 0.0)
        m.admit(g)
    assert not m.needs_shrink()
    m.leave("10+0")
    m.fail("base:2")
    assert m.needs_shrink()

    survivors = m.shrink()
    assert survivors == [MASTER_ID, "base:1", "base:3", "10+1:0", "10+1:1"]
    assert m.universe == survivors
    assert survivors is not m.universe  # a copy
    assert m.rank_of(MASTER_ID) == 0
    assert m.rank_of("10+1:0") == 3
    assert m.members["base:2"].state is MemberState.GONE  # failed -> gone
    # leaving members are out of the universe; they become GONE when they are left
    assert m.members["10+0:0"].state is MemberState.LEAVING
    m.gone("10+0:0")
    assert m.members["10+0:0"].state is MemberState.GONE
    assert not m.needs_shrink()
    assert all(m.members[i].state is MemberState.MEMBER for i in m.universe[1:])


def test_shrink_drops_members_already_gone() -> None:
    m = started(2)
    m.gone("base:1")
    assert m.needs_shrink()
    assert m.shrink() == [MASTER_ID, "base:2"]


def test_failed_linked_member_not_in_universe_is_left_alone_by_shrink() -> None:
    m = started(1)
    m.link(member("11+0", 1), 0.0)
    m.fail("11+0:0")
    assert not m.needs_shrink()  # never in the universe
    assert m.shrink() == [MASTER_ID, "base:1"]
    assert m.members["11+0:0"].state is MemberState.FAILED


def test_shrink_with_nothing_stale_is_a_no_op() -> None:
    m = started(2)
    assert m.shrink() == [MASTER_ID, "base:1", "base:2"]
    m.fail("base:1")
    m.fail("base:2")
    assert m.shrink() == [MASTER_ID]  # the master always stays


# ------------------------------------------------------------------ colours


def test_colors_one_per_role_sorted_from_one_master_and_roleless_zero() -> None:
    m = started(4)
    m.link(member("1+0", 1), 0.0)
    m.admit("1+0")
    roles = {"base:1": "training", "base:2": "decode", "base:3": "prefill", "1+0:0": "decode"}
    colors = m.colors(roles)
    assert colors == {
        MASTER_ID: 0,
        "base:1": 3,  # decode=1, prefill=2, training=3
        "base:2": 1,
        "base:3": 2,
        "base:4": 0,  # no role: the control group
        "1+0:0": 1,
    }
    assert list(colors) == m.universe  # one entry per universe member, in rank order


def test_colors_do_not_depend_on_mapping_order() -> None:
    m = started(3)
    a = {"base:1": "b", "base:2": "a", "base:3": "c"}
    b = dict(reversed(list(a.items())))
    assert m.colors(a) == m.colors(b)
    assert m.colors({}) == {MASTER_ID: 0, "base:1": 0, "base:2": 0, "base:3": 0}


# ------------------------------------------------------------- illegal moves


def test_illegal_moves_raise() -> None:
    m = started(1)
    m.link(member("2+0", 1), 0.0)
    with pytest.raises(TransitionError, match="linked -> gone"):
        m.gone("2+0:0")  # LINKED -> GONE is not a move
    m.fail("2+0:0")
    assert m.members["2+0:0"].state is MemberState.FAILED
    m.gone("2+0:0")
    m.gone("2+0:0")  # already gone: a no-op
    assert m.members["2+0:0"].state is MemberState.GONE
    # a member passed in a non-linked state cannot be made a base member
    with pytest.raises(TransitionError):
        m.start_base([Member("base:9", "base", 9, state=MemberState.GONE)], 0.0)


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (MemberState.LINKED, MemberState.GONE),
        (MemberState.MEMBER, MemberState.LINKED),
        (MemberState.MEMBER, MemberState.MEMBER),
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


# ------------------------------------------------------------- property


OPS = st.lists(
    st.tuples(
        st.sampled_from(["link", "admit", "leave", "fail", "shrink"]),
        st.integers(min_value=0, max_value=2),  # group index
        st.integers(min_value=0, max_value=30),  # member pick / link rank
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(n_base=st.integers(min_value=0, max_value=3), ops=OPS)
def test_universe_invariants_under_any_operation_sequence(
    n_base: int, ops: list[tuple[str, int, int]]
) -> None:
    m = Membership(TIMEOUT)
    m.start_base(base_members(n_base), 0.0)
    ids = 0
    for op, g, pick in ops:
        group = f"{g}+0"
        if op == "link":
            m.link(Member(f"m{ids}", group, pick + 1), 0.0)
            ids += 1
        elif op == "admit":
            linked = [x for x in m.group(group) if x.state is MemberState.LINKED]
            if linked:
                before = list(m.universe)
                added = m.admit(group)
                want = [x.member_id for x in sorted(linked, key=lambda x: x.link_rank)]
                assert added == want
                assert m.universe == before + want
            else:
                with pytest.raises(TransitionError):
                    m.admit(group)
        elif op == "leave":
            m.leave(group)
        elif op == "fail":
            if m.members:
                m.fail(sorted(m.members)[pick % len(m.members)])
        else:
            before = [i for i in m.universe if i == MASTER_ID or not m._stale(i)]
            assert m.shrink() == before
            assert all(m.members[i].state is MemberState.MEMBER for i in m.universe[1:])
            assert not m.needs_shrink()

        assert m.universe[0] == MASTER_ID
        assert len(set(m.universe)) == len(m.universe)
        assert MASTER_ID not in m.universe[1:]
        assert all(m.members[i].state is not MemberState.LINKED for i in m.universe[1:])

    m.shrink()
    assert m.universe[0] == MASTER_ID
    assert len(set(m.universe)) == len(m.universe)
    assert all(m.members[i].state is MemberState.MEMBER for i in m.universe[1:])
    # every MEMBER is in the universe, exactly once
    assert sorted(m.universe[1:]) == sorted(
        i for i, x in m.members.items() if x.state is MemberState.MEMBER
    )
