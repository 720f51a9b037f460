"""The control plane at scale: what the master's loop pays per plan and per join, and a
burst of joiners.

For each world of ``--ranks`` protocol-only ranks (``mpiexec.gforker -n N``; rank 0 the master,
the product's ``MasterPlane`` + ``Members`` with its doorman, the others answering
commands, no engines):

- start: the master's plane and members started -> every base rank's hello;
- per plan: the loop's time in ``Members.partition()`` after a role change of every
  member, and a command fanned out to every member -> every ack (the loop serves
  meanwhile);
- a burst of ``--joiners`` elastic components (one ``mpiexec.gforker -n 1`` each, all launched
  at once): go -> proven hellos per join, the pump's time in ``Accept`` per join, the
  whole burst, and the longest the master's loop went without a turn;
- ``--cycles N`` (at the first size): one joiner joins N times in a row, each join
  ended alternately by LEAVE (both sides Disconnect) and by the master declaring it
  failed (the master frees its side, as for a dead rank); the master's free
  communicators (MPICH's context ids: ``Dup`` until it refuses), open files, threads and
  CPU while idle are read before and after, with the time per cycle.

Run: ``pearl-hpc bench --plane`` (or ``python -m pearl_hpc.bench.plane``); ranks share
this machine's cores, so the figures are upper bounds for dedicated nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.bench import record

KEY = "5e" * 32  # a key of the benchmark's own (written 0600 as the run's would be)
PLANS = 20


def protocol_member(plane: Any) -> int:
    """A member that runs the protocol only: hello, heartbeats, RELEASE acked, LEAVE and
    SHUTDOWN; anything else answered Failed."""
    from pearl_hpc.comm.messages import Ack, Failed, Op, Release, ReleaseAck
    from pearl_hpc.comm.mpi import member_info

    group = plane.member_id.split(":")[0] if plane.elastic else ""
    plane.report(member_info("engine", group=group))
    while True:
        cmd = plane.next_command(0.05)
        if cmd is None:
            continue
        if isinstance(cmd.body, Release):
            plane.report(ReleaseAck(), cmd.seq)
        elif cmd.op in (Op.LEAVE, Op.SHUTDOWN):
            plane.report(Ack(cmd.op), cmd.seq)
            if cmd.op is Op.LEAVE:
                plane.disconnect()
            return 0
        else:
            plane.report(Failed(f"bench member: {cmd.op}"), cmd.seq)


async def loop_gaps(stop: asyncio.Event, gaps: list[float], period_s: float = 0.005) -> None:
    """Until ``stop``: append how long the loop went between turns of this task (each
    turn asks to wake ``period_s`` later)."""
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(period_s)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


def free_communicators() -> int:
    """How many more communicators this process can make (MPICH: 2,046 at most)."""
    from mpi4py import MPI

    made: list[Any] = []
    try:
        while len(made) < 1 << 16:
            made.append(MPI.COMM_SELF.Dup())
    except MPI.Exception:
        pass
    for comm in made:
        comm.Free()
    return len(made)


async def _resources() -> dict[str, float]:
    """The master process's free communicators, open files, threads and CPU share over
    1 s of its loop idling."""
    cpu = time.process_time()
    await asyncio.sleep(1.0)
    share = time.process_time() - cpu
    return {
        "free_comms": free_communicators(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "idle_cpu": round(share, 3),
    }


async def _cycles(run_dir: Path, members: Any, cycles: int, gaps: list[float]) -> dict[str, Any]:
    """``cycles`` joins of one joiner, each ended by LEAVE or by a failure in turn."""
    before = await _resources()
    gaps.clear()
    (run_dir / "cycle").write_text("")  # the launcher starts the cycling joiner
    (run_dir / "failed").mkdir()
    t0 = time.monotonic()
    for k in range(cycles):
        group = f"c{k}+0"
        deadline = time.monotonic() + 120
        while f"{group}:0" not in members.of_kind("engine"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench --plane: cycle {k}: {group} never joined")
            await asyncio.sleep(0.001)
        if k % 2 == 0:
            members.leave(group)
            while not members.left(group):
                await asyncio.sleep(0.001)
        else:
            members.fail(f"{group}:0", "a cycle of the benchmark")
            (run_dir / "failed" / group).write_text("")  # (the joiner frees its side)
    seconds = time.monotonic() - t0
    gap = max(gaps, default=0.0)
    await asyncio.sleep(0.5)  # the last link freed by the pump
    after = await _resources()
    out: dict[str, Any] = {"cycles": cycles, "cycle_ms": 1e3 * seconds / max(1, cycles)}
    out["cycles_gap_ms"] = 1e3 * gap
    out.update({f"{k}_before": v for k, v in before.items()})
    out.update({f"{k}_after": v for k, v in after.items()})
    return out


async def _master(run_dir: Path, doorman: Any, joiners: int, cycles: int) -> dict[str, Any]:
    from pearl_hpc.comm.members import Members
    from pearl_hpc.comm.messages import Release, ReleaseAck
    from pearl_hpc.comm.mpi import MasterPlane
    from pearl_hpc.master.records import EventLog
    from pearl_hpc.rundir import read_jsonl

    t0 = time.monotonic()
    plane = MasterPlane(run_dir, KEY, doorman=doorman)
    roles: dict[str, str] = {}
    members = Members(
        plane, EventLog(run_dir / "events.jsonl", time.monotonic), roles=lambda: roles
    )
    members.start(since_s=t0)
    out: dict[str, Any] = {
        "ranks": 1 + len(members.of_kind("engine")),
        "start_s": time.monotonic() - t0,
    }
    stop = asyncio.Event()
    polls: list[float] = []  # each poll's CPU seconds: the master's own work per turn
    untimed = members.poll

    def timed_poll() -> None:
        t = time.thread_time()
        untimed()
        polls.append(time.thread_time() - t)

    members.poll = timed_poll  # type: ignore[method-assign]
    poll = asyncio.create_task(members.poll_forever(stop))
    gaps: list[float] = []
    beating = asyncio.create_task(loop_gaps(stop, gaps))
    partition_s, fanout_s = [], []
    ids = members.of_kind("engine")
    for k in range(PLANS):
        roles.update({m: ("prefill", "decode")[(i + k) % 2] for i, m in enumerate(ids)})
        t = time.perf_counter()
        members.partition()
        partition_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        await asyncio.gather(*[members.call(m, Release(), ReleaseAck) for m in ids])
        fanout_s.append(time.perf_counter() - t)
    out["partition_ms"] = 1e3 * statistics.median(partition_s)
    out["fanout_ms"] = 1e3 * statistics.median(fanout_s)
    out["plan_gap_ms"] = 1e3 * max(gaps)
    if joiners:
        gaps.clear()
        polls.clear()
        (run_dir / "burst").write_text("")  # the launcher starts the joiners
        t = time.monotonic()
        deadline = t + 60 + 2.0 * joiners
        while len(members.of_kind("engine")) < len(ids) + joiners:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        out["burst_s"] = time.monotonic() - t
        out["joined"] = len(members.of_kind("engine")) - len(ids)
        events = read_jsonl(run_dir / "events.jsonl")
        joins = [e["s"] for e in events if e["kind"] == "joined"]
        out["join_ms"] = 1e3 * statistics.median(joins) if joins else None
        out["accept_ms"] = 1e3 * statistics.median(plane.timings.accept_s or [0.0])
        out["burst_gap_ms"] = 1e3 * max(gaps)
        out["burst_poll_ms"] = 1e3 * max(polls)
        for group in sorted({m.split(":")[0] for m in members.of_kind("engine")} - {"base"}):
            members.leave(group)
        await asyncio.sleep(0)
    if cycles:
        out.update(await _cycles(run_dir, members, cycles, gaps))
    stop.set()
    await poll
    await beating
    members.leave_all()
    members.shutdown()
    return out


def _rank(run_dir: Path, joiners: int, cycles: int) -> int:
    from pearl_hpc.comm.doorman import Doorman
    from pearl_hpc.comm.mpiexec import gforker_path
    from pearl_hpc.rundir import RunDir

    doorman = None
    if os.environ.get("PMI_RANK") == "0":
        doorman = Doorman(RunDir(run_dir).mpi_port, gforker_path())  # before MPI_Init
    from mpi4py import MPI

    from pearl_hpc.comm.mpi import WorkerPlane

    if MPI.COMM_WORLD.Get_rank() != 0:
        return protocol_member(WorkerPlane.base(heartbeat_interval_s=1.0))
    out = asyncio.run(_master(run_dir, doorman, joiners, cycles))
    (run_dir / "result.json").write_text(json.dumps(out))
    if doorman is not None:
        doorman.close()
    return 0


def _join(run_dir: Path, group: str) -> int:
    from pearl_hpc.comm.mpi import WorkerPlane

    return protocol_member(WorkerPlane.join(run_dir, group, KEY, timeout_s=600))


def _cycle(run_dir: Path, cycles: int) -> int:
    """Join ``cycles`` times; each join ends with LEAVE (Disconnect) or, once the master
    has declared it failed, by freeing this side of the link."""
    from pearl_hpc.comm.messages import Ack, Op
    from pearl_hpc.comm.mpi import WorkerPlane, member_info

    for k in range(cycles):
        group = f"c{k}+0"
        plane = WorkerPlane.join(run_dir, group, KEY, timeout_s=120)
        plane.report(member_info("engine", group=group))
        failed = run_dir / "failed" / group
        while not failed.exists():
            cmd = plane.next_command(0.001)
            if cmd is not None and cmd.op is Op.LEAVE:
                plane.report(Ack(cmd.op), cmd.seq)
                plane.disconnect()
                break
        else:
            plane.link.Free()
    return 0


def _launch(argv: list[str], *, errors: bool = False) -> subprocess.Popen[bytes]:
    quiet = subprocess.DEVNULL
    err = subprocess.PIPE if errors else quiet
    return subprocess.Popen(argv, stdin=quiet, stdout=quiet, stderr=err)


def measure(ranks: int, joiners: int, cycles: int = 0) -> dict[str, Any]:
    """One world of ``ranks`` ranks, a burst of ``joiners`` joiners, then ``cycles``
    join / leave-or-fail cycles."""
    from pearl_hpc.comm.mpiexec import gforker_path, one_node

    gforker = gforker_path()
    me = [sys.executable, "-m", "pearl_hpc.bench.plane"]
    with tempfile.TemporaryDirectory(prefix="pearl-plane-") as tmp:
        run_dir = Path(tmp)
        argv = [*one_node(ranks, gforker), *me, "rank", str(run_dir), str(joiners), str(cycles)]
        world = _launch(argv, errors=True)
        burst: list[subprocess.Popen[bytes]] = []
        cycler: subprocess.Popen[bytes] | None = None
        while world.poll() is None:
            if cycles and cycler is None and (run_dir / "cycle").exists():
                cycler = _launch([*one_node(1, gforker), *me, "cycle", str(run_dir), str(cycles)])
                burst.append(cycler)
            if joiners and not burst and (run_dir / "burst").exists():
                burst = [
                    _launch([*one_node(1, gforker), *me, "join", str(run_dir), f"b{k}+0"])
                    for k in range(joiners)
                ]
            time.sleep(0.05)
        for proc in burst:
            proc.wait(60)
        if world.returncode != 0 or not (run_dir / "result.json").exists():
            err = world.stderr.read().decode()[-2000:] if world.stderr else ""
            raise RuntimeError(f"bench --plane: the world of {ranks} ranks failed:\n{err}")
        return dict(json.loads((run_dir / "result.json").read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pearl-hpc bench --plane", description=__doc__)
    parser.add_argument("--ranks", default="8,32,128,256", help="world sizes, comma-separated")
    parser.add_argument("--joiners", type=int, default=200, help="the burst, at the first size")
    parser.add_argument(
        "--cycles", type=int, default=0, help="join / leave-or-fail cycles, at the first size"
    )
    parser.add_argument("--json", action="store_true")
    record.add_argument(parser)
    sub = parser.add_subparsers(dest="role")
    rank = sub.add_parser("rank")
    rank.add_argument("run_dir", type=Path)
    rank.add_argument("burst", type=int)
    rank.add_argument("cycles", type=int)
    cycle = sub.add_parser("cycle")
    cycle.add_argument("run_dir", type=Path)
    cycle.add_argument("cycles", type=int)
    join = sub.add_parser("join")
    join.add_argument("run_dir", type=Path)
    join.add_argument("group")
    args = parser.parse_args(argv)
    if args.role == "rank":
        return _rank(args.run_dir, args.burst, args.cycles)
    if args.role == "cycle":
        return _cycle(args.run_dir, args.cycles)
    if args.role == "join":
        return _join(args.run_dir, args.group)
    rows = []
    for i, ranks in enumerate(int(r) for r in args.ranks.split(",")):
        row = measure(ranks, args.joiners if i == 0 else 0, args.cycles if i == 0 else 0)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        line = (
            f"{row['ranks']:>4} ranks: start {row['start_s']:6.2f} s | plan: partition "
            f"{row['partition_ms']:.3f} ms, fan-out to all + acks {row['fanout_ms']:8.1f} ms, "
            f"loop gap {row['plan_gap_ms']:6.1f} ms"
        )
        if "burst_s" in row:
            line += (
                f"\n      burst of {row['joined']}/{args.joiners} joiners: {row['burst_s']:.1f} s, "
                f"go -> joined {row['join_ms']:.1f} ms, Accept {row['accept_ms']:.1f} ms "
                f"(median), loop gap {row['burst_gap_ms']:.1f} ms, longest poll (CPU) "
                f"{row['burst_poll_ms']:.1f} ms"
            )
        if "cycles" in row:
            line += (
                f"\n      {row['cycles']} join / leave-or-fail cycles: {row['cycle_ms']:.1f} ms "
                f"each, loop gap {row['cycles_gap_ms']:.1f} ms; before -> after: free "
                f"communicators {row['free_comms_before']} -> {row['free_comms_after']}, "
                f"open files {row['fds_before']} -> {row['fds_after']}, threads "
                f"{row['threads_before']} -> {row['threads_after']}, CPU idle "
                f"{row['idle_cpu_before']:.3f} -> {row['idle_cpu_after']:.3f} s/s"
            )
        print(line, flush=True)
    ratios = {}
    if len(rows) > 1:  # what a plan's fan-out grows by with the world
        lo, hi = rows[0], rows[-1]
        ratios[f"fan-out {hi['ranks']} / {lo['ranks']} ranks"] = hi["fanout_ms"] / lo["fanout_ms"]
    record.append(args.record, "plane", rows, ratios, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
