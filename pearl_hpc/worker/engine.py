"""An engine rank of the run's MPI world: one vLLM engine, started without one.

The master reaches the engine on two channels:

    MPI control plane (this rank's control thread): LEAVE, SHUTDOWN; heartbeats
    engine socket (:mod:`pearl_hpc.engine.rpc`, the asyncio loop of the main thread):
        activate / set_role / drain / deactivate / weights / generate -- the per-turn
        request path, as vLLM's own API is a socket

The rank announces the socket's address in its hello (and in its ready file,
:meth:`pearl_hpc.rundir.RunDir.engine_ready`).
Every engine rank joins the master with Connect + Merge and a signed hello, and leaves
with LEAVE + Disconnect: an elastic rank (a component of an elastic job) when its
capacity goes back, a base engine rank (a launch of its own, started again if it dies)
at the run's end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from pearl_hpc.comm.layout import RankSpec
from pearl_hpc.comm.messages import Ack, Failed, Hello, Op
from pearl_hpc.comm.mpi import WorkerPlane
from pearl_hpc.engine.server import EngineService, write_ready
from pearl_hpc.engine.spec import EngineSpec


def engine_rank_id(me: RankSpec) -> str:
    """An engine rank's worker id (and ready file name): ``rank3-rsv:0``."""
    return f"rank{me.rank}-" + "-".join(me.gpu_ids)


def serve_engine(
    connect: Callable[[], WorkerPlane],
    spec: EngineSpec,
    worker_id: str,
    ready_file: Path,
    key: str,
    hello: Hello,
    host: str,
    master_alive: Callable[[], bool] = lambda: True,
    *,
    left_mark: Callable[[str], Path] | None = None,
) -> int:
    """Serve until the master's SHUTDOWN (or LEAVE): the engine socket on this thread's
    asyncio loop, the control plane on a thread of its own. ``connect`` gives the plane
    once the socket listens (an elastic rank Connects only then, so that the master,
    which Accepts it between two polls, has its hello at once). ``master_alive`` false:
    the master is gone (an elastic rank outlives it otherwise): the rank ends.
    ``left_mark(group)``: a base engine rank's, whose LEAVE comes at the run's end: the
    file it writes then (its launcher does not start it again) before it ends."""

    async def serve() -> int:
        service = EngineService(spec, worker_id)
        # Slurm's --signal without B: reaches every process of the step: the master acts
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        ready = await service.start(key, host=host, port=0, role="none")
        write_ready(ready_file, ready)
        plane = await asyncio.to_thread(connect)
        plane.report(msgspec.structs.replace(hello, host=ready["host"], port=int(ready["port"])))
        loop = asyncio.get_running_loop()
        control = threading.Thread(
            target=_control,
            args=(plane, loop, service, master_alive, left_mark),
            name="control",
            daemon=True,
        )
        control.start()
        await service.serve_until_stopped()
        await asyncio.to_thread(control.join, 10.0)
        return 0

    return asyncio.run(serve())


def _control(
    plane: WorkerPlane,
    loop: asyncio.AbstractEventLoop,
    service: EngineService,
    master_alive: Callable[[], bool],
    left_mark: Callable[[str], Path] | None = None,
) -> None:
    """The rank's MPI side: heartbeats, LEAVE and SHUTDOWN (the only thread that calls
    MPI). ``left_mark``: see :func:`serve_engine`."""
    checked = time.monotonic()
    while True:
        cmd = plane.next_command(0.02)
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not master_alive():  # nobody to leave to: MPI_Finalize would wait for it
                print(f"{plane.member_id}: the master is gone; exiting", flush=True)
                os._exit(0)
        if cmd is None:
            continue
        if cmd.op is Op.LEAVE:
            # an elastic rank whose job is reclaimed or given back: out of the world at
            # once; the engine socket serves on while the
            # master drains it, and the job's end (scancel) ends the process
            plane.report(Ack(cmd.op), cmd.seq)
            plane.disconnect()
            if left_mark is not None:
                left_mark(plane.member_id.rsplit(":", 1)[0]).touch()
                loop.call_soon_threadsafe(service.stop)
            return
        elif cmd.op is Op.SHUTDOWN:
            plane.report(Ack(cmd.op), cmd.seq)
            loop.call_soon_threadsafe(service.stop)
            return
        else:
            plane.report(Failed(f"engine rank: unexpected {cmd.op}"), cmd.seq)
