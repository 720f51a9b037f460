"""The trainer's rendezvous store, behind the run's key.

Weight groups (trainer 0 and the engines off its node) and the trainer ranks' own groups
(FSDP's default group, the replicated ranks' gradient group) meet in a key-value store:
gloo and NCCL find each other's addresses in it. torch's ``TCPStore`` listens on every
interface whatever host it is given and asks no one for anything, so another user of the
cluster could read those addresses, plant their own and join a group (and push keys
until the trainer runs out of memory). This store is served over
:mod:`pearl_hpc.engine.rpc` instead:

- bound to the configured host (loopback for a one-node run);
- every connection proves the run's key before any key is read or written;
- at most ``max_keys`` keys and ``max_bytes`` bytes of values (rendezvous needs a few
  hundred bytes a rank);

and each process reaches it through :class:`StoreClient`, a ``torch.distributed.Store``
that ``ProcessGroupGloo``/``ProcessGroupNCCL`` rendezvous over like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pearl_hpc.engine.rpc import RpcClient, serve
from pearl_hpc.engine.types import EngineError

MAX_KEYS = 65_536
MAX_BYTES = 64 << 20


class _Loop:
    """An asyncio loop on a daemon thread of its own: the store serves (and a client
    calls) from threads torch owns, never from the caller's loop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        """End every task (a connection's closes its socket while the loop runs), then
        the loop."""

        async def end_tasks() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.run(end_tasks(), 5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


class _Table:
    """The keys and values; every op runs on the store's loop (no locks)."""

    def __init__(self, max_keys: int, max_bytes: int) -> None:
        self.values: dict[str, bytes] = {}
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self.used = 0
        self.changed = asyncio.Condition()

    def _put(self, key: str, value: bytes) -> None:
        old = self.values.get(key)
        used = self.used + len(value) - (len(old) if old is not None else 0)
        if old is None and len(self.values) >= self.max_keys:
            raise EngineError(f"store: {self.max_keys} keys already; {key!r} refused")
        if used > self.max_bytes:
            raise EngineError(f"store: {key!r} would take it past {self.max_bytes} bytes")
        self.values[key], self.used = value, used

    async def _changed(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _until(self, keys: list[str], timeout_s: float) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: all(k in self.values for k in keys)), timeout_s
                )
            except TimeoutError:
                missing = [k for k in keys if k not in self.values]
                raise EngineError(f"store: {missing} not set within {timeout_s:.0f} s") from None

    async def set(self, key: str, value: bytes) -> None:
        self._put(key, value)
        await self._changed()

    async def get(self, key: str, timeout_s: float) -> bytes:
        await self._until([key], timeout_s)
        return self.values[key]

    async def add(self, key: str, amount: int) -> int:
        total = int(self.values.get(key, b"0")) + amount
        self._put(key, str(total).encode())
        await self._changed()
        return total

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.values.get(key)
        if (current is None and not expected) or current == expected:
            self._put(key, desired)
            await self._changed()
            return desired
        return current if current is not None else expected

    async def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    async def wait(self, keys: list[str], timeout_s: float) -> None:
        await self._until(keys, timeout_s)

    async def delete_key(self, key: str) -> bool:
        value = self.values.pop(key, None)
        if value is None:
            return False
        self.used -= len(value)
        return True

    async def num_keys(self) -> int:
        return len(self.values)


class KeyStore:
    """The store's server (trainer 0), on ``host`` (port 0: any free one)."""

    def __init__(
        self,
        key: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_keys: int = MAX_KEYS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.host, self.key = host, key
        self._loop = _Loop("pearl-store")

        async def start() -> tuple[_Table, asyncio.Server]:
            table = _Table(max_keys, max_bytes)
            ops = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys")
            return table, await serve({op: getattr(table, op) for op in ops}, key, host, port)

        self.table, self._server = self._loop.run(start())
        self.port = int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()

        if self._loop.loop.is_running():
            self._loop.run(stop(), 5)
        self._loop.stop()


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` over one authenticated connection to a
    :class:`KeyStore`; gloo and NCCL call it from their own threads."""

    def __init__(self, host: str, port: int, key: str, timeout_s: float = 120.0) -> None:
        super().__init__()
        self.address = (host, port)
        self.timeout_s = timeout_s
        self._loop = _Loop("pearl-store-client")
        self._rpc = RpcClient(f"store {host}:{port}")
        try:
            self._loop.run(self._rpc.connect(host, port, key), timeout_s)
        except BaseException:
            self._loop.stop()
            raise

    def _call(self, op: str, returns: Any = Any, **kwargs: Any) -> Any:
        # a bit past the server's own wait, so its error (which keys) is what arrives
        return self._loop.run(self._rpc.call(op, returns, **kwargs), self.timeout_s + 10)

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key=key, value=_bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", bytes, key=key, timeout_s=self.timeout_s))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", int, key=key, amount=amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(
            self._call("compare_set", bytes, key=key, expected=_bytes(expected),
                       desired=_bytes(desired))
        )  # fmt: skip

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", bool, keys=list(keys)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = self.timeout_s if timeout is None else timeout.total_seconds()
        self._call("wait", keys=list(keys), timeout_s=timeout_s)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", bool, key=key))

    def num_keys(self) -> int:
        return int(self._call("num_keys", int))

    def close(self) -> None:
        """Drop the connection and the client's thread (a group over it is unusable
        afterwards: NCCL meets in the store again for each new communicator)."""
        if self._loop.loop.is_running():
            self._loop.run(self._rpc.close(), 5)
        self._loop.stop()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
