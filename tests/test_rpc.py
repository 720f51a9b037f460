"""The engine RPC refuses everything but authenticated msgpack calls: a pickled payload,
a replayed frame, a tampered frame, a wrong key, a missing key and a server impersonator
are each refused with nothing executed; typed values round-trip."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pearl_hpc.engine import rpc
from pearl_hpc.engine.rpc import RpcAuthError, RpcClient, new_key, read_key, serve, write_key
from pearl_hpc.engine.types import EngineError, Timing, TurnRequest, TurnResult


class _Boom:
    """Unpickling this runs a command (what a pickle-based RPC would execute)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


async def _server(calls: list[Any], key: str) -> tuple[asyncio.Server, int]:
    async def echo(x: int) -> int:
        calls.append(x)
        return x * 2

    async def turn(request: TurnRequest) -> TurnResult:
        calls.append(request)
        return TurnResult(request.request_id, "w", (7, 8), "stop", 3, 2, 0, {"k": [1, 2]}, 0.5)

    async def timing(op: str) -> Timing:
        return Timing(op, 1.5, {"bytes": 10})

    server = await serve({"echo": echo, "turn": turn, "timing": timing}, key)
    return server, server.sockets[0].getsockname()[1]


async def _handshaken(port: int, key: str) -> rpc._Channel:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return await rpc._client_handshake(reader, writer, bytes.fromhex(key), "test")


def _frame(channel: rpc._Channel, payload: bytes, mac_of: bytes | None = None) -> bytes:
    """Client frame 0 of ``channel`` carrying ``payload``, MACed over ``mac_of`` (default:
    the payload itself)."""
    signed = payload if mac_of is None else mac_of
    mac = rpc._mac(channel.session, b"c", rpc._SEQ.pack(0), signed)
    return rpc._HEADER.pack(len(payload)) + payload + mac


async def _closed_by_server(channel: rpc._Channel) -> bool:
    try:
        data = await asyncio.wait_for(channel.reader.read(1), timeout=5)
    except ConnectionError:
        return True
    return data == b""


def test_typed_calls_round_trip_dataclasses_and_errors() -> None:
    async def main() -> None:
        key, calls = new_key(), []
        server, port = await _server(calls, key)
        client = RpcClient("w")
        await client.connect("127.0.0.1", port, key)
        request = TurnRequest("r1", (1, 2, 3), 4, temperature=0.5, kv_transfer_params={"a": 1})
        result = await client.call("turn", TurnResult, request=request)
        assert calls == [request]  # the server got a TurnRequest, equal to the one sent
        assert isinstance(result, TurnResult) and result.token_ids == (7, 8)
        assert result.kv_transfer_params == {"k": [1, 2]}
        assert await client.call("timing", Timing, op="x") == Timing("x", 1.5, {"bytes": 10})
        with pytest.raises(EngineError, match="is not a"):  # a wrong-shaped argument
            await client.call("echo", x="not an int")
        with pytest.raises(EngineError, match="unknown rpc op"):
            await client.call("nope")
        assert await client.call("echo", int, x=21) == 42  # the connection survived
        await client.close()
        server.close()

    asyncio.run(main())


def test_a_peer_lost_while_a_call_is_written_fails_the_call_as_an_engine_error() -> None:
    """The connection is reset under a call before the client's reader saw it (a SIGKILLed
    engine): the caller gets an EngineError (the router fails the turn over), not the
    stream's ConnectionResetError (which ended a rollout)."""

    async def main() -> None:
        key, calls = new_key(), []
        server, port = await _server(calls, key)
        client = RpcClient("w")
        await client.connect("127.0.0.1", port, key)
        assert client._channel is not None

        async def reset() -> None:
            raise ConnectionResetError("Connection lost")

        client._channel.writer.drain = reset  # type: ignore[method-assign]
        with pytest.raises(EngineError, match="w: connection lost"):
            await client.call("echo", int, x=1)
        assert not client._pending  # nothing left waiting for a reply
        await client.close()
        server.close()

    asyncio.run(main())


_SLOW_SERVER = """
import asyncio, sys
from pearl_hpc.engine.rpc import serve

async def slow(s: float) -> float:
    await asyncio.sleep(s)
    return s

async def main():
    server = await serve({"slow": slow}, sys.argv[1])
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_stopped_worker_fails_its_calls_and_a_slow_live_one_does_not() -> None:
    """A call outlasting the liveness window on a live worker returns (its pings are
    answered); the worker SIGSTOPped (a silent node: TCP still answers) fails the call in
    flight after about ``liveness_s``, not never."""
    key = new_key()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SERVER, key], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())

        async def main() -> float:
            client = RpcClient("w", liveness_s=1.0)
            await client.connect("127.0.0.1", port, key)
            assert await client.call("slow", float, s=2.5) == 2.5  # 2.5 liveness windows
            call = asyncio.create_task(client.call("slow", float, s=60.0))
            await asyncio.sleep(0.3)
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(EngineError, match="w: no reply in 1 s with calls in flight"):
                await call
            waited = time.monotonic() - t0
            with pytest.raises(EngineError, match="not connected"):
                await client.call("slow", float, s=0.0)
            await client.close()
            return waited

        waited = asyncio.run(main())
        assert 0.7 < waited < 5.0, waited  # 1 s of silence, checked every 0.25 s
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_that_dies_idle_is_reported_and_a_closed_client_is_not() -> None:
    """``on_lost`` is told when an idle connection's worker dies (SIGKILL: no call in
    flight to fail), once; a client closed by its owner is never reported."""
    key = new_key()
    argv = [sys.executable, "-c", _SLOW_SERVER, key]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:

        async def main() -> tuple[list[str], list[str]]:
            lost: list[str] = []
            closed: list[str] = []
            clients = []
            for proc, told in zip(procs, (lost, closed), strict=True):
                assert proc.stdout is not None
                client = RpcClient("w")
                await client.connect("127.0.0.1", int(proc.stdout.readline()), key)
                client.on_lost = told.append
                clients.append(client)
            procs[0].kill()
            await clients[1].close()
            procs[1].kill()
            for _ in range(100):
                if lost:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            return lost, closed

        lost, closed = asyncio.run(main())
        assert len(lost) == 1 and "w: connection lost" in lost[0], lost
        assert closed == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_pickled_payload_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    payload = pickle.dumps(_Boom(marker))

    async def main() -> None:
        key, calls = new_key(), []
        server, port = await _server(calls, key)
        # without the key: the bytes end the handshake
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await reader.readexactly(16)
        writer.write(rpc._HEADER.pack(len(payload)) + payload)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(1), timeout=5) == b""
        # with the key and a valid MAC: the frame is not msgpack, the connection ends
        channel = await _handshaken(port, key)
        channel.writer.write(_frame(channel, payload))
        await channel.writer.drain()
        assert await _closed_by_server(channel)
        server.close()
        assert calls == []

    asyncio.run(main())
    assert not marker.exists()


def test_a_replayed_frame_is_refused() -> None:
    async def main() -> None:
        key, calls = new_key(), []
        server, port = await _server(calls, key)
        channel = await _handshaken(port, key)
        frame = _frame(channel, rpc._ENCODER.encode([0, "echo", {"x": 1}]))  # valid, first
        channel.writer.write(frame)
        assert (await channel.recv())[1] is True
        channel.writer.write(frame)  # the same frame again, on the same connection
        await channel.writer.drain()
        assert await _closed_by_server(channel)
        # and on a new connection (another session key)
        other = await _handshaken(port, key)
        other.writer.write(frame)
        await other.writer.drain()
        assert await _closed_by_server(other)
        server.close()
        assert calls == [1]  # run once, by the original frame

    asyncio.run(main())


def test_a_tampered_frame_is_refused() -> None:
    async def main() -> None:
        key, calls = new_key(), []
        server, port = await _server(calls, key)
        channel = await _handshaken(port, key)
        payload = rpc._ENCODER.encode([0, "echo", {"x": 1}])
        forged = payload.replace(b"\x01", b"\x05")  # x=5 under x=1's MAC
        channel.writer.write(_frame(channel, forged, mac_of=payload))
        await channel.writer.drain()
        assert await _closed_by_server(channel)
        server.close()
        assert calls == []

    asyncio.run(main())


def test_a_wrong_key_is_refused_at_connect() -> None:
    async def main() -> None:
        key, calls = new_key(), []
        server, port = await _server(calls, key)
        intruder = RpcClient("intruder")
        with pytest.raises(RpcAuthError, match="refused"):
            await intruder.connect("127.0.0.1", port, new_key())
        server.close()
        assert calls == []

    asyncio.run(main())


def test_a_server_that_cannot_prove_the_key_gets_no_call() -> None:
    received: list[bytes] = []

    async def main() -> None:
        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(os.urandom(16))  # a nonce, then a made-up proof
            received.append(await reader.readexactly(48))
            writer.write(os.urandom(32))
            await writer.drain()
            received.append(await reader.read(1 << 16))  # whatever the client sends next

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        client = RpcClient("victim")
        with pytest.raises(RpcAuthError, match="did not prove"):
            await client.connect("127.0.0.1", server.sockets[0].getsockname()[1], new_key())
        await asyncio.sleep(0.2)
        server.close()

    asyncio.run(main())
    assert received[1:] in ([], [b""])  # no call, no frame after the handshake


def test_the_key_is_a_private_file_and_an_engine_without_one_exits_2(tmp_path: Path) -> None:
    path = write_key(tmp_path / "rpc.key", "ab" * 32)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_key(path) == "ab" * 32
    path.chmod(0o644)
    with pytest.raises(EngineError, match="chmod 600"):
        read_key(path)
    spec = '{"model_dir": "m"}'
    base = [sys.executable, "-m", "pearl_hpc.engine.server", "--spec", spec, "--worker-id", "w"]
    base += ["--ready-file", str(tmp_path / "ready.json")]
    missing = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--key-file" in missing.stderr
    shared = subprocess.run(
        [*base, "--key-file", str(path)], capture_output=True, text=True, timeout=60
    )
    assert shared.returncode == 2 and "chmod 600" in shared.stderr
    assert not (tmp_path / "ready.json").exists()


def test_the_bind_address_is_one_interface_never_all() -> None:
    from pearl_hpc.comm.net import bind_address
    from pearl_hpc.errors import ConfigError

    assert bind_address("lo") == "127.0.0.1"
    assert bind_address("10.1.2.3") == "10.1.2.3"
    assert bind_address("hostname") not in ("0.0.0.0", "")
    with pytest.raises(ConfigError, match="no such interface"):
        bind_address("no-such-if0")


def test_a_hostname_that_resolves_to_loopback_is_refused_where_nodes_must_reach_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Debian-style hosts map their name to 127.0.1.1: a run over several nodes would
    advertise an address no other node reaches. Loopback named outright is taken (a
    cluster whose nodes are one host: configs/clusters/local.yaml)."""
    import socket

    from pearl_hpc.comm.net import bind_address
    from pearl_hpc.errors import ConfigError

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert bind_address("hostname") == "127.0.1.1"  # one node: nobody else to reach it
    with pytest.raises(ConfigError, match=r"resolves to 127\.0\.1\.1, a loopback address"):
        bind_address("hostname", reachable=True)
    assert bind_address("127.0.0.1", reachable=True) == bind_address("lo", reachable=True)
