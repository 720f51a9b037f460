"""The executor's fault bookkeeping (a unit test of one module): a dead engine worker
that fails every turn it had in flight is reported once and dropped once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pearl_hpc.core.controller import WorkerFailed
from pearl_hpc.core.table import RoleTable
from pearl_hpc.master.executor import WorkerExecutor, _Worker
from pearl_hpc.rollout.router import Router


class _DeadProc:
    def __init__(self) -> None:
        self.client: Any = None
        self.address = ("127.0.0.1", 0)
        self.kills = 0

    async def stop(self, timeout_s: float = 60.0) -> None:
        pass

    def kill(self) -> None:
        self.kills += 1


def test_a_worker_failing_many_turns_is_one_failure_event(tmp_path: Path) -> None:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    logged: list[tuple[str, dict[str, Any]]] = []
    router = Router(on_failure=lambda worker_id, reason: executor.router_failed(worker_id, reason))
    executor = WorkerExecutor(
        queue=queue,
        router=router,
        weights=None,  # type: ignore[arg-type]
        backend=None,  # type: ignore[arg-type]
        events=lambda kind, **fields: logged.append((kind, fields)),  # type: ignore[arg-type]
        key="k",
        table=RoleTable(),
    )
    proc = _DeadProc()
    executor.workers["el1+0:0"] = _Worker(proc, "el1+0:0", ("el1:0",), slot_id=3)  # type: ignore[arg-type]
    for _ in range(64):  # every turn in flight on it fails
        router.on_failure("s3", "connection lost")  # type: ignore[misc]
    assert queue.qsize() == 1
    failed = queue.get_nowait()
    assert isinstance(failed, WorkerFailed)
    assert [k for k, _ in logged] == ["worker_failed"] and proc.kills == 1
    assert executor.workers == {}
