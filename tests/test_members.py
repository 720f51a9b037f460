"""The master's members (comm/members.py) over a scripted plane: the one failure funnel
fails a member's pending calls at once and frees its link; what the pump reports
(undelivered command, MPI error on a link, dropped connection) reaches the funnel or the
log; the partition is logged when it changes. The real plane is in test_mpi_plane.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pearl_hpc.comm.members import Members
from pearl_hpc.comm.messages import Hello, Release, ReleaseAck, Report, encode
from pearl_hpc.comm.mpi import (
    Arrival,
    Dropped,
    Joined,
    LinkFailed,
    PlaneError,
    Received,
    Undelivered,
)


class ScriptedPlane:
    """What Members needs of MasterPlane: sends recorded, arrivals scripted."""

    send_timeout_s = 30.0

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Any]] = []
        self.arrivals: list[Arrival] = []
        self.closed: list[tuple[str, bool]] = []
        self.seq = 0

    def send(self, group: str, rank: int, body: Any) -> int:
        self.seq += 1
        self.sent.append((group, rank, body))
        return self.seq

    def take(self) -> list[Arrival]:
        out, self.arrivals = self.arrivals, []
        return out

    def close_link(self, group: str, *, left: bool) -> None:
        self.closed.append((group, left))

    def deaf_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


def hello(member_id: str, rank: int, group: str = "") -> Report:
    return Report(member_id, -1, Hello("engine", "n0", 100 + rank, rank=rank, group=group))


def started() -> tuple[Members, ScriptedPlane, list[tuple[str, dict[str, Any]]]]:
    plane = ScriptedPlane()
    events: list[tuple[str, dict[str, Any]]] = []
    failed: list[str] = []
    members = Members(
        plane,  # type: ignore[arg-type]
        lambda kind, **f: events.append((kind, f)),
        on_failed=lambda m: failed.append(m.member_id),
    )
    plane.arrivals = [Joined("base", {1: hello("base:1", 1), 2: hello("base:2", 2)}, 0.1)]
    members.start(since_s=0.0)
    plane.arrivals = [Joined("el1+0", {1: hello("el1+0:0", -1, "el1+0")}, 0.02)]
    members.poll()
    return members, plane, events


def kinds(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [k for k, _ in events]


def test_a_failed_member_fails_its_pending_calls_at_once_and_its_link_goes() -> None:
    async def scenario() -> None:
        members, plane, events = started()
        call = asyncio.ensure_future(members.call("el1+0:0", Release(), ReleaseAck))
        other = asyncio.ensure_future(members.call("base:1", Release(), ReleaseAck))
        await asyncio.sleep(0)
        assert plane.sent[-2][:2] == ("el1+0", 1)  # the joiner's link rank
        plane.arrivals = [Undelivered("el1+0", 1)]
        members.poll()
        with pytest.raises(PlaneError, match="el1\\+0:0 failed: a command was not delivered"):
            await call
        assert not other.done()  # the others' calls wait on
        assert plane.closed == [("el1+0", False)]  # freed, not disconnected
        assert members.of_kind("engine") == ["base:1", "base:2"]
        with pytest.raises(PlaneError, match="is failed"):
            await members.call("el1+0:0", Release(), ReleaseAck)
        ack = Report("base:1", 2, ReleaseAck())  # the second call's seq
        plane.arrivals = [Received("base", 1, encode(ack))]
        members.poll()
        assert isinstance(await other, ReleaseAck)
        failed = [f for k, f in events if k == "member_failed"]
        assert [f["member"] for f in failed] == ["el1+0:0"]

    asyncio.run(scenario())


def test_an_mpi_error_on_a_link_fails_every_member_of_it() -> None:
    members, plane, events = started()
    plane.arrivals = [LinkFailed("el1+0", "connection reset")]
    members.poll()
    assert [f["member"] for k, f in events if k == "member_failed"] == ["el1+0:0"]
    plane.arrivals = [Dropped("a hello not signed by the run's key (x:0)", "el5+0")]
    members.poll()
    assert events[-1] == (
        "connection_dropped",
        {"reason": "a hello not signed by the run's key (x:0)", "group": "el5+0"},
    )


def test_a_report_is_taken_only_from_the_senders_own_link_and_rank() -> None:
    async def scenario() -> None:
        members, plane, _ = started()
        call = asyncio.ensure_future(members.call("base:2", Release(), ReleaseAck))
        await asyncio.sleep(0)
        forged = encode(Report("base:2", plane.seq, ReleaseAck()))
        plane.arrivals = [Received("el1+0", 1, forged), Received("base", 1, forged)]
        members.poll()
        assert not call.done()  # one speaks for itself only
        plane.arrivals = [Received("base", 2, forged)]
        members.poll()
        assert isinstance(await call, ReleaseAck)

    asyncio.run(scenario())


def test_the_partition_is_logged_when_it_changes() -> None:
    roles = {"base:1": "prefill", "base:2": "decode"}
    members, _, events = started()
    members.roles = lambda: roles
    members.partition()
    members.partition()  # unchanged: not logged again
    roles["el1+0:0"] = "decode"
    members.partition()
    parts = [f for k, f in events if k == "partition"]
    assert parts == [
        {"epoch": 1, "groups": {"decode": ["base:2"], "prefill": ["base:1"]}},
        {"epoch": 2, "groups": {"decode": ["base:2", "el1+0:0"], "prefill": ["base:1"]}},
    ]
