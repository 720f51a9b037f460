"""Flat records between the router / agent loop and the engine workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pearl_hpc.core.types import Role
from pearl_hpc.errors import ConfigError, PearlError

ENGINE_ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


class EngineError(PearlError):
    """An engine worker failed or refused an operation; the message names the worker."""


class Draining(EngineError):
    """The worker is not admitting work (drained, released or changing role): route elsewhere."""


class WeightsRefused(EngineError):
    """The weights that arrived do not match the trainer's digest: the engine did not
    load them and serves the version it held."""


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """Generate one turn from token ids."""

    request_id: str  # unique per attempt (a resumed turn gets a new id)
    prompt_token_ids: tuple[int, ...]  # full context: prompt + previous turns + partial output
    max_tokens: int  # budget left for this turn
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None  # per-request sampling seed (reproducible sampling)
    prefill_only: bool = False  # PD: prefill then hand the KV over (max_tokens forced to 1)
    kv_transfer_params: dict[str, Any] | None = None  # PD: from the prefill worker's result
    stop_token_ids: tuple[int, ...] = ()
    # return each generated token's log-prob (the trainer's behaviour policy); it costs a
    # log-softmax over the vocabulary per token (small next to a real model's forward)
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ConfigError(f"request {self.request_id}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ConfigError(f"request {self.request_id}: max_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What a worker returned for one request (complete, or partial when aborted)."""

    request_id: str
    worker_id: str
    token_ids: tuple[int, ...]  # generated tokens (cumulative for this attempt)
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # weights that generated it
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens not computed here (prefix cache or remote KV)
    kv_transfer_params: dict[str, Any] | None = None  # set by a prefill-only request
    wall_s: float = 0.0  # from admission to the result
    # each generated token's log-probability under the sampling distribution (after
    # temperature; raw logits for greedy requests); () when the engine gives none
    logprobs: tuple[float, ...] = ()

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


@dataclass(frozen=True, slots=True)
class Timing:
    """How long a worker-side operation took, as the master's tracker wants it."""

    op: str  # "start" | "stop" | "role" | "weights" | "release" | "restore" | "activate" | ...
    wall_s: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's state at a glance."""

    worker_id: str
    role: Role | None  # None while released (no engine)
    admitting: bool
    weight_version: int
    num_running: int
    rss_bytes: int  # resident memory of the worker process tree
    kv_bytes_received: int  # NIXL bytes pulled into this worker so far
    kv_tokens_injected: int  # prompt tokens whose KV a prefill worker sent here
    generated_tokens: int
    timings: tuple[Timing, ...] = ()
    # cuda: the device's free and total bytes (all processes on it: what a borrowed GPU
    # has left for its trainer); None on cpu
    gpu_free_bytes: int | None = None
    gpu_total_bytes: int | None = None
