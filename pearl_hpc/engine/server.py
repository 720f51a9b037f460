"""The engine worker process: one vLLM engine, served over :mod:`pearl_hpc.engine.rpc`.

``python -m pearl_hpc.engine.server --spec JSON --worker-id ID --ready-file F [--role R]``
(``--spec``: the whole :class:`~pearl_hpc.engine.spec.EngineSpec`, as JSON)

Lifecycle (the process stays alive across all of it)::

    released --restore(role)--> serving(role) --set_role(r)--> serving(r)
        ^                           |   ^
        |                       drain() admit()
        +------- release() ---------+   (drain returns partial outputs)

- ``drain``: stop admitting, abort running requests and RETURN their partial outputs
  (each aborted ``generate`` call also returns its partial with ``finish_reason="abort"``);
  new ``generate`` calls fail with :class:`Draining` so the router sends them elsewhere.
- ``set_role``: drain, then serve the new role -- in place where the engine runs a
  two-way KV connector (NIXL ``kv_both``: an engine started for prefill or decode serves
  every role), else by shutting the engine down and starting it with the other config.
- ``release`` / ``restore``: give the device back while borrowed GPUs are needed for
  training. GPU: vLLM ``sleep(level=1)`` / ``wake_up()``; CPU has no sleep mode, so the
  engine is shut down and rebuilt inside this process (memory returns to the OS).
- ``activate`` / ``deactivate``: the borrowing hand-off of an overlap worker
  (restore + latest weights + admit; drain + release), each timed.
- ``load_weights``: version-tagged weights without a restart (safetensors bytes or file,
  a torch.distributed broadcast from the trainer: ``receive_weights``, or on the
  trainer's node the file it staged in shared memory: ``map_weights``); they survive
  later restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pearl_hpc.comm.net import bind_address
from pearl_hpc.core.types import Role
from pearl_hpc.engine.rpc import read_key, serve
from pearl_hpc.engine.spec import EngineSpec, check_vllm
from pearl_hpc.engine.types import (
    ENGINE_ROLES,
    Draining,
    EngineError,
    Timing,
    TurnRequest,
    TurnResult,
    WeightsRefused,
    WorkerStats,
)
from pearl_hpc.engine.vllm_engine import (
    EngineRunner,
    configure_process_env,
    device_memory,
    rss_bytes,
)
from pearl_hpc.errors import ConfigError
from pearl_hpc.rundir import private_files

log = logging.getLogger("pearl_hpc.engine.server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _role(value: Role | str) -> Role:
    role = Role(value)
    if role not in ENGINE_ROLES:
        raise EngineError(f"role {role} is not an engine role; use one of {list(ENGINE_ROLES)}")
    return role


class EngineWorker:
    """The RPC handlers; all engine work goes through the runner's engine thread."""

    def __init__(self, runner: EngineRunner) -> None:
        self.runner = runner
        self.admitting = False
        self.timings: list[Timing] = []
        self._sleeping_role: Role | None = None  # GPU: engine asleep, not shut down
        self._slept_bytes = 0  # what its sleep gave back of the GPU (its wake takes it again)
        self._ops = asyncio.Lock()  # one lifecycle operation at a time
        self._weight_groups: dict[str, tuple[Any, Any]] = {}  # name -> (group, its store)
        self.key = ""  # the run's key: the trainer's store asks for it
        self.served = 0  # turns completed since the last activate (what a borrow bought)
        # versions received over the network, in shared memory for this node's other
        # engines to map (made at the first; None where there is no /dev/shm), and the
        # one of them this engine holds: {"version", "path", "header"}
        self._store: Any = None
        self._shared: dict[str, Any] | None = None

    @property
    def _tp(self) -> int:
        """The engine's workers (more than one: they load each version from a file)."""
        return self.runner.spec.tensor_parallel_size

    async def _wait(self, fut: Any) -> Any:
        return await asyncio.wrap_future(fut)

    def _timed(self, op: str, t0: float, **detail: Any) -> Timing:
        timing = Timing(op, time.perf_counter() - t0, detail)
        self.timings.append(timing)
        return timing

    # ------------------------------------------------------------------ turns

    async def generate(self, request: TurnRequest) -> TurnResult:
        if self.runner.failed is not None:
            raise EngineError(f"{self.runner.worker_id}: {self.runner.failed}")
        if not self.admitting or self.runner.role is None:
            raise Draining(f"{self.runner.worker_id} is not admitting work")
        if request.prefill_only and self.runner.role is not Role.PREFILL:
            raise EngineError(f"{self.runner.worker_id}: prefill_only sent to a {self.runner.role}")
        result: TurnResult = await self._wait(self.runner.submit(request))
        if not result.aborted:
            self.served += 1
        return result

    async def drain(self) -> list[TurnResult]:
        """Stop admitting; abort running requests; return their partial outputs."""
        self.admitting = False
        t0 = time.perf_counter()
        partial: list[TurnResult] = await self._wait(self.runner.abort_all())
        self._timed("drain", t0, aborted=len(partial))
        return partial

    async def admit(self) -> None:
        if self.runner.role is None:
            raise EngineError(f"{self.runner.worker_id}: cannot admit, no engine (restore first)")
        self.admitting = True

    # ------------------------------------------------------------------ lifecycle

    async def set_role(self, role: str) -> Timing:
        role = _role(role)
        async with self._ops:
            t0 = time.perf_counter()
            old = self.runner.role
            await self.drain()
            if self.runner.takes_in_place(role) and not self.runner.asleep:
                await self._wait(self.runner.rerole(role))
                self.admitting = True
                return self._timed("role", t0, old=str(old), new=str(role), in_place=True)
            stop_s = await self._wait(self.runner.stop())
            self._sleeping_role = None  # a sleeping engine was shut down with the rest
            start_s = await self._wait(self.runner.start(role))
            self.admitting = True
            return self._timed(
                "role", t0, old=str(old), new=str(role), stop_s=stop_s, start_s=start_s
            )

    async def release(self) -> Timing:
        async with self._ops:
            return await self._release()

    async def _release(self) -> Timing:
        t0 = time.perf_counter()
        role = self.runner.role
        before = self._free("before")
        await self.drain()
        # a prefill engine's decoders read the KV it holds first; vLLM refuses to sleep
        # with KV unread, so one still holding some after the wait shuts down instead
        unread = await self._wait(self.runner.drain_kv())
        if role is not None and self.runner.spec.device == "cuda" and not unread:
            await self._wait(self.runner.sleep())
            self._sleeping_role = role
        else:
            await self._wait(self.runner.stop())
        after = self._free("after")
        if self._sleeping_role is not None and before and after:
            self._slept_bytes = after["gpu_free_after"] - before["gpu_free_before"]
        detail = {"role": str(role), "kv_unread": unread, **before, **after}
        return self._timed("release", t0, **detail)

    async def restore(self, role: str) -> Timing:
        async with self._ops:
            return await self._restore(_role(role))

    async def _restore(self, role: Role) -> Timing:
        t0 = time.perf_counter()
        in_place = self._sleeping_role is not None and self.runner.takes_in_place(role)
        fits = not in_place or self._wake_fits()
        if in_place and fits:
            await self._wait(self.runner.wake())
            self._sleeping_role = None
            await self._wait(self.runner.rerole(role))
        else:
            if self.runner.role is not None or self._sleeping_role is not None:
                await self._wait(self.runner.stop())
                self._sleeping_role = None
            await self._wait(self.runner.start(role))
        detail = {"role": str(role), **self._free("after")}
        if not fits:  # a sleeping engine started again, sized to what is free now
            detail["smaller"] = True
        return self._timed("restore", t0, **detail)

    def _wake_fits(self) -> bool:
        """A sleeping engine wakes into the bytes its sleep gave back, and then needs a
        weight load's headroom (a level-2 wake reloads its weights). Where less is free
        now (the lent trainer rank's communicators or allocations grew), vLLM's wake
        would run out of memory: the engine is started again instead, smaller."""
        memory = device_memory(self.runner.spec.device)
        return memory is None or (
            memory[0] >= self._slept_bytes + self.runner.spec.reload_headroom_bytes
        )

    def _free(self, when: str) -> dict[str, int]:
        """The device's free bytes now, for a timing's detail (nothing on cpu)."""
        memory = device_memory(self.runner.spec.device)
        return {} if memory is None else {f"gpu_free_{when}": memory[0]}

    async def activate(
        self, role: str, weights: bytes | None = None, version: int | None = None
    ) -> Timing:
        """Overlap worker joins rollout: restore, load the latest weights, admit. Its
        timing says whether this was the process's first engine start (``first``: vLLM
        compiles then, so it is no sample of what a later activation costs)."""
        async with self._ops:
            t0 = time.perf_counter()
            first = self.runner.starts == 0
            restore = await self._restore(_role(role))
            load_s = 0.0
            if weights is not None and version is not None:
                load_s = (await self._load_bytes(weights, version)).wall_s
            self.admitting = True
            self.served = 0
            return self._timed(
                "activate", t0, restore_s=restore.wall_s, weights_s=load_s, first=first
            )

    async def deactivate(self) -> tuple[Timing, list[TurnResult]]:
        """Overlap worker leaves rollout: drain (partials returned) and release the device.
        Its timing's ``served``: the turns it completed since its activation."""
        async with self._ops:
            t0 = time.perf_counter()
            self.admitting = False
            partial: list[TurnResult] = await self._wait(self.runner.abort_all())
            release = await self._release()
            freed = {k: v for k, v in release.detail.items() if k.startswith("gpu_free_")}
            timing = self._timed(
                "deactivate", t0, release_s=release.wall_s, aborted=len(partial),
                served=self.served, **freed,
            )  # fmt: skip
            return timing, partial

    # ------------------------------------------------------------------ weights

    async def load_weights(
        self, version: int, data: bytes | None = None, path: str | None = None
    ) -> Timing:
        if (data is None) == (path is None):
            raise EngineError("load_weights: pass exactly one of data (safetensors bytes) or path")
        blob = data if data is not None else Path(path or "").read_bytes()
        return await self._load_bytes(blob, version)

    async def _load_bytes(self, blob: bytes, version: int) -> Timing:
        from safetensors.torch import load as load_safetensors

        from pearl_hpc.engine.weightfile import file_for

        t0 = time.perf_counter()
        named = list(load_safetensors(blob).items())
        file, named = await asyncio.to_thread(file_for, self._tp, named, version)
        load = await self._wait(self.runner.load_weights(named, version, file=file))
        return self._timed(
            "weights", t0, version=version, reload_s=load.wall_s, cache=load.cache,
            source="bytes", via=load.via,
        )  # fmt: skip

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
        """Join a weight group of the trainer (rank 0) under the name ``name``, meeting in
        the trainer's store at ``host:port`` (which asks for the run's key).

        The group lives outside torch.distributed's default world, which the in-process
        engine owns (:mod:`pearl_hpc.weights.group`)."""
        from pearl_hpc.engine.store import StoreClient
        from pearl_hpc.weights.group import WeightGroup

        await self.leave_weights_group(name)  # the previous epoch's group of that name
        store = await asyncio.to_thread(StoreClient, host, port, self.key)
        try:
            group = await asyncio.to_thread(WeightGroup, store, prefix, rank, size, backend)
        except BaseException:
            store.close()
            raise
        self._weight_groups[name] = (group, store)

    async def leave_weights_group(self, name: str) -> None:
        joined = self._weight_groups.pop(name, None)
        if joined is not None:
            joined[0].close()
            joined[1].close()

    async def receive_weights(self, group: str, digest: bytes, p2p: bool = False) -> Timing:
        """Take part in the trainer's broadcast in ``group`` (or receive a point-to-point
        copy, for a worker that missed broadcasts) into host memory, one bucket on the
        device at a time while the engine keeps generating; then load it between two
        engine steps, if it matches the trainer's ``digest`` (:func:`~pearl_hpc.weights.
        wire.digest`, sent over this authenticated RPC): else :class:`WeightsRefused`, and
        the engine serves the version it held."""
        from pearl_hpc.engine.weightfile import receive_into_file

        wg = self._weight_groups.get(group, (None,))[0]
        if wg is None:
            raise EngineError(
                f"{self.runner.worker_id}: not in weight group {group!r} "
                f"(joined: {sorted(self._weight_groups)})"
            )
        t0 = time.perf_counter()
        store = self._weights_store()
        # off the engine thread: a broadcast whose source gave up (a member died) blocks
        # this thread until the group's timeout, never the engine or the next sync
        got = await asyncio.to_thread(receive_into_file, wg, 0, p2p=p2p, store=store)
        if got.digest != digest:  # (hashed as it arrived)
            got.file.close()
            if got.shared is not None:
                store.unlink(got.version)
            held = self.runner.weight_version
            raise WeightsRefused(
                f"weights v{got.version} over {group!r} do not match the trainer's digest "
                f"(tampered in transit): not loaded, still serving v{held}"
            )
        file = got.file if self._tp > 1 else None
        if file is None:  # one worker loads the views (they keep the mapping)
            got.file.close()
        load = await self._wait(self.runner.load_weights(got.named, got.version, got.recv_s, file))
        if got.shared is not None:  # the node's other engines may map it now; older go
            self._shared = {"version": got.version, **got.shared}
            store.unlink_before(got.version)
        return self._load_timing(t0, load, "p2p" if p2p else "broadcast")

    def _weights_store(self) -> Any:
        """This engine's directory in shared memory (made at the first version received
        over the network; None where the node has no /dev/shm)."""
        from pearl_hpc.weights.shm import SharedStore

        if self._store is None:
            name = "".join(c if c.isalnum() else "-" for c in self.runner.worker_id)
            self._store = SharedStore.create(f"engine-{name}") or False
        return self._store or None

    async def weights_share(self) -> dict[str, Any]:
        """What another engine of this node needs to map the version this one holds from
        its shared memory: this host's name, the store's probe (path, token), and -- where
        it holds its version there -- the version, the file's path and header."""
        shared, host, store = self._shared, socket.gethostname(), self._weights_store()
        if store is None:
            return {"host": host}
        if shared is None or shared["version"] != self.runner.weight_version:
            return {"host": host, "probe": list(store.probe)}
        return {"host": host, "probe": list(store.probe), **shared}

    def close_store(self) -> None:
        """Remove this engine's shared files (engines that mapped one keep it)."""
        if self._store:
            self._store.close()

    async def shares_memory(self, path: str, token: str) -> bool:
        """Whether the trainer's probe file is here with its token (this engine then maps
        each version from the trainer's shared memory: :mod:`pearl_hpc.weights.shm`)."""
        from pearl_hpc.weights.shm import shares_memory

        return shares_memory(path, token)

    async def map_weights(self, path: str, header: dict[str, Any]) -> Timing:
        """Load the version the trainer staged in the shared file at ``path``: views of a
        private mapping of it become the host copy (nothing is copied into this process)."""
        from pearl_hpc.engine.weightfile import file_for
        from pearl_hpc.weights.shm import map_version

        t0 = time.perf_counter()
        version, named = await asyncio.to_thread(map_version, path, header)
        file, named = await asyncio.to_thread(file_for, self._tp, named, version, (path, header))
        map_s = time.perf_counter() - t0
        load = await self._wait(self.runner.load_weights(named, version, map_s, file))
        return self._load_timing(t0, load, "shm")

    def _load_timing(self, t0: float, load: Any, source: str) -> Timing:
        """A version that arrived from ``source`` and was loaded (``load``: a WeightLoad)."""
        return self._timed(
            "weights", t0, version=load.version, recv_s=load.recv_s,
            reload_s=load.wall_s - load.recv_s, cache=load.cache, source=source, via=load.via,
        )  # fmt: skip

    # ------------------------------------------------------------------ observability

    async def stats(self) -> WorkerStats:
        r = self.runner
        memory = device_memory(r.spec.device)
        return WorkerStats(
            worker_id=r.worker_id,
            role=None if self._sleeping_role is not None else r.role,
            admitting=self.admitting,
            weight_version=r.weight_version,
            num_running=r.num_running,
            rss_bytes=rss_bytes(),
            kv_bytes_received=r.kv_bytes_received,
            kv_tokens_injected=r.kv_tokens_injected,
            generated_tokens=r.generated_tokens,
            timings=tuple(self.timings),
            gpu_free_bytes=memory[0] if memory else None,
            gpu_total_bytes=memory[1] if memory else None,
        )

    async def telemetry(self) -> list[Any]:
        """Iteration records since the last call (for the runtime tracker)."""
        records, self.runner.iterations = self.runner.iterations, []
        return records

    def handlers(self) -> dict[str, Any]:
        ops = [
            "generate",
            "drain",
            "admit",
            "set_role",
            "release",
            "restore",
            "activate",
            "deactivate",
            "load_weights",
            "join_weights_group",
            "leave_weights_group",
            "receive_weights",
            "shares_memory",
            "map_weights",
            "weights_share",
            "stats",
            "telemetry",
        ]
        return {op: getattr(self, op) for op in ops}


class EngineService:
    """One engine worker served over :mod:`pearl_hpc.engine.rpc` in this process (an
    engine worker process, or an engine rank of the run's MPI world): :meth:`start`
    listens and announces, :meth:`serve_until_stopped` serves until ``shutdown`` (an RPC
    op) or :meth:`stop`."""

    def __init__(self, spec: EngineSpec, worker_id: str, slot_id: int = 0) -> None:
        configure_process_env(spec)
        self.spec = spec
        self.runner = EngineRunner(spec, worker_id=worker_id, slot_id=slot_id)
        self.worker = EngineWorker(self.runner)
        self.stopped = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self, key: str, *, host: str, port: int, role: str) -> dict[str, Any]:
        """Listen on ``host`` (one address, never every interface) and start an engine in
        ``role`` unless ``none``; returns the ready record: host, port, pid, KV
        side-channel port, engine start seconds."""

        async def shutdown() -> None:
            self.stopped.set()

        self.worker.key = key
        handlers = self.worker.handlers()
        handlers["shutdown"] = shutdown
        self.server = await serve(handlers, key, host=host, port=port)
        start = None
        if role != "none":
            start = await self.worker.restore(role)
            self.worker.admitting = True
        bound_host, bound_port = self.server.sockets[0].getsockname()[:2]
        return {
            "host": bound_host,
            "port": bound_port,
            "pid": os.getpid(),
            "start_s": start.wall_s if start else None,
        }

    def stop(self) -> None:
        self.stopped.set()

    async def serve_until_stopped(self) -> None:
        await self.stopped.wait()
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await self.worker.drain()
        await asyncio.to_thread(self.runner.close)
        self.worker.close_store()


def write_ready(path: str | Path, ready: dict[str, Any]) -> None:
    """The ready file a launcher waits for (written whole, by rename)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(ready))
    tmp.rename(path)


async def _main(args: argparse.Namespace) -> int:
    try:
        key = read_key(args.key_file)
    except (OSError, EngineError) as exc:
        print(f"engine worker: --key-file {args.key_file}: {exc}", file=sys.stderr)
        return 2
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    try:
        spec = EngineSpec.from_json(args.spec)
        check_vllm()
    except ConfigError as exc:
        print(f"engine worker: {exc}", file=sys.stderr)
        return 2
    service = EngineService(spec, args.worker_id, args.slot_id)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    # Slurm's --signal without B: (submitit's USR2 before a time-out) reaches every process
    # of the step: the master handles it and stops this worker itself
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        host = bind_address(args.host)
    except ConfigError as exc:
        print(f"engine worker: --host {args.host}: {exc}", file=sys.stderr)
        return 2
    ready = await service.start(key, host=host, port=args.port, role=args.role)
    write_ready(args.ready_file, ready)
    await service.serve_until_stopped()
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives no master: when the process that started it dies (even by
    SIGKILL), exit at once -- the engine and its memory go with it, and a restarted
    master (``pearl-hpc run --resume``) starts from a clean machine."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        print(f"engine worker: parent {parent_pid} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pearl_hpc.engine.server")
    p.add_argument("--spec", required=True, help="the EngineSpec as JSON")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--slot-id", type=int, default=0)
    p.add_argument("--role", default="colocated", choices=[*map(str, ENGINE_ROLES), "none"])
    p.add_argument("--ready-file", required=True)
    p.add_argument("--key-file", required=True, help="the run's RPC key (mode 0600)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on: an IPv4 address, an interface name or 'hostname'",
    )
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies")
    args = p.parse_args(argv)
    private_files()
    logging.basicConfig(level=os.environ.get("PEARL_LOG_LEVEL", "WARNING"))
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
