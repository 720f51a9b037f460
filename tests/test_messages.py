"""Control-plane messages: typed records, msgpack on the wire, never pickled; what does not
decode into them is refused."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from pearl_hpc.comm.messages import (
    TAG_COMMAND,
    TAG_REPORT,
    Ack,
    CatchUp,
    CatchUpAck,
    Command,
    Failed,
    Heartbeat,
    Hello,
    Leave,
    Move,
    Op,
    Publish,
    PublishAck,
    Release,
    ReleaseAck,
    Report,
    Save,
    SaveAck,
    Shutdown,
    Train,
    TrainAck,
    decode_command,
    decode_report,
    encode,
)
from pearl_hpc.rollout.types import Segment, Trajectory, TurnStats

COMMANDS = [
    Release(),
    Train(3, b"\x90"),
    Train(5, b"\x90", checkpoint=True, export=True),
    Save(),
    Publish(4, {"g0": ("10.0.0.1", 5000)}),
    CatchUp("g1", "10.0.0.2", 5001),
    Leave(),
    Shutdown(),
]
REPORTS = [
    Hello("engine", "n1", 99, gpu_ids=("rsv:0",), host="10.0.0.1", port=5000),
    Heartbeat(),
    Ack(Op.LEAVE),
    Hello("engine", "n2", 98, group="123+1", proof=b"\x01" * 32),
    TrainAck(3, 4, 0.5, 1, 0.1, 900, 2.0, onload=Move("onload", 0.3, 1, 9)),
    TrainAck(5, 6, 0.5, 1, 0.1, 900, 2.0, checkpoint_s=0.3, saved=[3]),
    SaveAck(6, 1.5),
    ReleaseAck(Move("offload", 1.5, 9, 1)),
    ReleaseAck(),
    PublishAck(4, 0.2, 0.0, 2, 1, ["g1"]),
    CatchUpAck(0.1),
    Failed("trainer: boom"),
]


@pytest.mark.parametrize("body", COMMANDS, ids=lambda b: type(b).__name__)
def test_every_command_round_trips_as_its_own_type(body: object) -> None:
    back = decode_command(encode(Command(42, body)))  # type: ignore[arg-type]
    assert back == Command(42, body) and type(back.body) is type(body)  # type: ignore[arg-type]
    assert back.op is Op(str(type(body).__struct_config__.tag))  # type: ignore[attr-defined]


@pytest.mark.parametrize("body", REPORTS, ids=lambda b: type(b).__name__)
def test_every_report_round_trips_as_its_own_type(body: object) -> None:
    back = decode_report(encode(Report("123+1:0", 7, body)))  # type: ignore[arg-type]
    assert back == Report("123+1:0", 7, body) and type(back.body) is type(body)  # type: ignore[arg-type]


def test_the_wire_is_msgpack_not_pickle() -> None:
    """A pickle (what an attacker joining the plane would send to run code) is refused,
    and so is a record of the wrong shape: decoding never runs anything."""
    evil = pickle.dumps(Command(1, Leave()))
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_command(evil)
    wrong = msgspec.msgpack.encode({"seq": 1, "body": {"type": "train", "step": "x"}})
    with pytest.raises(msgspec.ValidationError, match="step"):
        decode_command(wrong)
    unknown = msgspec.msgpack.encode({"seq": 1, "body": {"type": "role", "role": "decode"}})
    with pytest.raises(msgspec.ValidationError):
        decode_command(unknown)
    with pytest.raises(msgspec.ValidationError):
        decode_report(msgspec.msgpack.encode({"member_id": "a", "seq": 1, "body": {"type": "x"}}))


def test_a_train_batch_travels_as_trajectories() -> None:
    """The TRAIN batch is the trajectories themselves, encoded once by the master and
    decoded by the trainer with rollout's own type."""
    traj = Trajectory(
        "t0",
        "g0",
        [Segment((1, 2), False), Segment((3,), True, (-0.5,), 2)],
        reward=1.0,
        done=True,
        weight_versions={2},
        turns=[TurnStats(0, 2, 1, 3, 0.1, ("s1",))],
        info={"correct": True},
    )
    cmd = decode_command(encode(Command(1, Train(5, msgspec.msgpack.encode([traj])))))
    assert isinstance(cmd.body, Train)
    assert msgspec.msgpack.decode(cmd.body.trajectories, type=list[Trajectory]) == [traj]


def test_one_body_per_op() -> None:
    assert {op.value for op in Op} == {
        str(type(b).__struct_config__.tag) for b in COMMANDS  # type: ignore[attr-defined]
    }  # one body per op, no op without one
    assert TAG_COMMAND != TAG_REPORT


def test_a_move_is_logged_under_its_direction() -> None:
    assert Move("offload", 1.23456, 1, 9).fields() == {
        "offload_s": 1.2346, "offload_free_before": 1, "offload_free_after": 9,
    }  # fmt: skip
