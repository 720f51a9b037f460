"""Elastic engine ranks, whoever starts them (a local ``mpiexec``, a hetjob's ``srun``).

    attach(gpu_ids) ──the rank on those GPUs admitted to the world──> RankWorker: its
                      engine socket, connected (the executor drives it)

Both backends start elastic ranks the same way (``python -m pearl_hpc.rank join``:
Connect + Merge into the run's world, see :mod:`pearl_hpc.comm.members`) and reach
their engines through :func:`attach_rank`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pearl_hpc.comm.members import Members
from pearl_hpc.engine.client import EngineClient
from pearl_hpc.engine.types import EngineError


class RankWorker:
    """An elastic rank's engine worker, as the executor drives it: it leaves the world
    with its capacity (``release``), not when stopped; ``kill`` (its engine socket died)
    fails the rank and gives its capacity back."""

    def __init__(
        self,
        worker_id: str,
        member_id: str,
        client: EngineClient,
        address: tuple[str, int],
        kill: Callable[[], None],
    ) -> None:
        self.worker_id = worker_id
        self.member_id = member_id
        self.client = client
        self.address = address
        self._kill = kill
        self._closing: asyncio.Task[None] | None = None

    async def stop(self, timeout_s: float = 60.0) -> None:
        await self.client.close()

    def kill(self) -> None:
        """Its rank failed: the rank out of the world, its capacity back, and its engine
        client closed, so the turns in flight on it fail over now."""
        self._kill()
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self.client.close())


async def attach_rank(
    members: Members,
    gpu_ids: tuple[str, ...],
    key: str,
    timeout_s: float,
    *,
    tag: str,
    ended: Callable[[], str | None],
    release: Callable[[], None],
) -> RankWorker:
    """Connect to the engine socket of the rank that holds ``gpu_ids`` once it is
    admitted to the world. ``ended()`` says why the rank can no longer come (its job or
    launch ended), None while it may; ``release`` gives its capacity back."""
    deadline = time.monotonic() + timeout_s
    while (joined := members.engine_on(gpu_ids)) is None:
        why = ended()
        if why is not None:
            raise EngineError(f"elastic component {tag} ended before its rank joined: {why}")
        if time.monotonic() > deadline:
            raise EngineError(f"the rank of {tag} did not join within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)
    member, hello = joined
    client = EngineClient(tag)
    await client.connect(hello.host, hello.port, key)

    def kill() -> None:  # its engine socket died: so did the rank, or it will
        members.fail(member, "its engine socket died")
        release()

    return RankWorker(tag, member, client, (hello.host, hello.port), kill)
