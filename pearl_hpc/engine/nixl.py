"""vLLM's NIXL connector (PD disaggregation's KV transfers), as pearl runs it: without
the UCX progress thread on CPU, and with a handshake listener that a malformed message
does not end. Both patch vLLM's module once per process, before an engine starts."""

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
    that had not paired yet could pair with that engine again. Replaced by the same
    protocol with each message checked: one that is not a handshake for a rank this
    engine has is dropped with one warning line, and the listener serves on (other
    peers' connections untouched)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler as nixl

    cls = nixl.NixlBaseConnectorScheduler
    if getattr(cls._nixl_handshake_listener, "pearl_guarded", False):
        return
    guarded = functools.partial(_handshake_listener, nixl.make_zmq_path, nixl.GET_META_MSG)
    guarded.pearl_guarded = True  # type: ignore[attr-defined]
    cls._nixl_handshake_listener = staticmethod(guarded)  # type: ignore[method-assign,assignment]


def _handshake_listener(
    zmq_path: Any,
    get_meta: bytes,
    layouts: dict[tuple[int, int], bytes],
    ready: threading.Event,
    stop: threading.Event,
    host: str,
    port: int,
) -> None:
    """Answer ``(get_meta, pp_rank, tp_rank)`` (msgpack) with that rank's encoded KV
    layout and this process's ``perf_counter`` (the decoder estimates the clock offset
    from it), until ``stop``; anything else is dropped."""
    import msgspec
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        sock.bind(zmq_path("tcp", host, port))
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
        context.destroy(linger=0)
