"""The MPI control plane (mpi4py): the master's side and the members' side.

The rule: **a blocking MPI call spans only ranks that die together, and the master's
loop makes no MPI call at all.**

- **Links** are the only communicators between the master and its members: the base
  job's world (the master is rank 0), and one per elastic job component, made by
  ``Connect`` to the master's port + ``Merge`` (the master is rank 0 there too). Commands
  go down a link, reports come up it; nothing spans two links, so a member that dies
  touches nobody else. A link whose members all left is disconnected, one whose members
  died is freed (both return at once, measured with SIGKILLed peers).
- **The pump**: one thread of the master makes every MPI call of the master. It sends
  with ``Isend`` (a command not delivered within ``send_timeout_s`` fails its member,
  whatever its size), probes every link, accepts joiners and hands the master's loop
  what arrived as plain records (:meth:`MasterPlane.take`). The loop never waits on MPI.

Joining. MPICH holds a global lock inside a blocking ``Accept``, and two components
connecting to one port at once crashed it under load, so one component joins at a time:
its rank 0 writes ``joins/<group>.json``; the pump renames it, writes ``joins/<group>.go``
(0600) holding a fresh nonce, and ``Accept``s. The joiner's ranks read the nonce, connect
and each sends a :class:`Hello` carrying ``HMAC(run key, nonce | hello)``
(:func:`hello_proof`): a connection whose first message is anything else (a pickle, a
hello not signed by the run's key or for another nonce) is freed and reported, and the
run goes on. An ``Accept`` whose announcer died before connecting would wait for good: the
:class:`~pearl_hpc.comm.doorman.Doorman` (a process started before ``MPI_Init``) connects
instead after ``accept_timeout_s`` and says so; the go is tried again, up to
``ACCEPT_TRIES`` times.

Failure detection: every member heartbeats every ``heartbeat_interval_s``; the master's
:class:`~pearl_hpc.comm.members.Members` declares a member silent past the heartbeat
timeout failed (judged only while the pump turns: a pump held in ``Accept`` heard
nobody).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from pearl_hpc.comm.membership import MASTER_ID
from pearl_hpc.comm.messages import (
    TAG_COMMAND,
    TAG_REPORT,
    Command,
    CommandBody,
    Heartbeat,
    Hello,
    Report,
    ReportBody,
    decode_command,
    decode_report,
    encode,
)
from pearl_hpc.errors import PearlError
from pearl_hpc.rundir import RunDir
from pearl_hpc.slurm.client import FORK_LOCK

log = logging.getLogger(__name__)
_M = TypeVar("_M", Command, Report)

TAG_KNOCK = 13  # the doorman's message: nobody else connected
PUMP_S = 0.002  # the pump's sleep between idle turns
ACCEPT_TRIES = 3  # accepts a go gets before it is abandoned (its joiner never came)
MAX_HELLO_BYTES = 64 << 10  # an unproven connection's first message, at most
NONCE_BYTES = 16


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


def member_id_at(group: str, link_rank: int) -> str:
    """The id of the member at ``link_rank`` of ``group``'s link: ``base:3`` (the base
    world's rank 3), ``123+1:0`` (rank 0 of job component 123+1, link rank 1: the master
    is rank 0 of every link)."""
    return base_member_id(link_rank) if group == "base" else f"{group}:{link_rank - 1}"


def hello_proof(key: str, nonce: bytes, member_id: str, hello: Hello) -> bytes:
    """What proves a joiner's hello: HMAC-SHA256 under the run's key (hex, the engine
    sockets' key) of a label, the master's nonce for this join and the report without
    its proof. A hello replayed for another join, or from a process without the key,
    does not match."""
    unsigned = encode(Report(member_id, -1, msgspec.structs.replace(hello, proof=b"")))
    mac = hmac.new(bytes.fromhex(key), b"pearl-plane-hello", hashlib.sha256)
    mac.update(nonce)
    mac.update(unsigned)
    return mac.digest()


# ------------------------------------------------------- what the pump hands the loop
@dataclass(frozen=True)
class Received:
    """A message on a member's link (decoded by the loop: bytes are never unpickled)."""

    group: str
    source: int  # the sender's rank in the link
    data: bytes


@dataclass(frozen=True)
class Joined:
    """Every rank of a link said hello (an elastic component's: proven)."""

    group: str
    hellos: dict[int, Report]  # link rank -> its hello
    seconds: float  # from the go (the base world: the pump's start) to the last hello


@dataclass(frozen=True)
class Dropped:
    """A connection freed before it became a member's link."""

    reason: str
    group: str = ""  # the join it was accepted for ('' : none claimed)


@dataclass(frozen=True)
class Abandoned:
    """A join whose component never connected (``ACCEPT_TRIES`` accepts)."""

    group: str


@dataclass(frozen=True)
class Undelivered:
    """A command not delivered within the send timeout: its member is dead or deaf."""

    group: str
    rank: int


@dataclass(frozen=True)
class LinkFailed:
    """An MPI error on a member's link (its peer is gone): its members have failed."""

    group: str
    error: str


@dataclass(frozen=True)
class Broken:
    """The pump failed: the plane cannot go on."""

    error: str


Arrival = Received | Joined | Dropped | Abandoned | Undelivered | LinkFailed | Broken


@dataclass
class Timings:
    """The pump's seconds in ``Accept`` (the only call that can block it)."""

    accept_s: list[float] = field(default_factory=list)


@dataclass
class _Pending:
    """A link whose hellos are awaited."""

    size: int  # ranks in it, the master included
    proven: bool  # base world: its ranks came with the master's launch
    deadline_s: float
    since_s: float
    hellos: dict[int, Report] = field(default_factory=dict)


@dataclass
class _Go:
    """The one join under way: its nonce, and the link accepted for it (if any)."""

    group: str
    nonce: bytes
    issued_s: float
    tries: int = 0
    link: str | None = None


@dataclass
class _Send:
    request: Any
    data: bytes  # kept alive until the request completes
    group: str
    rank: int
    deadline_s: float


class MasterPlane:
    """Rank 0 of the base job. The loop calls :meth:`send`, :meth:`take`, :meth:`close`;
    the pump thread makes the MPI calls."""

    def __init__(
        self,
        run_dir: str | Path,
        key: str,
        *,
        doorman: Any = None,
        hello_timeout_s: float = 60.0,
        base_hello_timeout_s: float = 600.0,
        send_timeout_s: float = 30.0,
        accept_timeout_s: float = 3.0,
    ) -> None:
        """``key``: the run's key (hex); ``doorman``: a started
        :class:`~pearl_hpc.comm.doorman.Doorman` (None: an ``Accept`` whose joiner died
        waits for good -- tests of the plane alone)."""
        MPI = _mpi()
        self.MPI = MPI
        self.run_dir = Path(run_dir)
        self.key = key
        self.doorman = doorman
        self.hello_timeout_s = hello_timeout_s
        self.send_timeout_s = send_timeout_s
        self.accept_timeout_s = accept_timeout_s
        world = MPI.COMM_WORLD
        if world.rank != 0:
            raise PlaneError(f"the master must be rank 0 of the base job, this is {world.rank}")
        self.seq = 0
        self._inbox: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self.timings = Timings()
        self.turned_s = time.monotonic()  # the pump's last turn
        self._links: dict[str, Any] = {"base": world.Dup()}
        now = time.monotonic()
        self._pending = {"base": _Pending(world.size, True, now + base_hello_timeout_s, now)}
        if world.size == 1:  # the master alone: nobody to wait for
            self._pending.clear()
            self._inbox.put(Joined("base", {}, 0.0))
        self._go: _Go | None = None
        self._sends: list[_Send] = []
        self._stuck: list[Any] = []  # requests to dead members: never complete
        self._accepted = 0
        self._outbox: queue.SimpleQueue[tuple[str, str, int, bytes]] = queue.SimpleQueue()
        self.port = MPI.Open_port()
        joins = RunDir(self.run_dir).joins
        joins.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(RunDir(self.run_dir).mpi_port, self.port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="mpi-pump", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the loop's side
    def send(self, group: str, rank: int, body: CommandBody) -> int:
        """Queue ``body`` for the member at ``rank`` of ``group``'s link; returns the
        command's seq (its ack echoes it)."""
        self.seq += 1
        self._outbox.put(("send", group, rank, encode(Command(self.seq, body))))
        return self.seq

    def take(self) -> list[Arrival]:
        """What arrived since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def close_link(self, group: str, *, left: bool) -> None:
        """The group's members ``left`` (both sides Disconnect) or died (freed)."""
        self._outbox.put(("disconnect" if left else "free", group, 0, b""))

    def base_hellos(self) -> tuple[int, int] | None:
        """(hellos in, ranks besides the master) of the base world while it starts (a
        read of the pump's state: a moment old); None once it has."""
        pending = self._pending.get("base")
        return None if pending is None else (len(pending.hellos), pending.size - 1)

    def deaf_s(self) -> float:
        """Seconds since the pump last turned (it heard nobody meanwhile)."""
        return time.monotonic() - self.turned_s

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the pump (after the sends queued so far went out) and close the port."""
        self._outbox.put(("stop", "", 0, b""))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("control plane: the pump did not stop in %g s", timeout_s)
            return
        self.MPI.Close_port(self.port)
        RunDir(self.run_dir).mpi_port.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the pump
    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._turn()
                self.turned_s = time.monotonic()
                if not busy:
                    time.sleep(PUMP_S)
        except Exception as exc:  # handed to the loop, which fails the run
            log.exception("control plane: the pump failed")
            self._inbox.put(Broken(f"{type(exc).__name__}: {exc}"))

    def _turn(self) -> bool:
        now = time.monotonic()
        busy = self._outgoing(now)
        self._completed(now)
        busy |= self._incoming()
        self._expire(now)
        self._join(now)
        return busy

    def _outgoing(self, now: float) -> bool:
        busy = False
        while True:
            try:
                what, group, rank, data = self._outbox.get_nowait()
            except queue.Empty:
                return busy
            busy = True
            if what == "stop":
                self._flush()
                self._stop.set()
                return busy
            link = self._links.get(group)
            if link is None:
                continue  # its members were dropped: nothing to deliver to
            try:
                if what == "send":
                    request = link.Isend([data, self.MPI.BYTE], dest=rank, tag=TAG_COMMAND)
                    deadline = now + self.send_timeout_s
                    self._sends.append(_Send(request, data, group, rank, deadline))
                    continue
                self._forget(group)
                if what == "disconnect":
                    link.Disconnect()
                else:
                    link.Free()
            except self.MPI.Exception as exc:
                self._link_failed(group, exc)

    def _forget(self, group: str) -> Any:
        """Stop using ``group``'s link: its sends in flight are abandoned."""
        self._stuck += [s for s in self._sends if s.group == group]
        self._sends = [s for s in self._sends if s.group != group]
        return self._links.pop(group, None)

    def _link_failed(self, group: str, exc: Exception) -> None:
        """An MPI error on a link: its peer is gone; the link is freed (no wait)."""
        link = self._forget(group)
        if link is not None:
            with contextlib.suppress(self.MPI.Exception):
                link.Free()
        log.warning("control plane: link %s failed: %s", group, exc)
        self._inbox.put(LinkFailed(group, str(exc)[:200]))

    def _completed(self, now: float) -> None:
        waiting, failed = [], set()
        for send in self._sends:
            if send.group in failed:
                continue  # its link failed this turn (reported once)
            try:
                done = send.request.Test()
            except self.MPI.Exception as exc:
                failed.add(send.group)
                self._link_failed(send.group, exc)
                continue
            if done:
                continue
            if now > send.deadline_s:
                self._stuck.append(send)
                self._inbox.put(Undelivered(send.group, send.rank))
                continue
            waiting.append(send)
        self._sends = [s for s in waiting if s.group not in failed]

    def _flush(self, timeout_s: float = 5.0) -> None:
        """The queued sends delivered (bounded: the run is ending)."""
        deadline = time.monotonic() + timeout_s
        while self._sends and time.monotonic() < deadline:
            self._sends = [s for s in self._sends if not s.request.Test()]
            time.sleep(PUMP_S)

    def _incoming(self) -> bool:
        busy = False
        for group, link in list(self._links.items()):
            try:
                busy |= self._receive_on(group, link)
            except self.MPI.Exception as exc:
                if group in self._pending:
                    self._drop(group, f"an MPI error before its hello: {exc}"[:200])
                else:
                    self._link_failed(group, exc)
        return busy

    def _receive_on(self, group: str, link: Any) -> bool:
        MPI, status, busy = self.MPI, self.MPI.Status(), False
        while group in self._links and link.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            busy = True
            source, tag, size = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
            pending = self._pending.get(group)
            if pending is not None and not pending.proven and size > MAX_HELLO_BYTES:
                self._drop(group, f"a first message of {size} bytes")
                break
            data = bytearray(size)
            link.Recv([data, MPI.BYTE], source=source, tag=tag)
            if tag == TAG_KNOCK and pending is not None and not pending.proven:
                self._drop(group, f"nobody connected in {self.accept_timeout_s:g} s (doorman)")
            elif pending is not None and source not in pending.hellos:
                self._hello(group, pending, source, bytes(data))
            elif tag == TAG_REPORT and pending is None:  # (before the whole link said
                # hello its members have no commands to answer: heartbeats only)
                self._inbox.put(Received(group, source, bytes(data)))
        return busy

    def _hello(self, group: str, pending: _Pending, source: int, data: bytes) -> None:
        try:
            report = decode_report(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop(group, f"a first message that is not a hello ({exc})"[:200])
            return
        hello = report.body
        if not isinstance(hello, Hello):
            go = self._go
            if not pending.proven and (
                go is None or report.member_id != member_id_at(go.group, source)
            ):
                # another link's member sent it before that link ended: MPI matched it
                # to this one (the freed link's context id, reused). Not this joiner's
                log.info(
                    "control plane: %s's stale message on a new link: ignored", report.member_id
                )
                return
            self._drop(group, f"a first message that is not a hello ({type(hello).__name__})")
            return
        if pending.proven:
            claimed = "base"
            if report.member_id != member_id_at("base", source):
                raise PlaneError(f"base rank {source} says it is {report.member_id}")
        else:
            go, claimed = self._go, hello.group
            if (
                go is None
                or claimed != go.group
                or report.member_id != member_id_at(claimed, source)
            ):
                self._drop(group, f"a hello for no join under way ({report.member_id})")
                return
            expected = hello_proof(self.key, go.nonce, report.member_id, hello)
            if not hmac.compare_digest(hello.proof, expected):
                self._drop(group, f"a hello not signed by the run's key ({report.member_id})")
                return
        pending.hellos[source] = report
        if len(pending.hellos) < pending.size - 1:
            return
        del self._pending[group]
        self._links[claimed] = self._links.pop(group)
        if not pending.proven:
            self._go = None
        seconds = time.monotonic() - pending.since_s
        self._inbox.put(Joined(claimed, dict(sorted(pending.hellos.items())), seconds))

    def _drop(self, group: str, reason: str) -> None:
        """Free a connection that did not prove itself; its join is tried again."""
        self._pending.pop(group, None)
        link = self._forget(group)
        with contextlib.suppress(self.MPI.Exception):
            link.Free()
        go = self._go
        claimed = ""
        if go is not None and go.link == group:
            claimed, go.link = go.group, None
            if go.tries >= ACCEPT_TRIES:
                self._abandon(go)
        log.warning("control plane: dropped a connection: %s", reason)
        self._inbox.put(Dropped(reason, claimed))

    def _abandon(self, go: _Go) -> None:
        self._go = None
        RunDir(self.run_dir).join_note(go.group).with_suffix(".go").unlink(missing_ok=True)
        self._inbox.put(Abandoned(go.group))

    def _expire(self, now: float) -> None:
        for group, pending in list(self._pending.items()):
            if now > pending.deadline_s:
                missing = sorted(set(range(1, pending.size)) - pending.hellos.keys())
                if pending.proven:
                    raise PlaneError(f"base ranks {missing} never said hello")
                self._drop(group, f"ranks {missing} sent no hello in {self.hello_timeout_s:g} s")

    def _join(self, now: float) -> None:
        """Give the oldest announcement its go, then accept its connection (one at a
        time: the doorman bounds the wait)."""
        if self._go is None:
            self._go = self._announced(now)
        go = self._go
        if go is None or go.link is not None:
            return
        if not FORK_LOCK.acquire(blocking=False):
            return  # MPICH crashed in Accept while a child forked after MPI_Init was alive
        try:
            t0 = time.monotonic()
            if self.doorman is not None:
                self.doorman.arm(self.accept_timeout_s)
            intercomm = self.MPI.COMM_SELF.Accept(self.port)
            if self.doorman is not None:
                self.doorman.disarm()
            link = intercomm.Merge(high=False)
            intercomm.Free()
        finally:
            FORK_LOCK.release()
        self.timings.accept_s.append(time.monotonic() - t0)
        self._accepted += 1
        go.tries += 1
        go.link = f"#{self._accepted}"
        self._links[go.link] = link
        deadline = time.monotonic() + self.hello_timeout_s
        self._pending[go.link] = _Pending(link.size, False, deadline, go.issued_s)

    def _announced(self, now: float) -> _Go | None:
        for path in sorted(RunDir(self.run_dir).joins.glob("*.json")):
            try:
                group = str(json.loads(path.read_text())["group"])
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                continue  # being written
            path.unlink()  # (read every pump turn: the folder holds what waits only)
            go = _Go(group, os.urandom(NONCE_BYTES), now)
            write_private(RunDir(self.run_dir).join_note(group).with_suffix(".go"), go.nonce.hex())
            return go
        return None


# ---------------------------------------------------------------------- member side
class WorkerPlane:
    """One member: a base rank or a rank of an elastic job component."""

    def __init__(
        self,
        link: Any,
        member_id: str,
        *,
        elastic: bool,
        key: str = "",
        nonce: bytes = b"",
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        self.MPI = _mpi()
        self.link = link
        self.member_id = member_id
        self.elastic = elastic
        self.key = key
        self.nonce = nonce
        self.heartbeat_interval_s = heartbeat_interval_s
        self._last_beat = 0.0
        self.joined = False  # its hello went out: the master counts it as a member

    @classmethod
    def base(cls, *, heartbeat_interval_s: float = 1.0) -> WorkerPlane:
        world = _mpi().COMM_WORLD
        return cls(
            world.Dup(),
            base_member_id(world.rank),
            elastic=False,
            heartbeat_interval_s=heartbeat_interval_s,
        )

    @classmethod
    def join(
        cls,
        run_dir: str | Path,
        group: str,
        key: str,
        *,
        timeout_s: float = 300.0,
        heartbeat_interval_s: float = 1.0,
    ) -> WorkerPlane:
        """Connect this component (all its ranks, collectively) to the master."""
        MPI = _mpi()
        run = RunDir(Path(run_dir))
        local = MPI.COMM_WORLD
        deadline = time.monotonic() + timeout_s
        while not run.mpi_port.exists():
            if time.monotonic() > deadline:
                raise PlaneError(f"{run.mpi_port}: no master port after {timeout_s:g} s")
            time.sleep(0.1)
        port = run.mpi_port.read_text()
        nonce = bytearray(NONCE_BYTES)
        if local.rank == 0:
            note = {"group": group, "size": local.size, "pid": os.getpid()}
            write_private(run.join_note(group), json.dumps(note))
            go = run.join_note(group).with_suffix(".go")
            while not go.exists():  # one component connects at a time (see module doc)
                if time.monotonic() > deadline:
                    raise PlaneError(f"{group}: the master never accepted (no {go})")
                time.sleep(0.01)
            nonce[:] = bytes.fromhex(go.read_text())
            go.unlink()
        local.Bcast([nonce, MPI.BYTE], root=0)
        intercomm = local.Connect(port, root=0)
        link = intercomm.Merge(high=True)
        intercomm.Free()
        return cls(
            link,
            member_id_at(group, local.rank + 1),  # (Merge high: after the master)
            elastic=True,
            key=key,
            nonce=bytes(nonce),
            heartbeat_interval_s=heartbeat_interval_s,
        )

    def report(self, body: ReportBody, seq: int = -1) -> None:
        """Send ``body`` to the master (``seq``: the command it acknowledges); a hello
        from an elastic rank goes with its proof."""
        if isinstance(body, Hello) and self.elastic:
            proof = hello_proof(self.key, self.nonce, self.member_id, body)
            body = msgspec.structs.replace(body, proof=proof)
        data = encode(Report(self.member_id, seq, body))
        self.link.Send([data, self.MPI.BYTE], dest=0, tag=TAG_REPORT)
        self.joined = self.joined or isinstance(body, Hello)

    def next_command(self, timeout_s: float) -> Command | None:
        """Wait up to ``timeout_s`` for a command, heartbeating meanwhile."""
        deadline = time.monotonic() + timeout_s
        status = self.MPI.Status()
        while True:
            now = time.monotonic()
            if now - self._last_beat >= self.heartbeat_interval_s:
                self._last_beat = now
                self.report(Heartbeat())
            if self.link.Iprobe(0, TAG_COMMAND, status):
                cmd = _receive(self.link, status, decode_command, "the master")
                if cmd is not None:
                    return cmd
                continue
            if now >= deadline:
                return None
            time.sleep(0.005)

    def disconnect(self) -> None:
        """Leave the plane: an elastic rank disconnects from the master (who does too)."""
        if self.elastic:
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


__all__ = ["MASTER_ID", "MasterPlane", "PlaneError", "WorkerPlane", "hello_proof", "member_info"]
