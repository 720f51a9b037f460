"""Control-plane messages: frozen records that survive pickling (what mpi4py does)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pearl_hpc.comm.messages import (
    COLLECTIVE,
    TAG_COMMAND,
    TAG_REPORT,
    Command,
    Kind,
    Op,
    Report,
)


def test_command_is_frozen() -> None:
    cmd = Command(Op.ROLE, 3, {"slot": 1, "role": "decode"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cmd.seq = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cmd.op = Op.TRAIN  # type: ignore[misc]


def test_report_is_frozen() -> None:
    rep = Report(Kind.ACK, "base:1", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.member_id = "base:2"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.kind = Kind.ERROR  # type: ignore[misc]


def test_defaults() -> None:
    assert Command(Op.SHUTDOWN, 0).args == {}
    rep = Report(Kind.HEARTBEAT, "12+1:0")
    assert rep.seq == -1
    assert rep.args == {}
    # default args are not shared between instances
    assert Command(Op.LEAVE, 1).args is not Command(Op.LEAVE, 2).args
    assert Report(Kind.HELLO, "a").args is not Report(Kind.HELLO, "b").args


@pytest.mark.parametrize("op", list(Op))
def test_command_pickle_round_trip(op: Op) -> None:
    cmd = Command(op, 42, {"slot": 2, "members": ["master", "base:1"], "colors": {"x": 1}})
    back = pickle.loads(pickle.dumps(cmd))
    assert back == cmd
    assert back is not cmd
    assert type(back) is Command
    assert back.op is op  # the enum member, not a bare string
    assert isinstance(back.op, Op)


@pytest.mark.parametrize("kind", list(Kind))
def test_report_pickle_round_trip(kind: Kind) -> None:
    rep = Report(kind, "123+1:0", 7, {"op": Op.ADMIT, "seconds": 0.25, "gpu_ids": ("g0", "g1")})
    back = pickle.loads(pickle.dumps(rep, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == rep
    assert type(back) is Report
    assert back.kind is kind
    assert back.args["op"] is Op.ADMIT


def test_collective_is_exactly_admit_shrink_partition() -> None:
    assert isinstance(COLLECTIVE, frozenset)
    assert {Op.ADMIT, Op.SHRINK, Op.PARTITION} == COLLECTIVE
    assert {str(op) for op in COLLECTIVE} == {"admit", "shrink", "partition"}
    point_to_point = set(Op) - COLLECTIVE
    assert point_to_point == {
        Op.ROLE, Op.DRAIN, Op.RELEASE, Op.TRAIN, Op.PUBLISH, Op.CATCH_UP, Op.LEAVE, Op.SHUTDOWN,
        Op.PREPARE,
    }  # fmt: skip


def test_ops_and_kinds_are_their_wire_strings() -> None:
    assert Op("admit") is Op.ADMIT
    assert Kind("heartbeat") is Kind.HEARTBEAT
    assert Op.PARTITION == "partition"
    assert TAG_COMMAND != TAG_REPORT
