"""The ranks of tests/test_mpi_plane.py: a real MPI world of a master (rank 0, the
product's MasterPlane + Members on an asyncio loop) and two base members, plus one
elastic member launched as its own ``mpiexec -n 1`` that joins with Connect + Merge.

    mpiexec -n 3 python -m tests.mpi_plane_ranks RUN_DIR SLOW_S     (the world)
    mpiexec -n 1 python -m tests.mpi_plane_ranks RUN_DIR join [GROUP]  (a joiner)
    mpiexec -n 3 python -m tests.mpi_plane_ranks RUN_DIR SLOW_S hung (a split timing out)

Base member 2 sleeps SLOW_S seconds after each PARTITION before entering it (a process
busy elsewhere). The master writes RUN_DIR/result.json: the longest its loop went
without a turn while the members split, and its events.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from mpi4py import MPI

from pearl_hpc.comm.members import Members
from pearl_hpc.comm.messages import COLLECTIVE, Ack, Op
from pearl_hpc.comm.mpi import MasterPlane, PlaneError, WorkerPlane, member_info
from pearl_hpc.comm.mpiexec import mpiexec_path
from pearl_hpc.master.records import EventLog, read_jsonl
from pearl_hpc.slurm.client import FORK_LOCK


def member(plane: WorkerPlane, slow_s: float) -> int:
    """A member's control loop: collectives, LEAVE, SHUTDOWN."""
    plane.report(member_info("engine"))
    while True:
        cmd = plane.next_command(0.02)
        if cmd is None:
            continue
        if cmd.op in COLLECTIVE:
            if cmd.op is Op.PARTITION:
                time.sleep(slow_s)
            plane.report(plane.take_part(cmd), cmd.seq)
        elif cmd.op in (Op.LEAVE, Op.SHUTDOWN):
            plane.report(Ack(cmd.op), cmd.seq)
            if cmd.op is Op.LEAVE:
                plane.disconnect()
            return 0


async def until(what: str, cond, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


async def hung(run_dir: Path) -> None:
    """A split that a member does not finish in time fails the poll (the run), with
    the loop serving until then."""
    plane = MasterPlane(run_dir, heartbeat_timeout_s=10.0, hello_timeout_s=60.0, fresh_s=3.0)
    members = Members(
        plane,
        EventLog(run_dir / "events.jsonl", time.monotonic),
        roles=lambda: {"base:1": "prefill", "base:2": "decode"},
        split_timeout_s=2.0,
    )
    members.start(since_s=time.monotonic())
    stop = asyncio.Event()
    poll = asyncio.create_task(members.poll_forever(stop))
    members.split()
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(poll, 30)
        error = ""
    except PlaneError as exc:
        error = str(exc)
    result = {"error": error, "after_s": time.monotonic() - t0}
    (run_dir / "result.json").write_text(json.dumps(result))
    MPI.COMM_WORLD.Abort(0)  # the members are inside the split: nothing else ends them


async def master(run_dir: Path) -> None:
    plane = MasterPlane(run_dir, heartbeat_timeout_s=10.0, hello_timeout_s=60.0, fresh_s=3.0)
    events = EventLog(run_dir / "events.jsonl", time.monotonic)
    roles = {"base:1": "prefill", "base:2": "decode"}
    members = Members(plane, events, roles=lambda: roles)
    members.start(since_s=time.monotonic())
    stop = asyncio.Event()
    poll = asyncio.create_task(members.poll_forever(stop))
    gaps: list[float] = []

    async def beat() -> None:  # how long the loop goes without a turn
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beating = asyncio.create_task(beat())

    def splits() -> int:
        return sum(1 for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "split")

    members.split()  # base members only: member 2 is slow to enter
    await until("the first split", lambda: splits() == 1)
    loop_gap_s = max(gaps)
    with FORK_LOCK:  # an elastic member, launched like the local backend's
        joiner = subprocess.Popen(
            [mpiexec_path(), "-launcher", "fork", "-hosts", "localhost", "-n", "1",
             sys.executable, "-m", "tests.mpi_plane_ranks", str(run_dir), "join"]
        )  # fmt: skip
    await until("the joiner admitted", lambda: bool(members.of_kind("engine")[2:]), 120)
    (joined,) = members.of_kind("engine")[2:]
    roles[joined] = "decode"
    members.split()
    await until("the split with the joiner", lambda: splits() == 2)
    del roles[joined]
    members.leave(joined.split(":")[0])
    await until("the joiner gone", lambda: members.left(joined.split(":")[0]))
    members.split()  # the universe shrinks first, then the survivors split
    await until("the split after it left", lambda: splits() == 3)
    # a component given back before its rank joins (reclaimed while starting): the rank
    # that joins afterwards is sent away, never admitted
    members.leave("el2+0")
    with FORK_LOCK:
        late = subprocess.Popen(
            [mpiexec_path(), "-launcher", "fork", "-hosts", "localhost", "-n", "1",
             sys.executable, "-m", "tests.mpi_plane_ranks", str(run_dir), "join", "el2+0"]
        )  # fmt: skip

    def joined_late() -> bool:
        events = read_jsonl(run_dir / "events.jsonl")
        return any(e["kind"] == "joined" and e["group"] == "el2+0" for e in events)

    await until("the late joiner", joined_late, 120)
    await until("the late joiner sent away", lambda: members.left("el2+0"), 60)
    late.wait(30)
    stop.set()
    await poll
    await beating
    members.shutdown()
    joiner.wait(30)
    result = {"loop_gap_s": loop_gap_s, "events": read_jsonl(run_dir / "events.jsonl")}
    (run_dir / "result.json").write_text(json.dumps(result))


def main() -> int:
    run_dir = Path(sys.argv[1])
    if sys.argv[2] == "join":
        group = sys.argv[3] if len(sys.argv) > 3 else "el1+0"
        plane = WorkerPlane.join(run_dir, group, heartbeat_interval_s=0.5, timeout_s=60)
        return member(plane, 0.0)
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        asyncio.run(hung(run_dir) if len(sys.argv) > 3 else master(run_dir))
        return 0
    slow_s = float(sys.argv[2]) if rank == 2 else 0.0
    return member(WorkerPlane.base(heartbeat_interval_s=0.5), slow_s)


if __name__ == "__main__":
    sys.exit(main())
