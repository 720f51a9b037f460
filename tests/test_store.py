"""The trainer's rendezvous store: the run's key before any key is read or written, one
bound address, a bound on what is stored, and gloo groups that meet in it."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from pearl_hpc.engine.rpc import RpcAuthError, new_key  # noqa: E402
from pearl_hpc.engine.store import KeyStore, StoreClient  # noqa: E402
from pearl_hpc.engine.types import EngineError  # noqa: E402


@pytest.fixture
def store():
    server = KeyStore(new_key(), "127.0.0.1", max_keys=8, max_bytes=4096)
    yield server
    server.close()


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (hex, from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    found.append(local.split(":")[0])
    return found


def test_the_store_listens_on_its_host_only(store):
    assert _listeners(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::


def test_without_the_key_nothing_is_read_or_written(store):
    keyed = StoreClient("127.0.0.1", store.port, store.key)
    keyed.set("bcast/secret/0/0", b"trainer address")
    with pytest.raises(RpcAuthError, match="refused the run's key"):
        StoreClient("127.0.0.1", store.port, new_key(), timeout_s=5)
    # raw bytes: a length claim, junk, a frame as if the handshake had passed
    for junk in (b"\xff\xff\xff\xff" * 16, os.urandom(4096), b"\x00\x00\x00\x05set!!" + b"0" * 64):
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as s:
            s.recv(16)  # the server's nonce
            s.sendall(junk)
            s.settimeout(5)
            assert s.recv(64) == b""  # dropped, nothing answered
    assert store.table.values == {"bcast/secret/0/0": b"trainer address"}
    assert keyed.get("bcast/secret/0/0") == b"trainer address"
    keyed.close()


def test_what_a_client_may_store_is_bounded(store):
    keyed = StoreClient("127.0.0.1", store.port, store.key, timeout_s=2)
    keyed.set("a", b"x" * 4000)
    with pytest.raises(EngineError, match="past 4096 bytes"):
        keyed.set("b", b"x" * 200)
    keyed.set("a", b"x" * 10)  # replacing a value frees what it held
    for i in range(7):
        keyed.set(f"k{i}", b"1")
    with pytest.raises(EngineError, match="8 keys already"):
        keyed.set("one-more", b"1")
    assert len(store.table.values) == 8 and store.table.used <= 4096
    with pytest.raises(EngineError, match="not set within 2 s"):
        keyed.get("never")
    assert keyed.delete_key("a") and not keyed.check(["a"])
    assert keyed.add("n", 2) == 2 and keyed.add("n", 3) == 5
    keyed.close()


def test_gloo_groups_meet_in_the_store():
    server = KeyStore(new_key())
    sums: list[float] = [0.0, 0.0]

    def rank(r: int) -> None:
        client = StoreClient("127.0.0.1", server.port, server.key)
        group = dist.ProcessGroupGloo(dist.PrefixStore("dp/", client), r, 2, timedelta(seconds=30))
        t = torch.full((3,), float(r + 1))
        group.allreduce([t]).wait()
        sums[r] = float(t[0])
        client.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.close()
    assert sums == [3.0, 3.0]
