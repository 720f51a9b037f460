"""A few real engine workers for tests, driven from a background event loop.

pytest-asyncio is not used: the fleet owns one event loop in a thread and tests run
coroutines on it with :meth:`Fleet.run`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pearl_hpc.core.types import Role
from pearl_hpc.engine.client import WorkerProcess, spawn_worker
from pearl_hpc.engine.rpc import new_key
from pearl_hpc.engine.spec import EngineSpec

T = TypeVar("T")


class Fleet:
    def __init__(self, model_dir: str, run_dir: Path, max_model_len: int = 1024) -> None:
        self.spec = EngineSpec(model_dir=model_dir, max_model_len=max_model_len)
        self.run_dir = run_dir
        self.key = new_key()
        self.workers: dict[str, WorkerProcess] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, roles: dict[str, Role | None]) -> None:
        async def spawn_all() -> list[WorkerProcess]:
            return list(
                await asyncio.gather(
                    *[
                        spawn_worker(
                            self.spec, wid, run_dir=self.run_dir, key=self.key, role=role, slot_id=i
                        )
                        for i, (wid, role) in enumerate(roles.items())
                    ]
                )
            )

        for proc in self.run(spawn_all()):
            self.workers[proc.worker_id] = proc

    def client(self, worker_id: str) -> Any:
        return self.workers[worker_id].client

    def close(self) -> None:
        async def stop_all() -> None:
            await asyncio.gather(*[w.stop() for w in self.workers.values()], return_exceptions=True)

        try:
            self.run(stop_all(), timeout_s=120)
        finally:
            for w in self.workers.values():
                w.kill()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
