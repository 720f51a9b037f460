"""vLLM's NIXL connector (PD disaggregation's KV transfers), as pearl runs it: without
the UCX progress thread on CPU, and with a handshake listener that binds its own port
and that a malformed message does not end. Both patch vLLM's module once per process,
before an engine starts; :func:`nixl_problem` says why NIXL does not load, if it does
not."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

log = logging.getLogger("pearl_hpc.engine.vllm_engine")


def nixl_without_progress_thread() -> None:
    """NIXL's UCX progress thread polls without pause: one core per engine with a KV
    connector, idle or not -- half of a 2-core machine (disaggregated serving measured
    0.64x of colocated with it, 1.6-2.4x without: ``bench --engines``). On CPU it is off
    and transfers progress in the engine's own calls (every step; every
    :data:`~pearl_hpc.engine.vllm_engine.IDLE_POLL_S` while idle). On cuda vLLM's
    default stays (one core of many, and RDMA reads need no progress from the
    producer)."""

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as nixl

    if nixl.nixl_agent_config is not None and not isinstance(
        nixl.nixl_agent_config, functools.partial
    ):
        nixl.nixl_agent_config = functools.partial(nixl.nixl_agent_config, enable_prog_thread=False)


def nixl_listener_that_survives() -> None:
    """vLLM's NIXL handshake listener (a thread on the side channel, where a decoder
    asks a prefill engine for its KV layout) decodes each message unguarded: one
    malformed message from anyone who reaches the port ended the thread, and no decoder
    that had not paired yet could pair with that engine again. And it bound a port
    picked earlier: two engines of a node could pick the same, or another process take
    it in between, and the start hung. Replaced (``set_xfer_handshake_metadata``, which
    starts it) by the same protocol with each message checked -- one that is not a
    handshake for a rank this engine has is dropped with one warning line, and the
    listener serves on -- on a port it binds itself: the fixed one
    (``VLLM_NIXL_SIDE_CHANNEL_PORT``), else a free one below the kernel's ephemeral
    range, which the scheduler then advertises to its decoders."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler as nixl

    cls = nixl.NixlBaseConnectorScheduler
    if getattr(cls.set_xfer_handshake_metadata, "pearl_guarded", False):
        return

    def set_xfer_handshake_metadata(self: Any, metadata: dict[tuple[int, int], Any]) -> None:
        import msgspec

        for key, payload in metadata.items():
            if not isinstance(payload, nixl.NixlHandshakePayload):
                raise ValueError(f"NIXL handshake metadata of rank {key} is {type(payload)}")
        if self._nixl_handshake_listener_t is not None:
            return  # serving already
        encoder = msgspec.msgpack.Encoder()
        layouts = {key: encoder.encode(payload) for key, payload in metadata.items()}
        self.side_channel_port, self._nixl_handshake_listener_t = start_listener(
            nixl.make_zmq_path, nixl.GET_META_MSG, layouts, self._stop_event,
            self.side_channel_host, self.side_channel_port,
        )  # fmt: skip

    set_xfer_handshake_metadata.pearl_guarded = True  # type: ignore[attr-defined]
    cls.set_xfer_handshake_metadata = set_xfer_handshake_metadata  # type: ignore[method-assign]


def start_listener(
    zmq_path: Any,
    get_meta: bytes,
    layouts: dict[tuple[int, int], bytes],
    stop: threading.Event,
    host: str,
    port: int,
) -> tuple[int, threading.Thread]:
    """The handshake listener's thread, serving once it returns, and the port it bound
    (``port``, or one it chose for 0); a port it could not bind raises here."""
    ready = threading.Event()
    bound: list[int | BaseException] = []
    thread = threading.Thread(
        target=_handshake_listener,
        args=(zmq_path, get_meta, layouts, ready, stop, host, port, bound),
        daemon=True,
        name="nixl_handshake_listener",
    )
    thread.start()
    ready.wait()
    if isinstance(bound[0], BaseException):
        raise RuntimeError(f"NIXL side channel on {host}:{port or 'any'}: {bound[0]}")
    return bound[0], thread


def _free_range_top() -> int:
    """The lowest port of the kernel's ephemeral range (handed to outgoing connections
    too: a listener stays below it)."""
    from pathlib import Path

    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _handshake_listener(
    zmq_path: Any,
    get_meta: bytes,
    layouts: dict[tuple[int, int], bytes],
    ready: threading.Event,
    stop: threading.Event,
    host: str,
    port: int,
    bound: list[int | BaseException],
) -> None:
    """Bind (``port``, or a free one for 0: appended to ``bound``, or why not), then answer
    ``(get_meta, pp_rank, tp_rank)`` (msgpack) with that rank's encoded KV layout and
    this process's ``perf_counter`` (the decoder estimates the clock offset from it),
    until ``stop``; anything else is dropped."""
    import msgspec
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        try:
            if port:
                sock.bind(zmq_path("tcp", host, port))
            else:  # "tcp://HOST" as zmq_path writes it (IPv6 in brackets), no port
                base = zmq_path("tcp", host, 1).rsplit(":", 1)[0]
                port = sock.bind_to_random_port(base, 10000, _free_range_top(), 200)
        except zmq.ZMQError as exc:
            bound.append(exc)
            ready.set()
            return
        bound.append(port)
        ready.set()
        while not stop.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                identity, _, body = frames
                what, pp_rank, tp_rank = msgspec.msgpack.decode(body)
                layout = layouts[(pp_rank, tp_rank)]
                if what != get_meta:
                    raise ValueError(f"not a handshake: {what!r}"[:80])
            except (ValueError, TypeError, KeyError, msgspec.DecodeError) as exc:
                log.warning(
                    "NIXL side channel %s:%d: dropped a malformed message (%s: %s)",
                    host, port, type(exc).__name__, str(exc)[:120],
                )  # fmt: skip
                continue
            clock = msgspec.msgpack.encode(time.perf_counter())
            sock.send_multipart((identity, b"", layout, clock))
    finally:
        if not ready.is_set():  # ended before it bound: the start learns why, not a hang
            bound.append(RuntimeError("the listener ended before it bound a port"))
            ready.set()
        context.destroy(linger=0)


def nixl_problem() -> str:
    """Why NIXL, which moves the KV of PD-disaggregated turns, does not load here ('' when
    it does). On a CUDA stack the ``nixl`` package loads the backend of torch's CUDA major
    (``nixl-cu12`` or ``nixl-cu13``); call it after the process's GPUs are narrowed."""
    try:
        import nixl  # noqa: F401
    except ImportError as exc:
        return (
            f"NIXL does not load ({exc}); PD disaggregation moves the KV cache with it: "
            "pip install nixl==1.5.1 (its CUDA 12 and 13 backends; docs/install.md), or "
            "set policy.pd_policy: colocated"
        )
    return ""
