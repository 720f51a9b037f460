"""A weight-group member without an engine, for tests/test_weights.py: it serves, over
the real engine RPC, the calls a trainer's :class:`~pearl_hpc.train.sync.WeightSync`
makes of an engine (join and leave a group, receive a version, no shared copy, stats)
with the real :class:`~pearl_hpc.weights.group.WeightGroup` and receiver, and holds what
it received.

    python -m tests.weight_member KEY     (prints its RPC port, then serves)
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

from pearl_hpc.engine.rpc import serve
from pearl_hpc.engine.store import StoreClient
from pearl_hpc.engine.types import Timing, WeightsRefused, WorkerStats
from pearl_hpc.weights.group import WeightGroup, receive_weights
from pearl_hpc.weights.wire import digest as digest_of


async def main(key: str) -> None:
    groups: dict[str, tuple[WeightGroup, Any]] = {}
    held = [0]

    async def leave_weights_group(name: str) -> None:
        joined = groups.pop(name, None)
        if joined is not None:
            joined[0].close()
            joined[1].close()

    async def join_weights_group(
        name: str, host: str, port: int, prefix: str, rank: int, size: int, backend: str
    ) -> None:
        await leave_weights_group(name)
        store = await asyncio.to_thread(StoreClient, host, port, key)
        group = await asyncio.to_thread(WeightGroup, store, prefix, rank, size, backend)
        groups[name] = (group, store)

    async def receive_weights_(group: str, digest: bytes, p2p: bool = False) -> Timing:
        wg = groups[group][0]
        version, named, recv_s = await asyncio.to_thread(receive_weights, wg, 0, p2p=p2p)
        if digest_of(named) != digest:
            raise WeightsRefused(f"v{version}: not the trainer's digest")
        held[0] = version
        return Timing("broadcast", recv_s, {})

    async def shares_memory(path: str, token: str) -> bool:
        return False

    async def weights_share() -> dict[str, Any]:
        return {"host": socket.gethostname()}  # no shared copy: each takes the broadcast

    async def stats() -> WorkerStats:
        return WorkerStats("member", None, False, held[0], 0, 0, 0, 0, 0)

    handlers = {
        "join_weights_group": join_weights_group,
        "leave_weights_group": leave_weights_group,
        "receive_weights": receive_weights_,
        "shares_memory": shares_memory,
        "weights_share": weights_share,
        "stats": stats,
    }
    server = await serve(handlers, key)  # type: ignore[arg-type]
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
