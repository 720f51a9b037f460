"""Start engine worker processes and talk to them.

proc = await spawn_worker(spec, "w0", role=Role.COLOCATED, run_dir=tmp, key=key)
result = await proc.client.generate(TurnRequest(...))
await proc.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pearl_hpc.core.tracker import IterationRecord
from pearl_hpc.core.types import Role
from pearl_hpc.engine.rpc import RpcClient, write_key
from pearl_hpc.engine.spec import EngineSpec
from pearl_hpc.engine.types import EngineError, Timing, TurnRequest, TurnResult, WorkerStats

START_TIMEOUT_S = 300.0


class EngineClient:
    """Typed calls to one engine worker."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._rpc = RpcClient(worker_id)

    async def connect(self, host: str, port: int, key: str) -> None:
        await self._rpc.connect(host, port, key)

    def when_lost(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` once if the connection ends other than by :meth:`close`
        (the worker died or fell silent), calls in flight or not."""
        self._rpc.on_lost = callback

    async def generate(self, request: TurnRequest) -> TurnResult:
        result: TurnResult = await self._rpc.call("generate", TurnResult, request=request)
        return result

    async def drain(self) -> list[TurnResult]:
        partial: list[TurnResult] = await self._rpc.call("drain", list[TurnResult])
        return partial

    async def admit(self) -> None:
        await self._rpc.call("admit")

    async def set_role(self, role: Role) -> Timing:
        timing: Timing = await self._rpc.call("set_role", Timing, role=str(role))
        return timing

    async def release(self) -> Timing:
        timing: Timing = await self._rpc.call("release", Timing)
        return timing

    async def restore(self, role: Role) -> Timing:
        timing: Timing = await self._rpc.call("restore", Timing, role=str(role))
        return timing

    async def activate(
        self, role: Role, weights: bytes | None = None, version: int | None = None
    ) -> Timing:
        timing: Timing = await self._rpc.call(
            "activate", Timing, role=str(role), weights=weights, version=version
        )
        return timing

    async def deactivate(self) -> tuple[Timing, list[TurnResult]]:
        out: tuple[Timing, list[TurnResult]] = await self._rpc.call(
            "deactivate", tuple[Timing, list[TurnResult]]
        )
        return out

    async def load_weights(
        self, version: int, data: bytes | None = None, path: str | None = None
    ) -> Timing:
        timing: Timing = await self._rpc.call(
            "load_weights", Timing, version=version, data=data, path=path
        )
        return timing

    async def join_weights_group(
        self,
        name: str,
        host: str,
        port: int,
        prefix: str,
        rank: int,
        size: int,
        backend: str = "gloo",
    ) -> None:
        await self._rpc.call(
            "join_weights_group",
            name=name,
            host=host,
            port=port,
            prefix=prefix,
            rank=rank,
            size=size,
            backend=backend,
        )

    async def leave_weights_group(self, name: str) -> None:
        await self._rpc.call("leave_weights_group", name=name)

    async def receive_weights(self, group: str, digest: bytes, p2p: bool = False) -> Timing:
        timing: Timing = await self._rpc.call(
            "receive_weights", Timing, group=group, digest=digest, p2p=p2p
        )
        return timing

    async def shares_memory(self, probe_path: str, token: str) -> bool:
        return bool(await self._rpc.call("shares_memory", bool, path=probe_path, token=token))

    async def map_weights(self, path: str, header: dict[str, Any]) -> Timing:
        timing: Timing = await self._rpc.call("map_weights", Timing, path=path, header=header)
        return timing

    async def weights_share(self) -> dict[str, Any]:
        share: dict[str, Any] = await self._rpc.call("weights_share", dict[str, Any])
        return share

    async def stats(self) -> WorkerStats:
        stats: WorkerStats = await self._rpc.call("stats", WorkerStats)
        return stats

    async def telemetry(self) -> list[IterationRecord]:
        records: list[IterationRecord] = await self._rpc.call("telemetry", list[IterationRecord])
        return records

    async def shutdown(self) -> None:
        with contextlib.suppress(EngineError):
            await self._rpc.call("shutdown")

    async def close(self) -> None:
        await self._rpc.close()


_MPI_ENV = ("PMI_", "PMIX_", "MPI_", "MPICH_", "HYDRA_", "OMPI_")


@dataclass
class WorkerProcess:
    """A spawned engine worker: its process, its client and what it reported at start."""

    worker_id: str
    proc: subprocess.Popen[bytes]
    client: EngineClient
    ready: dict[str, Any]
    log_path: Path

    @property
    def start_s(self) -> float | None:
        value = self.ready.get("start_s")
        return float(value) if value is not None else None

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the worker to shut down; kill it if it does not within ``timeout_s``."""
        if self.proc.poll() is None:
            await self.client.shutdown()
        await self.client.close()
        try:
            await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def spawn_worker(
    spec: EngineSpec,
    worker_id: str,
    *,
    run_dir: Path,
    key: str,
    role: Role | None = Role.COLOCATED,
    slot_id: int = 0,
    kv_port: int = 0,
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """Start ``python -m pearl_hpc.engine.server`` and connect once its engine is up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ready_file = run_dir / f"{worker_id}.ready.json"
    ready_file.unlink(missing_ok=True)
    log_path = run_dir / f"{worker_id}.log"
    key_file = write_key(run_dir / f"{worker_id}.key", key)
    cmd = [
        sys.executable,
        "-m",
        "pearl_hpc.engine.server",
        "--key-file",
        str(key_file),
        "--spec",
        (replace(spec, kv_side_channel_port=kv_port) if kv_port else spec).to_json(),
        "--worker-id",
        worker_id,
        "--slot-id",
        str(slot_id),
        "--role",
        str(role) if role is not None else "none",
        "--ready-file",
        str(ready_file),
        "--parent-pid",
        str(os.getpid()),
    ]
    # a child of an MPI rank must not take its launcher's PMI wiring for its own
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV)}
    child_env = {**inherited, **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready_file.exists():
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EngineError(
                f"engine worker {worker_id} exited with {proc.returncode} "
                f"before it was ready; log {log_path}:\n{tail}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise EngineError(
                f"engine worker {worker_id} not ready after {START_TIMEOUT_S:.0f} s; see {log_path}"
            )
        await asyncio.sleep(0.1)
    ready = json.loads(ready_file.read_text())
    client = EngineClient(worker_id)
    await client.connect(ready["host"], int(ready["port"]), key)
    return WorkerProcess(worker_id, proc, client, ready, log_path)
