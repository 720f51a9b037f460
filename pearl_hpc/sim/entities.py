"""What the simulator moves around: trajectories, their requests, workers and steps.

KV memory of a worker (tokens; ``SimWorker.kv_used``), by role, as the engines do it:
- **colocated** (vLLM): a request allocates its prompt when admitted and grows by one
  token per generated token; when the worker runs out, the newest decoding request is
  preempted and later recomputed (its prompt and response so far prefilled again);
- **prefill** (SGLang PD): a request holds its prompt until its KV is handed off;
- **decode** (SGLang PD): a request preallocates its prompt plus its ``max_tokens`` (the
  response budget, cut so the trajectory stays within ``max_trajectory_tokens``), and
  waits for admission until that fits.
Idle trajectories (in a tool call) keep their context as an evictable prefix: a worker's
LRU prefix cache fills whatever KV running requests leave free and is evicted first,
never a running request for it; every weight update empties it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pearl_hpc.config.traces import AvailabilityTrace
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.routing import RoutingRule
from pearl_hpc.core.types import Role, Zone
from pearl_hpc.sim.costmodel import CHUNK_TOKENS
from pearl_hpc.sim.workload import TrajectorySpec

# event priorities at equal times: capacity changes, then completions, then arrivals
P_CAPACITY, P_CONTROL, P_WORK, P_ARRIVAL = 0, 1, 2, 3

# Admission leaves this share of the KV free (vLLM's watermark): a preempted request is
# not readmitted at once into the room its own preemption made.
KV_WATERMARK = 0.01


class SimInvariantError(AssertionError):
    """A simulated run broke a guarantee (lost trajectory, late return, ...)."""


@dataclass(eq=False)
class Traj:
    spec: TrajectorySpec
    step: int
    turn: int = 0
    context: int = 0  # tokens in context before the current turn
    done_gen: int = 0  # tokens of the current turn's response generated so far
    worker: int | None = None  # last worker that held its prefix (prefill side)
    decode_worker: int | None = None  # the decode worker of its last turn (local_prefill)
    prefilled: int = 0  # tokens prefilled for the current turn (re-prefills included)
    finished_s: float | None = None
    interrupts: int = 0
    turn_started_s: float = 0.0  # when the current turn's request was made
    # workers its prefix was cached on (some may have evicted it since): uncached there
    # when it finishes, not on every worker of the cluster
    cached_on: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Request:
    """One turn of one trajectory on its way through the workers."""

    traj: Traj
    prefill_tokens: int = 0  # tokens to prefill (new, or whole context on a miss)
    gen_left: int = 0
    kv_tokens: int = 0  # reserved on the worker where it is resident
    prompt_tokens: int = 0  # context the turn's response starts from
    finish_vt: float = 0.0
    started_vt: float = 0.0
    worker: int | None = None
    order: tuple[int, float, int] = (0, 0.0, 0)  # tail_dispatch's queue key (smallest first)

    @property
    def decode_ctx(self) -> float:
        """Context a decode step reads for it, on average: the prompt, half the response."""
        return self.prompt_tokens + self.gen_left / 2


def insert_ordered(queue: deque[Any], item: Any, key: Callable[[Any], Any], first: int = 0) -> None:
    """Put ``item`` into ``queue`` behind every item from position ``first`` on whose key
    is not above its own (smallest key first, ties in arrival order)."""
    at = len(queue)
    while at > first and key(queue[at - 1]) > key(item):
        at -= 1
    queue.insert(at, item)


@dataclass(eq=False)
class SimWorker:
    slot_id: int
    role: Role
    zone: Zone
    kv_capacity: int
    state: str = "starting"  # starting | active | rerole | draining | off
    decode: list[tuple[float, int, Request]] = field(default_factory=list)  # heap by finish_vt
    decode_ctx: float = 0.0  # context read per decode step (prompt + half the response)
    cached_tokens: int = 0  # sum of cache values
    prefill: deque[Request] = field(default_factory=deque)
    prefill_left: float = 0.0  # remaining tokens of the head prefill job
    prefill_backlog: float = 0.0  # remaining tokens of every queued prefill job
    chunk: float = 0.0  # prefill tokens per iteration since the last reschedule
    waiting: deque[tuple[str, Request]] = field(default_factory=deque)  # KV admission queue
    kv_static: int = 0  # KV allocated to requests (colocated decoding grows beyond it)
    started_sum: float = 0.0  # sum of the decoding requests' started_vt
    cache: OrderedDict[str, int] = field(default_factory=OrderedDict)  # traj -> cached tokens
    vt: float = 0.0  # tokens generated per decoding sequence since creation
    decode_rate: float = 0.0  # tokens/s per sequence
    prefill_rate: float = 0.0  # tokens/s of the head job
    iteration_s: float = 0.0
    updated_s: float = 0.0
    version: int = 0
    paused_until: float = 0.0  # loading new weights: no iteration before this
    routed: int = 0  # turns routed here in total (the router's tie-break)
    # decoding requests allocate KV as they generate (else it was preallocated): colocated
    grows: bool = field(init=False)

    def __post_init__(self) -> None:
        self.grows = self.role is Role.COLOCATED

    def set_role(self, role: Role) -> None:
        self.role = role
        self.grows = role is Role.COLOCATED

    @property
    def candidate(self) -> tuple[int, int, int]:
        """As the router sees it: (requests on the worker, turns routed, id)."""
        return (len(self.decode) + len(self.prefill) + len(self.waiting), self.routed, self.slot_id)

    @property
    def kv_used(self) -> float:
        """KV tokens held by requests (``vt`` must be current)."""
        grown = len(self.decode) * self.vt - self.started_sum if self.grows else 0.0
        return self.kv_static + grown

    def prefill_chunk(self) -> float:
        """Prefill tokens in this iteration: the queued prompts, first come first served,
        up to the token budget that the iteration's decode tokens leave (vLLM's chunked
        prefill: ``max_num_batched_tokens`` covers both; several prompts share a chunk)."""
        budget = CHUNK_TOKENS - len(self.decode) if self.role is not Role.PREFILL else CHUNK_TOKENS
        return min(float(budget), max(self.prefill_backlog, self.prefill_left, 1.0))

    def fits(self, tokens: int) -> bool:
        """``tokens`` more can be allocated (evicting cached prefixes) leaving the
        watermark free; an idle worker takes any request."""
        limit = self.kv_capacity * (1.0 - KV_WATERMARK)
        return self.kv_used + tokens <= limit or not (self.decode or self.prefill)

    def full_at_vt(self) -> float:
        """The ``vt`` at which colocated decoding fills the KV (inf: it cannot)."""
        if not self.grows or not self.decode:
            return float("inf")
        return (self.kv_capacity - self.kv_static + self.started_sum) / len(self.decode)

    def evict(self) -> None:
        """Drop least-recently-used prefixes until running requests' KV fits beside them."""
        if not self.cache:
            return
        room = self.kv_capacity - self.kv_used
        while self.cache and self.cached_tokens > room:
            _, tokens = self.cache.popitem(last=False)
            self.cached_tokens -= tokens

    def uncache(self, trajectory_id: str) -> int:
        tokens = self.cache.pop(trajectory_id, 0)
        self.cached_tokens -= tokens
        return tokens

    def cache_prefix(self, trajectory_id: str, tokens: int) -> None:
        self.uncache(trajectory_id)
        self.cache[trajectory_id] = tokens
        self.cached_tokens += tokens
        self.evict()

    def clear_cache(self) -> None:
        self.cache.clear()
        self.cached_tokens = 0


@dataclass
class StepRecord:
    """One step: the window from the previous batch's completion to this one's."""

    step: int
    started_s: float
    rollout_started_s: float = 0.0
    finished_s: float = 0.0
    trained_s: float = 0.0  # its training step finished
    config: str = ""  # serving configuration at the rollout's start, e.g. 1P2D or 2C
    generated_tokens: int = 0
    trained_tokens: int = 0
    mode: str = ""
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    borrowed_workers: int = 0
    dedicated_gpus: int = 0
    training_return_s: float = 0.0  # Training Begin -> borrowed GPUs back
    idle_worker_s: float = 0.0  # in the window: active rollout workers with nothing to run
    active_worker_s: float = 0.0  # in the window: active rollout workers, worker-seconds

    @property
    def duration_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def throughput_tokens_per_s(self) -> float:
        d = self.duration_s
        return (self.generated_tokens + self.trained_tokens) / d if d > 0 else 0.0


@dataclass(frozen=True)
class SimSetup:
    """Resources and policies of one simulated system."""

    name: str
    policy: PolicyConfig
    reserved_rollout_gpus: int = 4
    training_gpus: int = 16
    elastic: AvailabilityTrace | None = None  # elastic GPUs over time (None: fixed)
    overlap: bool = True  # overlap workers exist on the training GPUs (borrowing)
    grace_s: float = 30.0  # reclaim deadline after the trace drops
    weight_pull: bool = True  # joining workers pull the latest weights (preparation)
    routing: RoutingRule = RoutingRule()  # the system's router (core.routing)
    # a role change is a drain and a new label (pearl_hpc's engines: NIXL kv_both), not
    # PEARL's measured restart ("tens of seconds")
    rerole_in_place: bool = False
    # a replay of a real run from its start-up's end: the reserved workers are up and
    # the capacity of the trace's first point is in place before the first batch starts
    # (else: they start like any joiner, the trace's points arrive as events)
    after_startup: bool = False
    overlap_workers: int | None = None  # None: one per TP set of the training GPUs
