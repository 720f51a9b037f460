"""The NIXL side channel's handshake listener as pearl runs it
(pearl_hpc.engine.nixl): it binds its own port, so engines started together never race
for one, and a port it cannot bind is one error at start, not a hang. (A decoder pairing
with a prefill engine through it: tests/test_engine_vllm.py.)"""

from __future__ import annotations

import socket
import threading

import pytest

from tests.conftest import vllm_skip_reason

pytestmark = pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))

GET_META = b"get_meta_msg"


def _ask(port: int) -> bytes:
    import msgspec
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart((b"", msgspec.msgpack.encode((GET_META, 0, 0))))
        _, layout, _clock = sock.recv_multipart()
        return bytes(layout)
    finally:
        context.destroy(linger=0)


def test_listeners_started_together_bind_distinct_ports_and_answer() -> None:
    from vllm.utils.network_utils import make_zmq_path

    from pearl_hpc.engine.nixl import start_listener

    stop = threading.Event()
    started: list[tuple[int, threading.Thread]] = []
    lock = threading.Lock()

    def start(i: int) -> None:
        got = start_listener(make_zmq_path, GET_META, {(0, 0): b"layout%d" % i}, stop,
                             "127.0.0.1", 0)  # fmt: skip
        with lock:
            started.append(got)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(20)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        ports = [port for port, _ in started]
        assert len(ports) == 20 and len(set(ports)) == 20, ports
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
        assert all(10000 <= p < low for p in ports)  # below the ephemeral range
        answers = {_ask(p) for p in ports}
        assert answers == {b"layout%d" % i for i in range(20)}
    finally:
        stop.set()
        for _, thread in started:
            thread.join(5)


def test_a_fixed_port_that_is_taken_fails_the_start_at_once() -> None:
    from vllm.utils.network_utils import make_zmq_path

    from pearl_hpc.engine.nixl import start_listener

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"NIXL side channel on 127.0.0.1:{port}"):
            start_listener(make_zmq_path, GET_META, {}, threading.Event(), "127.0.0.1", port)
