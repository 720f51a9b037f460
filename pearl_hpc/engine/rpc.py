"""A small authenticated RPC over asyncio TCP streams (router/agent loop <-> engine worker).

Frames are a 4-byte big-endian length and a pickle. Pickle from a socket runs code, so
every connection first proves it knows the run's key: the server sends a random nonce,
the client answers ``HMAC-SHA256(key, nonce)``, anything else is dropped. The key is
generated per run and handed to workers through the environment, never on a command line.

Calls are multiplexed: ``(call_id, op, kwargs)`` goes out, ``(call_id, ok, value)`` comes
back, in any order, so one connection carries every in-flight turn of a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from pearl_hpc.engine.types import Draining, EngineError

log = logging.getLogger(__name__)

KEY_ENV = "PEARL_ENGINE_KEY"  # hex key shared by a run's processes
_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 30
_NONCE_BYTES = 16


def new_key() -> str:
    return os.urandom(32).hex()


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_FRAME:
        raise EngineError(f"rpc frame of {size} bytes is over the {_MAX_FRAME} limit")
    return pickle.loads(await reader.readexactly(size))


def _write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_HEADER.pack(len(data)) + data)


def _digest(key: str, nonce: bytes) -> bytes:
    return hmac.new(bytes.fromhex(key), nonce, hashlib.sha256).digest()


Handler = Callable[..., Awaitable[Any]]


async def serve(
    handlers: dict[str, Handler], key: str, host: str = "127.0.0.1", port: int = 0
) -> asyncio.Server:
    """Serve ``handlers[op](**kwargs)``; each call runs in its own task."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = os.urandom(_NONCE_BYTES)
        writer.write(nonce)
        try:
            answer = await asyncio.wait_for(reader.readexactly(32), timeout=10)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if not hmac.compare_digest(answer, _digest(key, nonce)):
            log.warning("rpc: refused a connection with a bad key")
            writer.close()
            return
        tasks: set[asyncio.Task[None]] = set()

        async def run_call(call_id: int, op: str, kwargs: dict[str, Any]) -> None:
            try:
                handler = handlers.get(op)
                if handler is None:
                    raise EngineError(f"unknown rpc op {op!r}; known: {sorted(handlers)}")
                reply: tuple[int, bool, Any] = (call_id, True, await handler(**kwargs))
            except Exception as exc:
                reply = (call_id, False, (type(exc).__name__, str(exc)))
            with contextlib.suppress(ConnectionError, RuntimeError):
                _write_frame(writer, reply)
                await writer.drain()

        try:
            while True:
                call_id, op, kwargs = await _read_frame(reader)
                task = asyncio.create_task(run_call(call_id, op, kwargs))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(on_connect, host, port)


class RpcClient:
    """One connection to a worker; many concurrent calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._reader_task: asyncio.Task[None] | None = None

    async def connect(self, host: str, port: int, key: str) -> None:
        self._reader, self._writer = await asyncio.open_connection(host, port)
        nonce = await self._reader.readexactly(_NONCE_BYTES)
        self._writer.write(_digest(key, nonce))
        await self._writer.drain()
        self._reader_task = asyncio.create_task(self._read_replies())

    async def _read_replies(self) -> None:
        assert self._reader is not None
        error: Exception = EngineError(f"{self.name}: connection closed")
        try:
            while True:
                call_id, ok, value = await _read_frame(self._reader)
                fut = self._pending.pop(call_id, None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    kind, message = value
                    cls = Draining if kind == "Draining" else EngineError
                    fut.set_exception(
                        cls(f"{self.name}: {message}" if kind != "Draining" else message)
                    )
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            error = EngineError(f"{self.name}: connection lost ({exc.__class__.__name__})")
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(error)
            self._pending.clear()

    async def call(self, op: str, **kwargs: Any) -> Any:
        if self._writer is None or self._reader_task is None or self._reader_task.done():
            raise EngineError(f"{self.name}: not connected")
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        _write_frame(self._writer, (call_id, op, kwargs))
        await self._writer.drain()
        return await fut

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task
