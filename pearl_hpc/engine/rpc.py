"""A small authenticated RPC over asyncio TCP streams (router/agent loop <-> engine worker).

    client                                   server
      <──────────── nonce_s ───────────────
      ── nonce_c, HMAC(K, "client"|nonce_s|nonce_c) ──>    (wrong: connection dropped)
      <──── HMAC(K, "server"|nonce_s|nonce_c) ─────────    (wrong: EngineError, no call sent)
      session key S = HMAC(K, "session"|nonce_s|nonce_c)
      ── frame: len | msgpack | HMAC(S, "c"|seq|msgpack) ──>   seq counts per direction
      <── frame: len | msgpack | HMAC(S, "s"|seq|msgpack) ──

Both ends prove they hold the run's key ``K`` (a file, 0600: ``RUN_DIR/rpc.key``), and
every frame carries a MAC over its direction and sequence number, so a tampered, replayed,
reordered or reflected frame ends the connection before anything in it is decoded. The
payload is msgpack (msgspec) of plain values -- maps, arrays, strings, numbers, raw bytes
(weights travel as safetensors bytes) -- decoded into the types each side declares
(``msgspec.convert``: a handler's parameter annotations on the server, the expected reply
type on the client). Nothing received can name a type to build or code to run.

Calls are multiplexed: ``[call_id, op, kwargs]`` goes out, ``[call_id, ok, value]`` comes
back, in any order, so one connection carries every in-flight turn of a worker.

A worker that stops answering fails its calls: while any is in flight the client sends a
``ping`` (answered by the server's loop, not by a handler) every quarter of
``liveness_s``; a connection that moved no byte either way for ``liveness_s`` (no frame
in, nothing of what it writes taken by the peer) is closed, and every call in flight
fails at once (the router fails its turns over). That catches a stopped process and a
wedged loop, which TCP keepalive cannot see (the peer's kernel still answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import socket
import struct
import typing
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from pearl_hpc.comm.mpi import write_private
from pearl_hpc.engine.types import Draining, EngineError, WeightsRefused

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_MAX_FRAME = 1 << 30
_NONCE_BYTES = 16
_MAC_BYTES = 32
_HANDSHAKE_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S = 10  # seconds of silence before TCP probes the peer
KEEPALIVE_INTERVAL_S = 2
LIVENESS_S = 10.0  # a call's connection silent this long fails (run.heartbeat_timeout_s)
PING = "ping"  # the op the server's loop answers itself
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()  # plain values only: no extension types


class RpcAuthError(EngineError):
    """A peer that did not prove the run's key, or a frame whose MAC is wrong."""


def new_key() -> str:
    return os.urandom(32).hex()


def write_key(path: str | Path, key: str) -> Path:
    """Write a run's key to a file only its owner can read (replacing any old one)."""
    path = Path(path)
    write_private(path, key)
    return path


def read_key(path: str | Path) -> str:
    """A run's key from its file (refused unless only its owner may read it)."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise EngineError(f"{path}: the key file is readable by others (mode {mode:o}); chmod 600")
    return path.read_text().strip()


def _mac(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:  # no joined copy of a large payload
        mac.update(part)
    return mac.digest()


class _Channel:
    """Framing of one authenticated connection: a MAC and a sequence number per frame."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: bytes,
        *,
        client: bool,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.session = session
        self.out_label, self.in_label = (b"c", b"s") if client else (b"s", b"c")
        self.sent = 0
        self.received = 0

    def send(self, obj: Any) -> None:
        payload = _ENCODER.encode(obj)
        mac = _mac(self.session, self.out_label, _SEQ.pack(self.sent), payload)
        self.sent += 1
        self.writer.writelines((_HEADER.pack(len(payload)), payload, mac))

    async def recv(self) -> Any:
        (size,) = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))
        if size > _MAX_FRAME:
            raise RpcAuthError(f"rpc frame of {size} bytes is over the {_MAX_FRAME} limit")
        payload = await self.reader.readexactly(size)
        mac = await self.reader.readexactly(_MAC_BYTES)
        expected = _mac(self.session, self.in_label, _SEQ.pack(self.received), payload)
        if not hmac.compare_digest(mac, expected):
            raise RpcAuthError("rpc frame with a wrong MAC (tampered, replayed or reordered)")
        self.received += 1
        try:
            return _DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            raise RpcAuthError(f"rpc frame is not msgpack: {exc}") from None


async def _server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes
) -> _Channel:
    nonce_s = os.urandom(_NONCE_BYTES)
    writer.write(nonce_s)
    answer = await reader.readexactly(_NONCE_BYTES + _MAC_BYTES)
    nonce_c, proof = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"client", nonce_s, nonce_c)):
        raise RpcAuthError("a client without the run's key")
    writer.write(_mac(key, b"server", nonce_s, nonce_c))
    await writer.drain()
    return _Channel(reader, writer, _mac(key, b"session", nonce_s, nonce_c), client=False)


async def _client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, name: str
) -> _Channel:
    nonce_s = await reader.readexactly(_NONCE_BYTES)
    nonce_c = os.urandom(_NONCE_BYTES)
    writer.write(nonce_c + _mac(key, b"client", nonce_s, nonce_c))
    await writer.drain()
    try:
        proof = await reader.readexactly(_MAC_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError):
        raise RpcAuthError(f"{name}: the server refused the run's key") from None
    if not hmac.compare_digest(proof, _mac(key, b"server", nonce_s, nonce_c)):
        raise RpcAuthError(f"{name}: the server did not prove it holds the run's key")
    return _Channel(reader, writer, _mac(key, b"session", nonce_s, nonce_c), client=True)


def _typed(value: Any, hint: Any) -> Any:
    """``value`` (plain msgpack data) as the declared type."""
    if hint is Any:
        return value
    try:
        return msgspec.convert(value, hint)
    except msgspec.ValidationError as exc:
        raise EngineError(f"rpc value is not a {hint}: {exc}") from None


Handler = Callable[..., Awaitable[Any]]


async def serve(
    handlers: dict[str, Handler], key: str, host: str = "127.0.0.1", port: int = 0
) -> asyncio.Server:
    """Serve ``handlers[op](**kwargs)``, each argument converted to the handler's
    annotation; each call runs in its own task."""
    secret = bytes.fromhex(key)
    hints = {op: typing.get_type_hints(h) for op, h in handlers.items()}

    async def run_call(channel: _Channel, call_id: int, op: str, kwargs: dict[str, Any]) -> None:
        reply: list[Any]
        try:
            handler = handlers.get(op)
            if op == PING:
                reply = [call_id, True, None]
            elif handler is None:
                raise EngineError(f"unknown rpc op {op!r}; known: {sorted(handlers)}")
            else:
                args = {k: _typed(v, hints[op].get(k, Any)) for k, v in kwargs.items()}
                reply = [call_id, True, await handler(**args)]
        except Exception as exc:
            reply = [call_id, False, [type(exc).__name__, str(exc)]]
        with contextlib.suppress(ConnectionError, RuntimeError):
            channel.send(reply)
            await channel.writer.drain()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task[None]] = set()
        try:
            channel = await asyncio.wait_for(
                _server_handshake(reader, writer, secret), _HANDSHAKE_TIMEOUT_S
            )
            while True:
                frame = await channel.recv()
                call_id, op, kwargs = _typed(frame, tuple[int, str, dict[str, Any]])
                task = asyncio.create_task(run_call(channel, call_id, op, kwargs))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except RpcAuthError as exc:
            log.warning("rpc: dropped a connection: %s", exc)
        except EngineError as exc:
            log.warning("rpc: dropped a connection with a malformed call: %s", exc)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(on_connect, host, port)


def _keepalive(sock: Any) -> None:
    """A peer that vanished without a word (node or NIC loss: no RST) fails the
    connection after about ``KEEPALIVE_IDLE_S + 3 * KEEPALIVE_INTERVAL_S`` of silence,
    and with it every call in flight, instead of when TCP gives up (minutes)."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class RpcClient:
    """One connection to a worker; many concurrent calls."""

    def __init__(self, name: str, liveness_s: float = LIVENESS_S) -> None:
        self.name = name
        self.liveness_s = liveness_s
        self._channel: _Channel | None = None
        self._pending: dict[int, tuple[asyncio.Future[Any], Any]] = {}
        self._ids = itertools.count()
        self._reader_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._moved_s = 0.0  # when the connection last moved a byte (with calls in flight)
        self._silent: EngineError | None = None
        self._closing = False
        # told why, once, when the connection ends other than by close(): the peer died
        # (its socket closed or reset), fell silent, or sent a frame that was refused
        self.on_lost: Callable[[str], None] | None = None

    async def connect(self, host: str, port: int, key: str) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        _keepalive(writer.get_extra_info("socket"))
        try:
            self._channel = await asyncio.wait_for(
                _client_handshake(reader, writer, bytes.fromhex(key), self.name),
                _HANDSHAKE_TIMEOUT_S,
            )
        except BaseException:
            writer.close()
            raise
        self._reader_task = asyncio.create_task(self._read_replies())
        self._watch_task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """While calls are in flight: a ping each quarter of ``liveness_s``; the
        connection closed once it moved nothing for ``liveness_s``."""
        assert self._channel is not None
        transport = self._channel.writer.transport
        buffered = transport.get_write_buffer_size()
        while True:
            await asyncio.sleep(self.liveness_s / 4)
            now = asyncio.get_running_loop().time()
            before, buffered = buffered, transport.get_write_buffer_size()
            if not self._pending or buffered < before:  # idle, or the peer read bytes
                self._moved_s = now
            elif now - self._moved_s > self.liveness_s:
                self._silent = EngineError(
                    f"{self.name}: no reply in {self.liveness_s:g} s with calls in flight "
                    "(the worker is stopped, wedged or unreachable)"
                )
                self._channel.writer.close()  # the reader ends: every call fails
                return
            if self._pending:
                self._channel.send([next(self._ids), PING, {}])  # its reply: _moved_s

    async def _read_replies(self) -> None:
        assert self._channel is not None
        error: Exception = EngineError(f"{self.name}: connection closed")
        try:
            while True:
                frame = await self._channel.recv()
                self._moved_s = asyncio.get_running_loop().time()
                call_id, ok, value = _typed(frame, tuple[int, bool, Any])
                fut, returns = self._pending.pop(call_id, (None, Any))
                if fut is None or fut.done():
                    continue
                if ok:
                    try:
                        fut.set_result(_typed(value, returns))
                    except EngineError as exc:
                        fut.set_exception(EngineError(f"{self.name}: {exc}"))
                    continue
                kind, message = _typed(value, tuple[str, str])
                if kind == "Draining":
                    fut.set_exception(Draining(message))
                else:
                    cls = WeightsRefused if kind == "WeightsRefused" else EngineError
                    fut.set_exception(cls(f"{self.name}: {message}"))
        except RpcAuthError as exc:
            error = EngineError(f"{self.name}: {exc}")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            error = EngineError(f"{self.name}: connection lost ({exc.__class__.__name__})")
        finally:
            error = self._silent or error
            for fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(error)
            self._pending.clear()
            if not self._closing and self.on_lost is not None:
                self.on_lost(str(error))

    async def call(self, op: str, returns: Any = Any, /, **kwargs: Any) -> Any:
        """``op(**kwargs)`` on the worker; the reply converted to ``returns``."""
        if self._channel is None or self._reader_task is None or self._reader_task.done():
            raise EngineError(f"{self.name}: not connected")
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            self._moved_s = loop.time()  # (the first call in flight: silence counts now)
        self._pending[call_id] = (fut, returns)
        try:
            self._channel.send([call_id, op, kwargs])
            await self._channel.writer.drain()
        except ConnectionError as exc:  # the peer died before the reader saw it
            self._pending.pop(call_id, None)
            raise EngineError(f"{self.name}: connection lost ({type(exc).__name__})") from exc
        return await fut

    async def close(self) -> None:
        self._closing = True
        if self._channel is not None:
            self._channel.writer.close()
            with contextlib.suppress(Exception):
                await self._channel.writer.wait_closed()
        for task in (self._reader_task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
