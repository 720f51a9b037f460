"""The ranks of tests/test_mpi_plane.py: a real MPI world of a master (rank 0, the
product's MasterPlane + Members on an asyncio loop, with its doorman) and two base
members, plus elastic members and strangers, each launched as its own ``mpiexec.gforker -n 1``.

    mpiexec.gforker -n 3 python -m tests.mpi_plane_ranks RUN_DIR world   (the world)
    mpiexec.gforker -n 1 python -m tests.mpi_plane_ranks RUN_DIR join GROUP   (a joiner)
    mpiexec.gforker -n 1 python -m tests.mpi_plane_ranks RUN_DIR pickle GROUP (a joiner
        whose first message is a pickle that would write RUN_DIR/owned)
    mpiexec.gforker -n 1 python -m tests.mpi_plane_ranks RUN_DIR forged GROUP (a hello
        signed with another key)
    mpiexec.gforker -n 1 python -m tests.mpi_plane_ranks RUN_DIR mute GROUP (dies once
        accepted, before its hello)

The master writes RUN_DIR/result.json: the longest its loop went without a turn, what
each fault cost, and its events.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pearl_hpc.bench.plane import loop_gaps, protocol_member
from pearl_hpc.comm.doorman import Doorman
from pearl_hpc.comm.mpiexec import gforker_path, one_node
from pearl_hpc.rundir import RunDir

KEY = "ab" * 32
HEARTBEAT_TIMEOUT_S = 4.0
SEND_TIMEOUT_S = 2.0


class Owned:
    """Unpickling this writes a file: the proof that a pickle was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.path), "owned"))


def stranger(run_dir: Path, group: str, how: str) -> int:
    """Announce ``group`` like a joiner, take the go, connect; then send a pickle, a
    hello proven with the wrong key, or die before any hello (``mute``)."""
    from mpi4py import MPI

    from pearl_hpc.comm.messages import TAG_REPORT
    from pearl_hpc.comm.mpi import WorkerPlane, member_info

    plane = WorkerPlane.join(run_dir, group, "cd" * 32, timeout_s=60)
    if how == "mute":
        os._exit(0)  # accepted, then gone without a word
    if how == "pickle":
        data = pickle.dumps(Owned(str(run_dir / "owned")))
        plane.link.Send([data, MPI.BYTE], dest=0, tag=TAG_REPORT)
    else:
        plane.report(member_info("engine", group=group))
    time.sleep(5)  # the master frees its side; MPI_Finalize would wait for it
    os._exit(0)


def launch(run_dir: Path, *args: str) -> subprocess.Popen[bytes]:
    from pearl_hpc.slurm.client import FORK_LOCK

    with FORK_LOCK:  # as the local backend launches its elastic ranks
        return subprocess.Popen(
            [*one_node(1), sys.executable, "-m", "tests.mpi_plane_ranks", str(run_dir), *args]
        )  # fmt: skip


async def spawn(run_dir: Path, *args: str) -> subprocess.Popen[bytes]:
    """A launch off the loop: it waits for the fork lock while the pump accepts."""
    return await asyncio.to_thread(launch, run_dir, *args)


async def until(what: str, cond: Any, timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def master(run_dir: Path, doorman: Doorman) -> None:
    from pearl_hpc.comm.members import Members
    from pearl_hpc.comm.messages import Train, TrainAck
    from pearl_hpc.comm.mpi import MasterPlane, PlaneError
    from pearl_hpc.master.records import EventLog
    from pearl_hpc.rundir import read_jsonl

    plane = MasterPlane(
        run_dir, KEY, doorman=doorman, hello_timeout_s=5.0, send_timeout_s=SEND_TIMEOUT_S
    )
    events = EventLog(run_dir / "events.jsonl", time.monotonic)
    roles = {"base:1": "prefill", "base:2": "decode"}
    members = Members(plane, events, roles=lambda: roles, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    members.start(since_s=time.monotonic())
    stop = asyncio.Event()
    poll = asyncio.create_task(members.poll_forever(stop))
    gaps: list[float] = []
    result: dict[str, Any] = {}

    def kinds(kind: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]

    beating = asyncio.create_task(loop_gaps(stop, gaps, 0.01))  # the loop's turns
    members.partition()
    # 1. an elastic member joins (signed hello), takes a role, leaves
    joiner = await spawn(run_dir, "join", "el1+0")
    await until("el1+0 joined", lambda: "el1+0:0" in members.of_kind("engine"), 120)
    roles["el1+0:0"] = "decode"
    members.partition()
    del roles["el1+0:0"]
    members.leave("el1+0")
    await until("el1+0 gone", lambda: members.left("el1+0"))
    members.partition()
    await asyncio.to_thread(joiner.wait, 30)  # off the loop (gforker takes ~1 s to end)
    # 2. an announcer that never connects (it died before Connect): the doorman frees
    #    each Accept, the join is abandoned; the loop never stops turning
    RunDir(run_dir).join_note("el9+0").write_text(json.dumps({"group": "el9+0"}))
    result["abandoned_s"] = await until("el9+0 abandoned", lambda: kinds("join_abandoned"), 120)
    # 3. strangers: a pickle as the first message, a hello signed with another key; a
    #    joiner that dies once accepted, before its hello
    for how, group in (("pickle", "el7+0"), ("forged", "el8+0"), ("mute", "el6+0")):
        proc = await spawn(run_dir, how, group)
        await until(f"{group} dropped", lambda g=group: any(  # type: ignore[misc]
            e["group"] == g for e in kinds("connection_dropped")), 120)  # fmt: skip
        proc.kill()
    # 4. an elastic member SIGKILLed with a command of 1 MiB on its way (rendezvous): the
    #    command is undelivered, the member failed, the call waiting for it fails
    killed = await spawn(run_dir, "join", "el2+0")
    await until("el2+0 joined", lambda: "el2+0:0" in members.of_kind("engine"), 120)
    pid = members.hellos["el2+0:0"].pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        await members.call("el2+0:0", Train(0, b"x" * (1 << 20)), TrainAck)
        result["call_error"] = ""
    except PlaneError as exc:
        result["call_error"] = str(exc)
    result["killed_call_s"] = time.monotonic() - t0
    await asyncio.to_thread(killed.wait, 30)
    # 5. an elastic member SIGSTOPped (a silent node): the heartbeat timeout fails it
    stopped = await spawn(run_dir, "join", "el3+0")
    await until("el3+0 joined", lambda: "el3+0:0" in members.of_kind("engine"), 120)
    pid = members.hellos["el3+0:0"].pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    await until("el3+0 failed", lambda: "el3+0:0" not in members.of_kind("engine"), 60)
    result["stopped_detect_s"] = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(stopped.wait, 30)
    # 6. a component given back before its rank joins: sent away once it does
    members.leave("el4+0")
    late = await spawn(run_dir, "join", "el4+0")
    await until("el4+0 sent away", lambda: members.left("el4+0"), 120)
    await asyncio.to_thread(late.wait, 30)
    members.partition()
    stop.set()
    await poll
    await beating
    members.shutdown()
    result["loop_gap_s"] = max(gaps)
    result["accept_s"] = plane.timings.accept_s
    result["events"] = read_jsonl(run_dir / "events.jsonl")
    (run_dir / "result.json").write_text(json.dumps(result))


def main() -> int:
    run_dir = Path(sys.argv[1])
    what = sys.argv[2]
    if what in ("pickle", "forged", "mute"):
        return stranger(run_dir, sys.argv[3], what)
    if what == "join":
        from pearl_hpc.comm.mpi import WorkerPlane

        plane = WorkerPlane.join(run_dir, sys.argv[3], KEY, heartbeat_interval_s=0.5, timeout_s=60)
        return protocol_member(plane)
    doorman = None
    if os.environ.get("PMI_RANK") == "0":
        doorman = Doorman(RunDir(run_dir).mpi_port, gforker_path())  # before MPI_Init
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        assert doorman is not None
        asyncio.run(master(run_dir, doorman))
        doorman.close()
        return 0
    from pearl_hpc.comm.mpi import WorkerPlane

    return protocol_member(WorkerPlane.base(heartbeat_interval_s=0.5))


if __name__ == "__main__":
    sys.exit(main())
