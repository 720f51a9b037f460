"""The doorman: frees a master waiting in ``Accept`` for a joiner that died.

MPI's ``Accept`` has no timeout, and a joiner can die between announcing itself and
connecting. The doorman is a small process the master starts **before** ``MPI_Init`` (a
child forked after it crashed MPICH's ``Accept``). Before each ``Accept`` the master's
pump arms it with a deadline, after it disarms it; a deadline that passes armed makes the
doorman launch a one-rank MPI process (``mpiexec.gforker -n 1 ... knock``) that connects to the
master's port and sends one :data:`~pearl_hpc.comm.mpi.TAG_KNOCK` message, so that
``Accept`` returns and the pump drops that connection.

    master pump ──"arm 3.0"──> doorman ──(3 s, not disarmed)──> gforker -n 1 ... knock
                ──"disarm"───>                                   Connect, knock, exit

Protocol on the doorman's stdin: one line per order, ``arm SECONDS`` or ``disarm``; it
ends when stdin closes (the master died or finished).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from pearl_hpc.comm.mpiexec import one_node

KNOCK_TIMEOUT_S = 60.0  # a knock that found no Accept by then is killed


class Doorman:
    """The master's handle on its doorman process (start it before ``MPI_Init``)."""

    def __init__(self, port_file: Path, gforker: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pearl_hpc.comm.doorman", "serve", str(port_file), gforker],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a terminal's ^C is the master's to handle
        )
        self._stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]

    def arm(self, seconds: float) -> None:
        self._order(f"arm {seconds:g}")

    def disarm(self) -> None:
        self._order("disarm")

    def _order(self, line: str) -> None:
        try:
            self._stdin.write(line + "\n")
            self._stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the doorman is gone: an Accept is unguarded, as without one

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            self._stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _serve(port_file: str, gforker: str) -> int:
    """The doorman's loop: wait for an order; an armed deadline that passes knocks."""
    knocks: list[tuple[subprocess.Popen[bytes], float]] = []
    orders = _Orders(sys.stdin.fileno())
    while (order := orders.next(None)) is not None:
        if not order.startswith("arm "):
            continue
        if orders.next(float(order.split()[1])) is not None:
            continue  # disarmed in time
        if orders.closed:
            break
        argv = [*one_node(1, gforker), sys.executable, "-m", "pearl_hpc.comm.doorman"]
        quiet = subprocess.DEVNULL  # stdin too: a launcher forwards its stdin (the orders)
        proc = subprocess.Popen(
            [*argv, "knock", port_file],
            stdin=quiet,
            stdout=quiet,
            stderr=quiet,
            start_new_session=True,  # the launcher and its rank, killed as one
        )
        knocks.append((proc, time.monotonic()))
        knocks = _reap(knocks)
    for proc, _ in knocks:
        _kill(proc)
    return 0


class _Orders:
    """Lines from a pipe, each waited for with a timeout (no buffering behind select)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.closed = False

    def next(self, timeout_s: float | None) -> str | None:
        """The next line; None at the timeout or once the pipe closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            if self.closed:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 4096)
            self.closed = not chunk
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def _reap(
    knocks: list[tuple[subprocess.Popen[bytes], float]],
) -> list[tuple[subprocess.Popen[bytes], float]]:
    """Knocks still running (one past ``KNOCK_TIMEOUT_S`` is killed)."""
    alive = []
    for proc, since in knocks:
        if proc.poll() is None and time.monotonic() - since > KNOCK_TIMEOUT_S:
            _kill(proc)
            proc.wait()
        elif proc.poll() is None:
            alive.append((proc, since))
    return alive


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """A knock's launcher and its rank (its process group) killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _knock(port_file: str) -> int:
    """Connect to the master's port, say "knock" and leave without a word more (the
    master frees its side; ``MPI_Finalize`` would wait for it)."""
    from mpi4py import MPI

    from pearl_hpc.comm.mpi import TAG_KNOCK

    port = Path(port_file).read_text()
    intercomm = MPI.COMM_SELF.Connect(port)
    link = intercomm.Merge(high=True)
    link.Send([b"knock", MPI.BYTE], dest=0, tag=TAG_KNOCK)
    time.sleep(2.0)  # delivered before the process goes
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        sys.exit(_serve(sys.argv[2], sys.argv[3]))
    sys.exit(_knock(sys.argv[2]))
