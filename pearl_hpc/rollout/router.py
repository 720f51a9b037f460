"""Route each turn to engine workers according to the current role configuration.

Pure choice (:class:`RoutingTable`) and asynchronous dispatch (:class:`Router`). The rules
are :mod:`pearl_hpc.core.routing`'s (the simulator uses the same): the mode, the
least-loaded worker with its tie-breaks, and stickiness to the worker holding a
trajectory's prefix (colocated workers, and prefill workers in PD).

- **Colocated mode**: a turn goes to a colocated worker, sticky to the one that holds its
  prefix unless that one is too busy (``RoutingRule``).
- **Disaggregated mode**: a prefill worker (sticky the same way) runs the turn's prompt
  with ``max_tokens=1`` and ``do_remote_decode``; the least-loaded decode worker then
  generates with the returned ``kv_transfer_params`` (it pulls the KV over NIXL).
- **Conditional disaggregation** (``policy.local_prefill``): the table remembers which
  decode worker generated each trajectory's last turn and how much of its context it
  holds (its prefix cache keeps the pulled KV and the generated tokens). A turn whose
  prompt extends that context goes whole to that worker, which prefills the new tokens
  itself, when the injected rule (``core.policies.prefill_locally`` on the live profile)
  says that costs less than the prefill worker plus the KV transfer. A weight update
  empties every prefix cache: a holder that last served older weights than the newest
  any worker returned is not used.
- **Load** is requests in flight on the worker; ties go to the worker routed the fewest
  turns in total, then to the smallest worker id.
- **Idle time**: each worker's seconds with no request in flight, summed over the workers
  routed to (``idle_totals``): the master reads it at a batch's tail and end to report
  the worker time the tail leaves unused.
- **Admission** can be paused (atomic finalisation of a plan: no new turn starts while
  the role table changes; running turns go on) and a worker can be removed from routing
  at once (``remove``): no new turn reaches it, even before its drain completes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pearl_hpc.core.routing import RoutingRule, route_mode
from pearl_hpc.core.types import Mode, Role
from pearl_hpc.engine.client import EngineClient
from pearl_hpc.engine.types import Draining, EngineError, TurnRequest, TurnResult
from pearl_hpc.errors import PearlError

log = logging.getLogger(__name__)


class NoWorkers(PearlError):
    """No admitting worker can serve a turn within the wait limit."""


@dataclass
class _Entry:
    role: Role
    since_s: float  # routed to from then on
    idle_since_s: float | None  # nothing in flight from then on (None: busy)
    in_flight: int = 0
    routed: int = 0
    admitting: bool = True
    idle_s: float = 0.0  # settled idle seconds (up to idle_since_s)

    def idle_until(self, now_s: float) -> float:
        return self.idle_s + (now_s - self.idle_since_s if self.idle_since_s is not None else 0.0)


@dataclass(frozen=True, slots=True)
class _Held:
    """The context a decode worker holds of a trajectory after generating its last turn."""

    worker_id: str
    tokens: int  # prompt + generated
    digest: int  # hash of those tokens: the next prompt must start with them
    version: int  # weights that generated it (a weight update empties the cache)


@dataclass(frozen=True)
class IdleTotals:
    """Worker-seconds routed to and idle (nothing in flight), over every worker so far."""

    worker_s: float
    idle_s: float

    def since(self, earlier: IdleTotals) -> IdleTotals:
        """The worker time and idle time between ``earlier`` and these totals."""
        return IdleTotals(self.worker_s - earlier.worker_s, self.idle_s - earlier.idle_s)

    @property
    def share(self) -> float:
        return self.idle_s / self.worker_s if self.worker_s > 0 else 0.0


@dataclass
class RoutingTable:
    """Which workers serve which role, their load and the stickiness map (pure)."""

    rule: RoutingRule = field(default_factory=RoutingRule)
    mode: Mode = Mode.COLOCATED
    workers: dict[str, _Entry] = field(default_factory=dict)
    last_worker: dict[str, str] = field(default_factory=dict)  # trajectory -> prefix holder
    clock: Callable[[], float] = time.monotonic
    # local_prefill's rule: (uncached tokens, prompt tokens, sequences the decode worker
    # has in flight) -> prefill on the decode worker (None: always the prefill worker)
    local_prefill: Callable[[int, int, int], bool] | None = None
    decode_holder: dict[str, _Held] = field(default_factory=dict)  # trajectory -> context
    newest_version: int = -1  # the newest weights any worker returned a turn with
    # of the workers no longer routed to
    _gone: IdleTotals = field(default=IdleTotals(0.0, 0.0), init=False)

    def set_roles(self, roles: Mapping[str, Role]) -> None:
        """Install a role configuration; loads of surviving workers are kept."""
        for wid in list(self.workers):
            if wid not in roles:
                self.remove(wid)
        now = self.clock()
        for wid, role in roles.items():
            entry = self.workers.get(wid)
            if entry is None:
                self.workers[wid] = _Entry(role, since_s=now, idle_since_s=now)
            else:
                entry.role = role
                entry.admitting = True

    def remove(self, worker_id: str) -> None:
        entry = self.workers.pop(worker_id, None)
        if entry is not None:
            now = self.clock()
            self._gone = IdleTotals(
                self._gone.worker_s + now - entry.since_s,
                self._gone.idle_s + entry.idle_until(now),
            )

    def idle_totals(self) -> IdleTotals:
        """Worker-seconds and idle worker-seconds of every worker routed to so far."""
        now = self.clock()
        return IdleTotals(
            self._gone.worker_s + sum(now - e.since_s for e in self.workers.values()),
            self._gone.idle_s + sum(e.idle_until(now) for e in self.workers.values()),
        )

    def set_admitting(self, worker_id: str, admitting: bool) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].admitting = admitting

    def _candidates(self, role: Role) -> list[tuple[int, int, str]]:
        return [
            (e.in_flight, e.routed, w)
            for w, e in self.workers.items()
            if e.role is role and e.admitting
        ]

    def route_mode(self) -> Mode | None:
        """How the next turn is served, or None when no admitting worker can serve it."""
        has_pd = bool(self._candidates(Role.PREFILL)) and bool(self._candidates(Role.DECODE))
        has_col = bool(self._candidates(Role.COLOCATED))
        return route_mode(self.mode is Mode.DISAGGREGATED, has_col, has_pd)

    def choose(self, role: Role, trajectory_id: str | None = None) -> str | None:
        """A worker of ``role``; a colocated or prefill one sticks to the trajectory's prefix."""
        candidates = self._candidates(role)
        if not candidates:
            return None
        last = self.last_worker.get(trajectory_id) if trajectory_id is not None else None
        return self.rule.pick(candidates, last if role is not Role.DECODE else None)

    def started(self, worker_id: str, trajectory_id: str | None = None) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None:
            if entry.idle_since_s is not None:
                entry.idle_s = entry.idle_until(self.clock())
                entry.idle_since_s = None
            entry.in_flight += 1
            entry.routed += 1
        if trajectory_id is not None:
            self.last_worker[trajectory_id] = worker_id

    def finished(self, worker_id: str) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None and entry.in_flight > 0:
            entry.in_flight -= 1
            if entry.in_flight == 0:
                entry.idle_since_s = self.clock()

    def forget(self, trajectory_id: str) -> None:
        self.last_worker.pop(trajectory_id, None)
        self.decode_holder.pop(trajectory_id, None)

    def decoded(
        self, trajectory_id: str, worker_id: str, version: int, context: tuple[int, ...]
    ) -> None:
        """Decode worker ``worker_id`` generated a turn with weights ``version``: it now
        holds ``context`` (prompt + output) in its prefix cache."""
        self.decode_holder[trajectory_id] = _Held(worker_id, len(context), hash(context), version)

    def local_holder(self, trajectory_id: str, prompt: tuple[int, ...]) -> str | None:
        """local_prefill: the decode worker to prefill this turn itself, or None."""
        held = self.decode_holder.get(trajectory_id)
        if self.local_prefill is None or held is None or held.version < self.newest_version:
            return None
        entry = self.workers.get(held.worker_id)
        if entry is None or entry.role is not Role.DECODE or not entry.admitting:
            return None
        if len(prompt) <= held.tokens or hash(prompt[: held.tokens]) != held.digest:
            return None  # the agent rewrote its history: nothing of it is cached there
        uncached = len(prompt) - held.tokens
        local = self.local_prefill(uncached, len(prompt), entry.in_flight)
        return held.worker_id if local else None


@dataclass(frozen=True, slots=True)
class RoutedTurn:
    """A turn's result and where it ran."""

    result: TurnResult  # the decode / colocated result (partial when aborted)
    mode: Mode
    prefill_worker: str | None = None


class Router:
    """Dispatches turns to engine clients following a :class:`RoutingTable`."""

    def __init__(
        self,
        table: RoutingTable | None = None,
        wait_for_workers_s: float = 120.0,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        self.table = table or RoutingTable()
        self.clients: dict[str, EngineClient] = {}
        self.wait_for_workers_s = wait_for_workers_s
        # told when a worker fails a turn (engine died, connection lost): the executor
        # reports it to the controller (WorkerFailed) so the slot gets replaced
        self.on_failure = on_failure
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Event()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # disaggregated turns prefilled on their decode worker, per trajectory (the step
        # pipeline takes its batch's counts when the batch ends)
        self.local_prefills: dict[str, int] = {}

    # ------------------------------------------------------------------ configuration

    def set_workers(
        self,
        clients: Mapping[str, EngineClient],
        roles: Mapping[str, Role],
        mode: Mode | None = None,
    ) -> None:
        self.clients = dict(clients)
        self.table.set_roles({w: roles[w] for w in clients})
        if mode is not None:
            self.table.mode = mode
        self._changed.set()

    def remove(self, worker_id: str) -> None:
        """Take a worker out of routing at once (its running turns finish or get drained)."""
        self.table.remove(worker_id)
        self.clients.pop(worker_id, None)

    def admit(self, worker_id: str) -> None:
        """Route to a worker again (after it was drained and re-admitted)."""
        self.table.set_admitting(worker_id, True)
        self._changed.set()

    def pause(self) -> None:
        """No new turn starts until :meth:`resume` (turns already running go on)."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def wait_idle(self) -> None:
        """Wait until no turn is in flight."""
        await self._idle.wait()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ------------------------------------------------------------------ dispatch

    async def _wait_for(self, what: str) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=self.wait_for_workers_s)
        except TimeoutError:
            raise NoWorkers(
                f"no admitting {what} worker for {self.wait_for_workers_s:.0f} s; "
                f"workers: {dict((w, str(e.role)) for w, e in self.table.workers.items())}"
            ) from None

    async def generate(self, trajectory_id: str, request: TurnRequest) -> RoutedTurn:
        """Run one turn (or the rest of one) somewhere; retries on draining/dead workers."""
        while True:
            await self._open.wait()
            mode = self.table.route_mode()
            if mode is None:
                await self._wait_for("rollout")
                continue
            self._in_flight += 1
            self._idle.clear()
            try:
                if mode is Mode.COLOCATED:
                    wid = self.table.choose(Role.COLOCATED, trajectory_id)
                    assert wid is not None
                    return RoutedTurn(await self._call(wid, request, trajectory_id), mode)
                return await self._disaggregated(trajectory_id, request)
            except _Retry:
                continue
            finally:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

    async def _disaggregated(self, trajectory_id: str, request: TurnRequest) -> RoutedTurn:
        local = self.table.local_holder(trajectory_id, request.prompt_token_ids)
        if local is not None:  # its decode worker holds the prefix: prefill there
            result = await self._call(local, request, None)
            self.local_prefills[trajectory_id] = self.local_prefills.get(trajectory_id, 0) + 1
            self._decoded(trajectory_id, local, request, result)
            return RoutedTurn(result, Mode.DISAGGREGATED, prefill_worker=local)
        pid = self.table.choose(Role.PREFILL, trajectory_id)
        assert pid is not None
        prefill_request = _replace(request, prefill_only=True, logprobs=False)
        pre = await self._call(pid, prefill_request, trajectory_id)  # it holds the prefix
        if pre.aborted or pre.kv_transfer_params is None:
            raise _Retry  # drained during prefill: nothing generated yet, start over
        did = self.table.choose(Role.DECODE)
        if did is None:
            raise _Retry
        decode_request = _replace(
            request, kv_transfer_params=pre.kv_transfer_params, request_id=request.request_id + "-d"
        )
        result = await self._call(did, decode_request, None)
        self._decoded(trajectory_id, did, request, result)
        return RoutedTurn(result, Mode.DISAGGREGATED, prefill_worker=pid)

    def _decoded(
        self, trajectory_id: str, wid: str, request: TurnRequest, result: TurnResult
    ) -> None:
        if self.table.local_prefill is not None:
            context = request.prompt_token_ids + result.token_ids
            self.table.decoded(trajectory_id, wid, result.weight_version, context)

    async def _call(self, wid: str, request: TurnRequest, trajectory_id: str | None) -> TurnResult:
        client = self.clients.get(wid)
        if client is None:
            raise _Retry
        self.table.started(wid, trajectory_id)
        try:
            result = await client.generate(request)
            self.table.newest_version = max(self.table.newest_version, result.weight_version)
            return result
        except Draining:
            self.table.set_admitting(wid, False)
            raise _Retry from None
        except EngineError as exc:
            log.warning("worker %s failed a turn (%s); removed from routing", wid, exc)
            self.remove(wid)
            if self.on_failure is not None:
                self.on_failure(wid, str(exc))
            raise _Retry from None
        finally:
            self.table.finished(wid)


class _Retry(Exception):
    """Internal: route the turn again."""


def _replace(request: TurnRequest, **changes: object) -> TurnRequest:
    from dataclasses import replace

    return replace(request, **changes)  # type: ignore[arg-type]
