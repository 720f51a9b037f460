"""The MPI control plane (mpi4py): the master's side and the members' side.

Communicators:
- **link**: how the master talks to one member, point to point. The base job's ranks
  share the base world (the master is rank 0); an elastic job component joins with
  ``Connect`` to the master's port and ``Merge``s with it, giving one link per
  component (the master is rank 0 there too). Links live as long as their members.
- **universe**: one intracomm over the master and every admitted member, extended by
  ``Create_intercomm`` + ``Merge`` when a component is admitted and cut down by
  ``Create_group`` (collective over the survivors only) when members leave or fail.
- **members**: the universe without the master (``Create_group``, collective over the
  members only), made again after each change of the universe.
- **role groups**: ``members.Split`` by role after every applied plan (one epoch each).
  The master takes no part: it sends each member its colour and collects the acks, so
  a member slow to enter (its process busy) delays its peers, never the master's loop.

Joining. MPICH holds a global lock inside a blocking ``Accept``, so a master thread
waiting in ``Accept`` stalls every other MPI call of the process (verified with MPICH
5.0.2 under ``srun --mpi=pmi2``, whatever the async-progress settings). The master
therefore never waits in ``Accept`` on spec: a joining component's rank 0 first writes
an announcement file ``joins/<group>.json`` in the run directory and waits for the
master's go (``joins/<group>.go``); the master writes one go at a time and ``Accept``s
that component's ``Connect``. Two components connecting to one port at the same moment
crashed MPICH's ``Accept`` now and then (seen under load), hence one at a time. The port
name is in ``mpi-port`` (mode 0600) in the run directory.

Failure detection: every member sends a heartbeat every ``heartbeat_interval_s``;
the master marks a member silent for ``heartbeat_timeout_s`` as failed and drops it
from the universe (``Create_group`` needs no call from the dead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from pearl_hpc.comm.membership import MASTER_ID, Member, Membership, MemberState
from pearl_hpc.comm.messages import (
    COLLECTIVE,
    TAG_COMMAND,
    TAG_REPORT,
    Ack,
    Admit,
    CollectiveAck,
    Command,
    CommandBody,
    Heartbeat,
    Hello,
    Leave,
    Op,
    Partition,
    Report,
    ReportBody,
    Shrink,
    Shutdown,
    decode_command,
    decode_report,
    encode,
)
from pearl_hpc.errors import PearlError
from pearl_hpc.rundir import RunDir

log = logging.getLogger(__name__)
_M = TypeVar("_M", Command, Report)

TAG_INTERCOMM = 21
TAG_SHRINK = 22
TAG_MEMBERS = 23


class PlaneError(PearlError):
    """The control plane cannot go on (no port file, a join that never connects...)."""


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically to a file only the owner can read (0600)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def base_member_id(rank: int) -> str:
    return f"base:{rank}"


# ---------------------------------------------------------------------- master side
@dataclass
class Timings:
    """Seconds spent in the plane's collective operations, for the latency benchmark."""

    accept_s: list[float] = field(default_factory=list)
    admit_s: list[float] = field(default_factory=list)
    shrink_s: list[float] = field(default_factory=list)


COLLECTIVE_TIMEOUT_S = 120.0


@contextlib.contextmanager
def hang_guard(what: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Iterator[None]:
    """MPI has no fault tolerance inside a collective: a member that dies in the middle
    of one hangs the others for good. Past ``timeout_s`` the master exits hard, so that
    ``srun --kill-on-bad-exit`` ends the base job and the elastic jobs end with it
    (nothing is left running to its time limit; the journal stays for a restart)."""

    def expire() -> None:
        log.critical("%s did not finish in %g s: a member died inside it; exiting", what, timeout_s)
        logging.shutdown()
        os._exit(3)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class MasterPlane:
    """Rank 0 of the base job. Call :meth:`poll` often from the master's loop."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        heartbeat_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        hello_timeout_s: float = 60.0,
        fresh_s: float | None = None,
    ) -> None:
        MPI = _mpi()
        self.MPI = MPI
        self.run_dir = Path(run_dir)
        self.clock = clock
        self.hello_timeout_s = hello_timeout_s
        # collective calls wait until every member was heard this recently (default: a
        # quarter of the heartbeat timeout)
        self.fresh_s = heartbeat_timeout_s / 4 if fresh_s is None else fresh_s
        world = MPI.COMM_WORLD
        if world.rank != 0:
            raise PlaneError(f"the master must be rank 0 of the base job, this is {world.rank}")
        self.universe = world.Dup()
        self.links: dict[str, Any] = {"base": world}
        self.membership = Membership(heartbeat_timeout_s)
        self.epoch = 0
        self.seq = 0
        self.timings = Timings()
        self._last_poll_s = clock()
        self.port = MPI.Open_port()
        RunDir(self.run_dir).joins.mkdir(parents=True, exist_ok=True)
        write_private(RunDir(self.run_dir).mpi_port, self.port)

    # --------------------------------------------------------------- joining
    def start_base(self) -> list[Member]:
        """Wait for the hello of every other base rank; they form the first universe."""
        world = self.links["base"]
        hellos = self._collect_hellos(world, "base", range(1, world.size))
        members = [self._member(r, "base", rank) for rank, r in sorted(hellos.items())]
        self.membership.start_base(members, self.clock())
        return members

    def joins_waiting(self) -> bool:
        return any(RunDir(self.run_dir).joins.glob("*.json"))

    def poll_joins(self) -> list[str]:
        """Accept the components whose rank 0 announced itself; returns their groups."""
        joined = []
        for path in sorted(RunDir(self.run_dir).joins.glob("*.json")):
            try:
                note = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # being written
            path.rename(path.with_suffix(".accepted"))
            t0 = time.perf_counter()
            write_private(path.with_suffix(".go"), "")  # this announcer, and only it, connects
            intercomm = self.MPI.COMM_SELF.Accept(self.port)
            link = intercomm.Merge(high=False)
            intercomm.Free()
            self.timings.accept_s.append(time.perf_counter() - t0)
            # the connection accepted may be another announcer's: its hellos say whose
            hellos = self._collect_hellos(link, str(note["group"]), range(1, link.size))
            group = _hello(hellos[1]).group or str(note["group"])
            self.links[group] = link
            now = self.clock()
            for rank, report in sorted(hellos.items()):
                self.membership.link(self._member(report, group, rank), now)
            joined.append(group)
            log.info("group %s linked: %d ranks", group, link.size - 1)
        return joined

    def _collect_hellos(self, link: Any, group: str, ranks: Iterable[int]) -> dict[int, Report]:
        wanted = set(ranks)
        hellos: dict[int, Report] = {}
        deadline = time.monotonic() + self.hello_timeout_s
        status = self.MPI.Status()
        while wanted - hellos.keys():
            if link.iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_REPORT, status=status):
                report = _receive(link, status, decode_report, group)
                if report is not None and isinstance(report.body, Hello):
                    hellos[status.Get_source()] = report
                continue
            if time.monotonic() > deadline:
                missing = sorted(wanted - hellos.keys())
                raise PlaneError(f"group {group}: ranks {missing} never said hello")
            time.sleep(0.005)
        return hellos

    @staticmethod
    def _member(report: Report, group: str, link_rank: int) -> Member:
        hello = _hello(report)
        return Member(
            report.member_id, group, link_rank, node=hello.node, gpu_ids=hello.gpu_ids, hello=hello
        )

    # --------------------------------------------------------------- messages
    def send(self, member_id: str, body: CommandBody) -> int:
        """Send ``body`` to one member; returns the command's seq (its ack echoes it)."""
        member = self.membership.members[member_id]
        self.seq += 1
        data = encode(Command(self.seq, body))
        self.links[member.group].Send([data, self.MPI.BYTE], dest=member.link_rank, tag=TAG_COMMAND)
        return self.seq

    def poll(self) -> list[Report]:
        """Reports that arrived on any live link (heartbeats update liveness)."""
        reports = []
        status = self.MPI.Status()
        now = self.clock()
        if now - self._last_poll_s > self.membership.heartbeat_timeout_s / 4:
            # the master itself was deaf (blocked): nobody is late because of that
            for member in self.membership.live():
                self.membership.heard(member.member_id, now)
        self._last_poll_s = now
        for group, link in list(self.links.items()):
            while group in self.links and link.iprobe(
                source=self.MPI.ANY_SOURCE, tag=TAG_REPORT, status=status
            ):
                report = _receive(link, status, decode_report, group)
                if report is None:
                    continue
                sender = self.membership.members.get(report.member_id)
                if sender is None or sender.group != group:  # one speaks for its own link only
                    log.warning("control plane: %s on %s's link: dropped", report.member_id, group)
                    continue
                self.membership.heard(report.member_id, now)
                if not isinstance(report.body, Heartbeat):
                    reports.append(report)
                if isinstance(report.body, Ack) and report.body.op is Op.LEAVE:
                    self._left(group, report.member_id)
        return reports

    def all_fresh(self, joining: str | None = None) -> bool:
        """Was every universe member heard within ``fresh_s``? Collective calls wait for
        this: a member that died since its last heartbeat would hang them (it is
        declared failed and shrunk away first)."""
        now = self.clock()
        window = self.fresh_s
        members = [self.membership.members[i] for i in self.membership.universe[1:]]
        if joining is not None:
            members += self.membership.group(joining)
        return not any(
            m.state in (MemberState.MEMBER, MemberState.LINKED) and now - m.last_seen_s > window
            for m in members
        )

    def overdue(self) -> list[Member]:
        """Members silent past the timeout, judged only while the master itself is
        listening (a master blocked in sbatch or squeue has not heard anyone)."""
        now = self.clock()
        if now - self._last_poll_s > self.membership.heartbeat_timeout_s / 4:
            return []
        return self.membership.overdue(now)

    # ------------------------------------------------------------ collectives
    def admit(self, group: str) -> float:
        """Extend the universe with a linked group; returns the seconds it took."""
        t0 = time.perf_counter()
        self._shrink_if_needed()
        old = list(self.membership.universe[1:])
        joining = [
            m.member_id for m in self.membership.group(group) if m.state is MemberState.LINKED
        ]
        for member_id in old + joining:
            self.send(member_id, Admit(group))
        with hang_guard(f"admitting {group}"):
            intercomm = self.universe.Create_intercomm(0, self.links[group], 1, TAG_INTERCOMM)
            universe = intercomm.Merge(high=False)
        intercomm.Free()
        self.universe.Free()
        self.universe = universe
        self.membership.admit(group)
        elapsed = time.perf_counter() - t0
        self.timings.admit_s.append(elapsed)
        return elapsed

    def _shrink_if_needed(self) -> None:
        if self.membership.needs_shrink():
            self.shrink()

    def shrink(self) -> float:
        """Drop leaving and failed members from the universe (the survivors only)."""
        t0 = time.perf_counter()
        old = list(self.membership.universe)
        survivors = self.membership.shrink()
        keep = [old.index(i) for i in survivors]
        for member_id in survivors[1:]:
            self.send(member_id, Shrink(keep))
        group = self.universe.Get_group().Incl(keep)
        with hang_guard("shrinking the universe"):
            universe = self.universe.Create_group(group, TAG_SHRINK)
        group.Free()
        self.universe = universe  # the old one may hold dead ranks: never freed collectively
        elapsed = time.perf_counter() - t0
        self.timings.shrink_s.append(elapsed)
        return elapsed

    def partition(self, roles: Mapping[str, str]) -> tuple[int, list[str]]:
        """Ask every member to re-partition into role groups (``Comm.Split`` of the
        members' communicator, without the master: this returns at once). The universe
        must hold no leaving or failed member (:meth:`shrink` first). Returns the epoch
        and the members asked; each acks with its group's size and its seconds."""
        if self.membership.needs_shrink():
            raise PlaneError("re-partition: shrink the universe first")
        self.epoch += 1
        colors = self.membership.colors(roles)
        by_rank = [colors[i] for i in self.membership.universe]
        members = list(self.membership.universe[1:])
        for member_id in members:
            self.send(member_id, Partition(self.epoch, by_rank))
        return self.epoch, members

    # ---------------------------------------------------------------- leaving
    def leave(self, group: str) -> list[Member]:
        """The group's job is given back: its members leave the plane."""
        leaving = self.membership.leave(group)
        for member in leaving:
            self.send(member.member_id, Leave())
        return leaving

    def _left(self, group: str, member_id: str) -> None:
        self.membership.gone(member_id)
        if group == "base":
            return
        if all(m.state is MemberState.GONE for m in self.membership.group(group)):
            link = self.links.pop(group)
            link.Disconnect()  # every member acked LEAVE and is disconnecting too

    def drop_group(self, group: str) -> None:
        """A group whose members died: forget its link without a collective call."""
        self.links.pop(group, None)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tell every live member to exit and wait (bounded) until they and the members
        already leaving have acknowledged."""
        waiting = set()
        for member in self.membership.live():
            self.send(member.member_id, Shutdown())
            waiting.add(member.member_id)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for report in self.poll():
                if isinstance(report.body, Ack) and report.body.op is Op.SHUTDOWN:
                    waiting.discard(report.member_id)
            leaving = {
                m.member_id
                for m in self.membership.members.values()
                if m.state is MemberState.LEAVING
            }
            if not waiting and not leaving:
                break
            time.sleep(0.01)
        else:
            log.warning("no shutdown ack from %s", ", ".join(sorted(waiting | leaving)))
        self.MPI.Close_port(self.port)
        RunDir(self.run_dir).mpi_port.unlink(missing_ok=True)


# ---------------------------------------------------------------------- member side
class WorkerPlane:
    """One member: a base rank or a rank of an elastic job component."""

    def __init__(
        self,
        link: Any,
        member_id: str,
        universe: Any,
        local: Any,
        *,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        self.MPI = _mpi()
        self.link = link
        self.member_id = member_id
        self.universe = universe  # None until admitted
        self.local = local  # the component's own world (joiners); None for base ranks
        self.members: Any = None  # the universe without the master, made when first needed
        self.role_comm: Any = None
        self.epoch = 0
        self.heartbeat_interval_s = heartbeat_interval_s
        self._last_beat = 0.0

    @classmethod
    def base(cls, *, heartbeat_interval_s: float = 1.0) -> WorkerPlane:
        MPI = _mpi()
        world = MPI.COMM_WORLD
        return cls(
            world,
            base_member_id(world.rank),
            world.Dup(),
            None,
            heartbeat_interval_s=heartbeat_interval_s,
        )

    @classmethod
    def join(
        cls,
        run_dir: str | Path,
        group: str,
        *,
        timeout_s: float = 300.0,
        heartbeat_interval_s: float = 1.0,
    ) -> WorkerPlane:
        """Connect this component (all its ranks, collectively) to the master."""
        MPI = _mpi()
        run_dir = Path(run_dir)
        local = MPI.COMM_WORLD
        port_file = RunDir(run_dir).mpi_port
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise PlaneError(f"{port_file}: no master port after {timeout_s:g} s")
            time.sleep(0.1)
        port = port_file.read_text()
        if local.rank == 0:
            note = {"group": group, "size": local.size, "pid": os.getpid()}
            write_private(RunDir(run_dir).join_note(group), json.dumps(note))
            go = RunDir(run_dir).join_note(group).with_suffix(".go")
            while not go.exists():  # one component connects at a time (see module doc)
                if time.monotonic() > deadline:
                    raise PlaneError(f"{group}: the master never accepted (no {go})")
                time.sleep(0.01)
            go.unlink()
        intercomm = local.Connect(port, root=0)
        link = intercomm.Merge(high=True)
        intercomm.Free()
        return cls(
            link,
            f"{group}:{local.rank}",
            None,
            local,
            heartbeat_interval_s=heartbeat_interval_s,
        )

    def report(self, body: ReportBody, seq: int = -1) -> None:
        """Send ``body`` to the master (``seq``: the command it acknowledges)."""
        data = encode(Report(self.member_id, seq, body))
        self.link.Send([data, self.MPI.BYTE], dest=0, tag=TAG_REPORT)

    def next_command(self, timeout_s: float) -> Command | None:
        """Wait up to ``timeout_s`` for a command, heartbeating meanwhile."""
        deadline = time.monotonic() + timeout_s
        status = self.MPI.Status()
        while True:
            now = time.monotonic()
            if now - self._last_beat >= self.heartbeat_interval_s:
                self._last_beat = now
                self.report(Heartbeat())
            if self.link.iprobe(source=0, tag=TAG_COMMAND, status=status):
                cmd = _receive(self.link, status, decode_command, "the master")
                if cmd is None:
                    continue
                if cmd.op is not Op.PREPARE:
                    return cmd
                # this thread is responsive: the collective call the master makes next
                # is entered as soon as its command arrives (see comm.members)
                self.report(Ack(Op.PREPARE), cmd.seq)
                continue
            if now >= deadline:
                return None
            time.sleep(0.005)

    def enter(self, cmd: Command) -> float:
        """Take part in a collective command; returns the seconds it took."""
        if cmd.op not in COLLECTIVE:
            raise PlaneError(f"{cmd.op} is not a collective command")
        body = cmd.body
        t0 = time.perf_counter()
        if cmd.op is not Op.PARTITION and self.members is not None:
            # the universe changes, its members' communicator with it (after a shrink
            # it may span dead ranks: dropped, not freed)
            if cmd.op is Op.ADMIT:
                self.members.Free()
            self.members = None
        if cmd.op is Op.ADMIT:
            if self.universe is None:  # the joining side
                intercomm = self.local.Create_intercomm(0, self.link, 0, TAG_INTERCOMM)
                self.universe = intercomm.Merge(high=True)
            else:
                intercomm = self.universe.Create_intercomm(0, self.universe, 0, TAG_INTERCOMM)
                universe = intercomm.Merge(high=False)
                self.universe.Free()
                self.universe = universe
            intercomm.Free()
        elif isinstance(body, Shrink):
            group = self.universe.Get_group().Incl(body.keep)
            self.universe = self.universe.Create_group(group, TAG_SHRINK)
            group.Free()
        elif isinstance(body, Partition):
            colors = body.colors
            if self.members is None:  # collective over the members: the master stays out
                others = self.universe.Get_group().Excl([0])
                self.members = self.universe.Create_group(others, TAG_MEMBERS)
                others.Free()
            if self.role_comm is not None:
                self.role_comm.Free()
            rank = self.universe.rank
            self.role_comm = self.members.Split(colors[rank], rank)
            self.epoch = body.epoch
        return time.perf_counter() - t0

    def take_part(self, cmd: Command) -> CollectiveAck:
        """Enter a collective command; returns its ack: the seconds inside it, the
        epoch and (a re-partition) the new role group's size as the group counts itself
        (the master checks it)."""
        seconds = self.enter(cmd)
        size = self.role_comm.allreduce(1) if cmd.op is Op.PARTITION else 0
        return CollectiveAck(cmd.op, seconds, self.epoch, size)

    def disconnect(self) -> None:
        """Leave the plane: free the shared communicators, disconnect from the master."""
        if self.role_comm is not None:
            self.role_comm.Free()
            self.role_comm = None
        self.members = None  # like the universe: may span dead ranks
        self.universe = None  # may span dead ranks: dropped, not freed collectively
        if self.local is not None:
            self.link.Disconnect()


def member_info(process: str, **fields: Any) -> Hello:
    """What a member says in its hello: where it runs, and ``fields`` of :class:`Hello`."""
    return Hello(
        process=process,
        node=os.environ.get("SLURMD_NODENAME") or os.uname().nodename,
        pid=os.getpid(),
        local_id=int(os.environ.get("SLURM_LOCALID", "0")),
        job_id=os.environ.get("SLURM_JOB_ID", ""),
        **fields,
    )


def _receive(link: Any, status: Any, decode: Callable[[bytearray], _M], sender: str) -> _M | None:
    """The message ``status`` (of a probe) found on ``link``, as raw bytes decoded into
    its type; one that does not decode is logged and dropped (None): nothing is
    unpickled, whoever sent it."""
    MPI = _mpi()
    data = bytearray(status.Get_count(MPI.BYTE))
    link.Recv([data, MPI.BYTE], source=status.Get_source(), tag=status.Get_tag())
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("control plane: dropped a malformed message from %s: %s", sender, exc)
        return None


def _hello(report: Report) -> Hello:
    if not isinstance(report.body, Hello):
        raise PlaneError(f"{report.member_id}: expected its hello, got {report.body!r}"[:300])
    return report.body


__all__ = ["MASTER_ID", "MasterPlane", "PlaneError", "WorkerPlane", "member_info"]
