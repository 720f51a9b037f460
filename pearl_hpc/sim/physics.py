"""The engine inside each simulated worker: admission against its KV, prefill chunks
and processor-shared decoding, preemption and drain (the physics the module docstring
of :mod:`pearl_hpc.sim.engine` describes).

:class:`WorkerPhysics` is the part of :class:`~pearl_hpc.sim.engine.Simulator` that
moves requests through one worker; the simulator around it routes turns, runs the
controller's plans, the batches and training. A finished prefill or decode is handed
back to it (``_prefill_done``, ``_turn_done``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from pearl_hpc.core.tracker import IterationRecord
from pearl_hpc.core.types import Role
from pearl_hpc.sim.costmodel import CostModel
from pearl_hpc.sim.entities import P_WORK, Request, SimSetup, SimWorker, Traj, insert_ordered


class WorkerPhysics:
    """Per-worker engine model: each method takes the worker it acts on."""

    # what the simulator provides
    now: float
    cost: CostModel
    setup: SimSetup
    pending: deque[Traj]
    _seq: itertools.count[int]
    _iters: list[IterationRecord]
    active_worker_s: float
    idle_worker_s: float
    busy_s: float
    prefill_busy_s: float
    prefilled_tokens: int
    preempted_turns: int
    kv_waits: int
    interrupted_turns: int
    workers: dict[int, SimWorker]

    def at(self, time_s: float, prio: int, fn: Callable[..., None], *args: Any) -> None:
        raise NotImplementedError

    def _turn_done(self, req: Request, w: SimWorker) -> None:
        raise NotImplementedError

    def _prefill_done(self, w: SimWorker, req: Request) -> None:
        raise NotImplementedError

    def _unloaded(self, w: SimWorker) -> None:
        """``w`` carries fewer requests than before (the router's view of it fell)."""

    def _admit(self, w: SimWorker, phase: str, req: Request) -> None:
        self._advance(w)
        if not w.fits(req.kv_tokens):
            self.kv_waits += 1
            if self.setup.policy.tail_dispatch:
                insert_ordered(w.waiting, (phase, req), lambda e: e[1].order)
            else:
                w.waiting.append((phase, req))
            return
        self._enter(w, phase, req)
        self._reschedule(w)

    def _enter(self, w: SimWorker, phase: str, req: Request, *, reserve: bool = True) -> None:
        if reserve:
            w.kv_static += req.kv_tokens
            w.evict()
        req.worker = w.slot_id
        if phase == "prefill":
            if not w.prefill:
                w.prefill_left = req.prefill_tokens
            if self.setup.policy.tail_dispatch:  # behind the head, which is under way
                insert_ordered(w.prefill, req, lambda r: r.order, first=1)
            else:
                w.prefill.append(req)
            w.prefill_backlog += req.prefill_tokens
        else:
            req.started_vt = w.vt
            req.finish_vt = w.vt + req.gen_left
            heapq.heappush(w.decode, (req.finish_vt, next(self._seq), req))
            w.decode_ctx += req.decode_ctx
            w.started_sum += req.started_vt

    def _leave_decode(self, w: SimWorker, req: Request) -> None:
        """Bookkeeping of a request that stops decoding on ``w`` (popped from the heap);
        what it grew becomes part of its allocation."""
        w.decode_ctx -= req.decode_ctx
        w.started_sum = w.started_sum - req.started_vt if w.decode else 0.0
        if w.grows:
            grown = round(w.vt - req.started_vt)
            w.kv_static += grown
            req.kv_tokens += grown

    def _advance(self, w: SimWorker) -> None:
        dt = self.now - w.updated_s
        if dt > 0 and w.state == "active":
            self.active_worker_s += dt
            if not (w.decode or w.prefill):
                self.idle_worker_s += dt
        if dt > 0:
            if w.decode:
                w.vt += w.decode_rate * dt
                if w.cache and w.grows:
                    w.evict()
            if w.prefill:
                done = min(w.prefill_left, w.prefill_rate * dt)
                w.prefill_left -= done
                w.prefill_backlog = max(0.0, w.prefill_backlog - done)
            if (w.decode or w.prefill) and w.iteration_s > 0:
                self.busy_s += dt
                if w.prefill:
                    self.prefill_busy_s += dt
                self._iters.append(
                    IterationRecord(
                        w.slot_id,
                        w.role,
                        len(w.decode),
                        int(w.decode_ctx),
                        int(w.chunk),
                        w.iteration_s,
                        count=dt / w.iteration_s,
                    )
                )
        w.updated_s = self.now

    def _reschedule(self, w: SimWorker) -> None:
        if self.now < w.paused_until:  # loading new weights: nothing runs until then
            w.iteration_s = w.decode_rate = w.prefill_rate = w.chunk = 0.0
            w.version += 1
            self.at(w.paused_until, P_WORK, self._on_worker, w, w.version)
            return
        cost = self.cost
        n = len(w.decode)
        ctx = w.decode_ctx
        if w.prefill:
            head = w.prefill[0]
            chunk = w.chunk = w.prefill_chunk()
            # attention span of the head's part: its prompt up to where prefill has got to
            span = head.prompt_tokens - w.prefill_left + min(chunk, w.prefill_left) / 2
            if n and w.role is not Role.PREFILL:  # colocated, or a decode worker's local prefill
                it = cost.mixed_iteration_s(n, ctx, chunk, span)
            else:
                it = cost.prefill_iteration_s(chunk, span)
            w.prefill_rate = chunk / it
            w.iteration_s = it
            w.decode_rate = 1.0 / it if n else 0.0
        elif n:
            it = cost.decode_iteration_s(n, ctx)
            w.iteration_s = it
            w.decode_rate = 1.0 / it
            w.prefill_rate = w.chunk = 0.0
        else:
            w.iteration_s = w.decode_rate = w.prefill_rate = w.chunk = 0.0
        w.version += 1
        nxt = float("inf")
        if n:
            nxt = self.now + max(0.0, w.decode[0][0] - w.vt) / w.decode_rate
        if w.prefill:
            nxt = min(nxt, self.now + w.prefill_left / w.prefill_rate)
        if n > 1 and w.grows:  # colocated decoding fills the KV: preempt then
            nxt = min(nxt, self.now + max(0.0, w.full_at_vt() - w.vt) / w.decode_rate)
        if nxt < float("inf"):
            self.at(nxt, P_WORK, self._on_worker, w, w.version)

    def _on_worker(self, w: SimWorker, version: int) -> None:
        if version != w.version or self.workers.get(w.slot_id) is not w:
            return
        self._advance(w)
        eps = 1e-6
        done_decode: list[Request] = []
        while w.decode and w.decode[0][0] - w.vt <= eps:
            _, _, req = heapq.heappop(w.decode)
            self._leave_decode(w, req)
            done_decode.append(req)
        done_prefill: Request | None = None
        if w.prefill and w.prefill_left <= eps:
            done_prefill = w.prefill.popleft()
            w.prefill_left = float(w.prefill[0].prefill_tokens) if w.prefill else 0.0
        if done_decode or done_prefill is not None:
            self._unloaded(w)  # before the finished turns move on (and route others)
        for req in done_decode:
            if w.role is Role.DECODE:
                req.traj.decode_worker = w.slot_id
            keep = w.role is Role.COLOCATED or (
                w.role is Role.DECODE and self.setup.policy.local_prefill
            )
            self._release_kv(w, req, keep_cache=keep)
            self._turn_done(req, w)
        if done_prefill is not None:
            self._prefill_done(w, done_prefill)
        while len(w.decode) > 1 and w.kv_used > w.kv_capacity - 1:
            self._preempt(w)
        self._admit_waiting(w)
        self._reschedule(w)

    def _preempt(self, w: SimWorker) -> None:
        """The KV is full: the newest decoding request gives its blocks back and waits at
        the head of the queue; when readmitted it recomputes its prompt and what it had
        generated (vLLM's recompute preemption)."""
        newest = max(w.decode, key=lambda e: (e[2].started_vt, e[1]))
        w.decode.remove(newest)
        heapq.heapify(w.decode)
        req = newest[2]
        self._leave_decode(w, req)
        w.kv_static -= req.kv_tokens
        done = req.kv_tokens - req.prompt_tokens
        req.traj.done_gen += done
        req.gen_left -= done
        req.prompt_tokens = req.kv_tokens
        req.prefill_tokens = req.prompt_tokens
        req.traj.prefilled += req.prefill_tokens
        self.prefilled_tokens += req.prefill_tokens
        self.preempted_turns += 1
        w.waiting.appendleft(("prefill", req))

    def _release_kv(self, w: SimWorker, req: Request, *, keep_cache: bool) -> None:
        w.kv_static -= req.kv_tokens
        if keep_cache:  # the prompt stays cached as a prefix (not this turn's reasoning)
            traj = req.traj
            w.cache_prefix(
                traj.spec.trajectory_id, traj.context + traj.spec.turns[traj.turn].new_tokens
            )
            traj.cached_on.add(w.slot_id)

    def _admit_waiting(self, w: SimWorker) -> None:
        while w.waiting:
            phase, req = w.waiting[0]
            if not w.fits(req.kv_tokens):
                break
            w.waiting.popleft()
            self._enter(w, phase, req)

    def _drain(self, w: SimWorker) -> None:
        """Abort everything on ``w`` keeping partial trajectories: generated tokens stay,
        an interrupted prefill is redone elsewhere."""
        self._advance(w)
        victims: list[Request] = [r for _, r in w.waiting]
        for _, _, req in w.decode:
            req.traj.done_gen += int(w.vt - req.started_vt)
            victims.append(req)
        victims.extend(w.prefill)
        w.decode.clear()
        w.prefill.clear()
        w.waiting.clear()
        w.decode_ctx = 0.0
        w.kv_static = 0
        w.started_sum = 0.0
        w.prefill_left = w.prefill_backlog = 0.0
        w.clear_cache()
        self._reschedule(w)
        for req in victims:
            self.interrupted_turns += 1
            req.traj.interrupts += 1
            turn = req.traj.spec.turns[req.traj.turn]
            req.traj.done_gen = min(req.traj.done_gen, turn.gen_tokens - 1)
            req.traj.worker = None
            self.pending.append(req.traj)
