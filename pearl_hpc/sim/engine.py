"""Discrete-event simulator of agentic RL rollout + training, driving the production
controller (:class:`pearl_hpc.core.controller.Controller`) through an Executor.

Granularity is the phase, not the token: a turn is *route -> prefill -> (KV transfer)
-> decode -> environment*. Inside a worker, decoding sequences share the engine by
processor sharing (one token per sequence per iteration; an iteration lasts
``CostModel.decode_iteration_s``), tracked with a per-worker virtual clock so each event
costs O(log n). Prefill jobs run first-come first-served, several prompts to a chunk of
up to ``CHUNK_TOKENS`` per iteration (less the iteration's decode tokens on a colocated
worker); there a pending chunk lengthens every decode iteration (the interference PEARL
measures). KV memory follows each role's engine (:mod:`pearl_hpc.sim.entities`: on
demand with recompute preemption when colocated, preallocated prompt + ``max_tokens`` on
decode workers, admission waits when it does not fit); a worker keeps idle trajectories'
contexts in an LRU prefix cache, so a turn that returns to the same worker prefills only
its new tokens and one that moves re-prefills its whole context; every weight update
empties the prefix caches.

The engine inside a worker (admission, chunks, processor sharing, preemption, drain) is
:class:`pearl_hpc.sim.physics.WorkerPhysics`; this module routes turns, runs the
controller's plans, the batches and training. Events are ordered by
``(time_s, priority, seq)``; all randomness is the workload's
seeded generator, so a seed gives one result.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pearl_hpc.core.controller import (
    CapacityGranted,
    CapacityReclaimed,
    Controller,
    StepTelemetry,
    TrainingBegin,
    TrainingFinished,
    WorkerReady,
    WorkerReleased,
)
from pearl_hpc.core.orchestrator import WorkerAdd
from pearl_hpc.core.policies import TurnsLeft, prefill_locally, tail_dispatch_key, tail_level
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.routing import route_mode
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.core.tracker import IterationRecord, TurnRecord
from pearl_hpc.core.types import Mode, Role, Status, Zone
from pearl_hpc.sim.costmodel import CostModel
from pearl_hpc.sim.entities import (
    P_ARRIVAL,
    P_CAPACITY,
    P_CONTROL,
    P_WORK,
    Request,
    SimInvariantError,
    SimSetup,
    SimWorker,
    StepRecord,
    Traj,
)
from pearl_hpc.sim.physics import WorkerPhysics
from pearl_hpc.sim.workload import TrajectorySpec, WorkloadConfig, WorkloadGenerator

DEDICATED_RELEASE_S = 1.0  # stop a dedicated worker: abort requests, free the GPUs
RETURN_DEADLINE_S = 120.0  # borrowed GPUs not back this long after Training Begin: a bug


# ----------------------------------------------------------------------- simulator
class Simulator(WorkerPhysics):
    def __init__(
        self,
        setup: SimSetup,
        cost: CostModel,
        workload: WorkloadConfig,
        profile: WorkloadProfile,
        *,
        seed: int,
        duration_s: float,
        check_invariants: bool = True,
        progress: Callable[[float], None] | None = None,
        batches: Callable[[int], Sequence[TrajectorySpec]] | None = None,
        max_steps: int | None = None,
    ) -> None:
        """``batches(step)``: the trajectories of each rollout batch (None: drawn by the
        workload's seeded generator); ``max_steps``: the run ends when that many steps
        have trained (a replay of a finished run), else at ``duration_s``."""
        self.setup = setup
        self.cost = cost
        self.workload = workload
        self.duration_s = duration_s
        self.batches = batches or WorkloadGenerator(workload, seed).batch
        self.max_steps = max_steps
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.workers: dict[int, SimWorker] = {}
        # the active workers by role, in slot order of arrival (None: every active one);
        # cleared where a worker is added, removed, re-roled or changes state
        self._active_by: dict[Role | None, dict[int, SimWorker]] = {}
        # their router candidates, a heap per role: a worker's entry is pushed when its
        # load falls and replaced lazily when it rose (cleared with _active_by)
        self._candidates: dict[Role, list[tuple[int, int, int]]] = {}
        self.pending: deque[Traj] = deque()  # turns waiting for routing
        self.admission_paused_until = 0.0
        self.progress = progress
        self.controller = Controller(
            profile,
            self,
            policy=setup.policy,
            clock=lambda: self.now,
            check_invariants=check_invariants,
        )
        self.steps: list[StepRecord] = []
        self.timeline: list[tuple[float, int, str, str]] = []  # (t, slot, role, state)
        self.budget: list[tuple[float, int]] = []  # (t, dedicated rollout GPUs)
        self.trajs_started = 0
        self.trajs_finished = 0
        self.interrupted_turns = 0
        self.prefilled_tokens = 0  # every token prefilled (cache misses and resumes included)
        self.preempted_turns = 0  # decoding requests preempted for KV and recomputed
        self.kv_waits = 0  # requests whose admission waited for KV on their worker
        self.local_prefills = 0  # disaggregated turns prefilled on their decode worker
        self.borrowed_turns = 0  # turns finished on borrowed (overlap) workers
        self.turns_left = TurnsLeft(profile.mean_turns)  # tail_dispatch's predictor
        self.idle_worker_s = 0.0  # active workers with nothing to run, worker-seconds
        self.active_worker_s = 0.0
        self._idle_at_done = self._active_at_done = self._last_done_s = 0.0
        self.busy_s = 0.0  # worker-seconds in engine iterations
        self.prefill_busy_s = 0.0  # ... in iterations that carry a prefill chunk
        self.released: list[str] = []
        self._turns: list[TurnRecord] = []
        self._iters: list[IterationRecord] = []
        self._batches: dict[int, list[Traj]] = {}
        self._left: dict[int, int] = {}
        self._rollout_step = 0
        self._trained_step = -1  # last finished training step
        self._training_queue: list[int] = []  # heap: completed batches awaiting training
        self._next_train = 0  # training runs the batches in step order
        self._training_running: int | None = None
        self._training_begin_s: float | None = None
        self._training_started = False
        self._borrow_started: dict[int, float] = {}
        self._activation_s: list[float] = []
        self._deactivation_s: list[float] = []
        self._granted: list[tuple[ElasticSource, tuple[str, ...]]] = []  # LIFO stack
        self._job_counter = 0
        self._grant_counter = 0
        self._in_transit = 0  # trajectories in an environment step or a KV transfer
        self._drain_started: dict[int, float] = {}

    # ------------------------------------------------------------- event heap
    def at(self, time_s: float, prio: int, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (time_s, prio, next(self._seq), fn, args))

    def run(self) -> Simulator:
        tp = self.cost.tp
        train_gpus = [f"train:{i}" for i in range(self.setup.training_gpus)]
        overlap = (
            [train_gpus[i : i + tp] for i in range(0, len(train_gpus) - tp + 1, tp)]
            if self.setup.overlap
            else []
        )[: self.setup.overlap_workers]
        self.controller.register_training(train_gpus, overlap_gpu_sets=overlap)
        reserved = [
            [f"res:{i + j}" for j in range(tp)]
            for i in range(0, self.setup.reserved_rollout_gpus - tp + 1, tp)
        ]
        self.controller.grant_reserved(reserved)
        if self.setup.elastic is not None:
            for t, count in zip(self.setup.elastic.times_s, self.setup.elastic.counts, strict=True):
                if t == 0 and self.setup.after_startup:
                    self._on_trace(count)
                elif t <= self.duration_s:
                    self.at(t, P_CAPACITY, self._on_trace, count)
        self._record_budget()
        self._start_batch()
        events = 0
        while self._heap:
            time_s, _, _, fn, args = heapq.heappop(self._heap)
            if time_s > self.duration_s:
                break
            self.now = time_s
            fn(*args)
            events += 1
            if self._trained_step + 1 == self.max_steps:
                break
            if self.progress is not None and events % 4096 == 0:
                self.progress(self.now)
        self.now = self.duration_s
        self.events = events
        self.check_census()
        return self

    def check_census(self) -> None:
        """No trajectory lost: every started one is finished, queued, on a worker, or in
        an environment step / KV transfer."""
        on_workers = sum(
            len(w.decode) + len(w.prefill) + len(w.waiting) for w in self.workers.values()
        )
        accounted = self.trajs_finished + len(self.pending) + on_workers + self._in_transit
        if accounted != self.trajs_started:
            raise SimInvariantError(
                f"{self.trajs_started} trajectories started but {accounted} accounted for "
                f"({self.trajs_finished} finished, {len(self.pending)} queued, {on_workers} "
                f"on workers, {self._in_transit} in environment/transfer)"
            )

    # ------------------------------------------------------------ capacity trace
    def _dedicated_gpus(self) -> int:
        return self.setup.reserved_rollout_gpus + self._elastic_gpus()

    def _elastic_gpus(self) -> int:
        return sum(len(g) for _, g in self._granted)

    def _on_trace(self, count: int) -> None:
        tp = self.cost.tp
        target = (count // tp) * tp
        have = self._elastic_gpus()
        if target > have:
            self._job_counter += 1
            source = ElasticSource(f"spot{self._job_counter}", 0)
            sets = []
            for _ in range((target - have) // tp):
                gpus = tuple(f"spot:{self._grant_counter}:{j}" for j in range(tp))
                self._grant_counter += 1
                sets.append(gpus)
                self._granted.append((source, gpus))
            self.controller.handle(CapacityGranted(source, tuple(sets)))
        reclaimed: dict[ElasticSource, list[str]] = {}
        while self._elastic_gpus() > target:
            source, gpus = self._granted.pop()  # last granted, first reclaimed
            reclaimed.setdefault(source, []).extend(gpus)
        for source, gpu_ids in reclaimed.items():
            deadline = self.now + self.setup.grace_s
            self.controller.handle(CapacityReclaimed(source, deadline, tuple(gpu_ids)))
        self._record_budget()

    def _record_budget(self) -> None:
        self.budget.append((self.now, self._dedicated_gpus()))

    # ------------------------------------------------------------------- executor
    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        for add in adds:
            w = SimWorker(
                add.slot_id, add.role, add.zone, self.cost.kv_capacity_tokens, updated_s=self.now
            )
            self.workers[add.slot_id] = w
            self._table_changed()
            self._mark(w, "starting")
            if add.reactivate:
                delay = self.cost.reconfig_s("activation")
                self._borrow_started[add.slot_id] = self.now
            elif add.source is None and self.setup.after_startup:
                delay = 0.0
            elif not self.setup.weight_pull:
                delay = 1.0
            else:  # prewarm: the joiner's finalisation runs in its own background
                warm = self.cost.reconfig_s("finalisation") if self.setup.policy.prewarm else 0
                delay = self.cost.reconfig_s("preparation") + warm
            self.at(self.now + delay, P_CONTROL, self._worker_ready, add.slot_id, w)

    def _worker_ready(self, slot_id: int, w: SimWorker) -> None:
        if self.workers.get(slot_id) is not w or w.state not in ("starting", "rerole"):
            return  # cancelled meanwhile
        if slot_id in self._borrow_started:
            self._activation_s.append(self.now - self._borrow_started.pop(slot_id))
        self.controller.handle(WorkerReady(slot_id))

    def admit(self, slot_ids: Sequence[int]) -> None:
        inter_scale = any(
            w.zone is Zone.DEDICATED for w in (self.workers.get(s) for s in slot_ids) if w
        )
        pause = 0.0
        if inter_scale and self.setup.weight_pull and not self.setup.policy.prewarm:
            pause = self.cost.reconfig_s("finalisation")
        self.admission_paused_until = max(self.admission_paused_until, self.now + pause)
        self.at(self.now + pause, P_CONTROL, self._activate, list(slot_ids))

    def _activate(self, slot_ids: list[int]) -> None:
        for s in slot_ids:
            w = self.workers.get(s)
            if w is not None and w.state == "starting":
                self._mark(w, "active")
        self._dispatch()

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        for slot_id, role in changes:
            w = self.workers[slot_id]
            w.set_role(role)
            self._table_changed()
            if w.state == "starting":
                continue  # joins directly in its new role
            if w.state != "rerole":
                self._drain(w)
                self._mark(w, "rerole")
                rerole_s = 0.0 if self.setup.rerole_in_place else self.cost.reconfig_s("rerole")
                self.at(
                    self.now + rerole_s,
                    P_CONTROL,
                    self._rerole_done,
                    slot_id,
                    w,
                )
        self._dispatch()

    def _rerole_done(self, slot_id: int, w: SimWorker) -> None:
        if self.workers.get(slot_id) is not w or w.state != "rerole":
            return
        self._mark(w, "active")
        self.controller.handle(WorkerReady(slot_id))
        self._dispatch()

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        for slot_id in slot_ids:
            w = self.workers.get(slot_id)
            if w is None or w.state in ("draining", "off"):
                continue
            self._drain(w)
            self._mark(w, "draining")
            self._drain_started[slot_id] = self.now
            delay = (
                self.cost.reconfig_s("deactivation")
                if w.zone is Zone.OVERLAP
                else DEDICATED_RELEASE_S
            )
            done = self.now + delay
            if deadline_s is not None:
                done = min(done, deadline_s)
            self.at(done, P_CONTROL, self._released, slot_id, w)
        self._dispatch()

    def _released(self, slot_id: int, w: SimWorker) -> None:
        if self.workers.get(slot_id) is not w:
            return
        if w.zone is Zone.OVERLAP:
            self._deactivation_s.append(self.now - self._drain_started.pop(slot_id, self.now))
        self._mark(w, "off")
        del self.workers[slot_id]
        self._table_changed()
        self.controller.handle(WorkerReleased(slot_id))

    def start_training(self, step: int) -> None:
        busy = [w.slot_id for w in self.workers.values() if w.zone is Zone.OVERLAP]
        if busy:
            raise SimInvariantError(
                f"training step {step} starts while overlap workers {busy} hold GPUs"
            )
        assert self._training_begin_s is not None
        wait_s = self.now - self._training_begin_s
        self._training_started = True
        rec = self.steps[step]
        rec.training_return_s = wait_s
        done_s = self.now + self.cost.training_step_s(rec.trained_tokens, self.setup.training_gpus)
        self.at(done_s - self.cost.weight_sync_s, P_CONTROL, self._pause_for_sync, done_s)
        self.at(done_s, P_CONTROL, self._training_done, step)

    def _pause_for_sync(self, until_s: float) -> None:
        """The weight broadcast reaches the engines: none generates until it is loaded
        (the engines pause for ``update_weights``)."""
        for w in self.workers.values():
            self._advance(w)
            w.paused_until = until_s
            self._reschedule(w)

    def release_capacity(self, source: ElasticSource) -> None:
        """The controller gives an elastic job back (declined, drained or failed): its
        GPUs leave the budget; a later rise of the trace may grant them again."""
        self.released.append(source.tag)
        self._granted = [(src, gpus) for src, gpus in self._granted if src != source]
        self._record_budget()

    # ------------------------------------------------------------------ training
    def _training_done(self, step: int) -> None:
        self._trained_step = step
        self.steps[step].trained_s = self.now
        self._training_running = None
        # the new weights reach every engine, which drops the prefix cache computed by
        # the old ones (as pearl_hpc's vLLM engines and SGLang's update_weights do):
        # running requests keep their KV, idle trajectories re-prefill their context
        for w in self.workers.values():
            w.clear_cache()
        unfinished = self._left.get(self._rollout_step, self.workload.batch_size)
        self.controller.handle(TrainingFinished(step, unfinished))
        self._maybe_train()
        self._maybe_start_next_batch()

    def _maybe_train(self) -> None:
        # in step order: with tail_start a later batch can complete first
        queue = self._training_queue
        if self._training_running is not None or not queue or queue[0] != self._next_train:
            return
        step = heapq.heappop(queue)
        self._next_train = step + 1
        self._training_running = step
        self._training_begin_s = self.now
        self._training_started = False
        self.at(self.now + RETURN_DEADLINE_S, P_CONTROL, self._check_returned, step)
        self.controller.handle(TrainingBegin(step))

    def _check_returned(self, step: int) -> None:
        if self._training_running == step and not self._training_started:
            raise SimInvariantError(
                f"training step {step} still waits for borrowed GPUs after {RETURN_DEADLINE_S} s"
            )

    # ------------------------------------------------------------------ batches
    def _start_batch(self) -> None:
        step = self._rollout_step
        specs = self.batches(step)
        trajs = [Traj(spec, step) for spec in specs]
        self._batches[step] = trajs
        self._left[step] = len(trajs)
        config = str(self.controller.table.serving_config())
        self.steps.append(StepRecord(step, 0.0, rollout_started_s=self.now, config=config))
        self.trajs_started += len(trajs)
        for t in trajs:
            t.turn_started_s = self.now
            self.pending.append(t)
        self._dispatch()

    def _maybe_start_next_batch(self) -> None:
        # staleness s: batch j may start once training step j - 1 - s has finished
        # (tail_start: also while the newest batch's tail leaves workers idle)
        nxt = self._rollout_step + 1
        if nxt == self.max_steps:
            return
        left = self._left.get(self._rollout_step, 1)
        tail = self.setup.policy.tail_start and left < self._tail_level()
        if (left == 0 or tail) and self._trained_step >= nxt - 1 - self.workload.staleness:
            self._rollout_step = nxt
            self._start_batch()

    def _tail_level(self) -> float:
        return tail_level(self.controller.profile, len(self._active()))

    def _batch_done(self, step: int) -> None:
        rec = self.steps[step]
        rec.started_s, rec.finished_s = self._last_done_s, self.now  # one window each
        self._last_done_s = self.now
        for w in self.workers.values():  # settle the workers' idle time up to now
            self._advance(w)
        rec.idle_worker_s = self.idle_worker_s - self._idle_at_done
        rec.active_worker_s = self.active_worker_s - self._active_at_done
        self._idle_at_done, self._active_at_done = self.idle_worker_s, self.active_worker_s
        trajs = self._batches.pop(step)
        rec.generated_tokens = sum(t.spec.generated_tokens for t in trajs)
        rec.trained_tokens = sum(t.spec.total_tokens for t in trajs)
        cfg = self.controller.table.role_counts()
        rec.num_prefill, rec.num_decode = cfg[Role.PREFILL], cfg[Role.DECODE]
        rec.num_colocated = cfg[Role.COLOCATED]
        rec.mode = "disaggregated" if rec.num_prefill else "colocated"
        rec.borrowed_workers = sum(
            1 for s in self.controller.table.overlap_workers() if s.status is not Status.INACTIVE
        )
        rec.dedicated_gpus = self._dedicated_gpus()
        telemetry = StepTelemetry(
            step,
            tuple(self._turns),
            tuple(self._iters),
            batch_size=len(trajs),
            borrowed=bool(self._activation_s),
            activation_s=sum(self._activation_s) / len(self._activation_s)
            if self._activation_s
            else 0.0,
            deactivation_s=sum(self._deactivation_s) / len(self._deactivation_s)
            if self._deactivation_s
            else 0.0,
        )
        self._turns, self._iters = [], []
        self._activation_s, self._deactivation_s = [], []
        self.controller.handle(telemetry)
        heapq.heappush(self._training_queue, step)
        self._maybe_train()
        self._maybe_start_next_batch()

    # ------------------------------------------------------------------- routing
    def _active(self, role: Role | None = None) -> dict[int, SimWorker]:
        """The active workers (of ``role``) by slot; kept until the table changes (a
        dispatch per turn must not rescan a thousand workers)."""
        active = self._active_by.get(role)
        if active is None:
            active = self._active_by[role] = {
                w.slot_id: w
                for w in self.workers.values()
                if w.state == "active" and (role is None or w.role is role)
            }
        return active

    def _table_changed(self) -> None:
        self._active_by.clear()
        self._candidates.clear()

    def _candidate_heap(self, role: Role) -> list[tuple[int, int, int]]:
        """The candidates of the active workers of ``role`` as a heap whose top, once
        :meth:`_least` has fixed it, is the least-loaded worker."""
        heap = self._candidates.get(role)
        pool = self._active(role)
        if heap is None or len(heap) > 4 * len(pool) + 64:  # (re)built, or compacted
            heap = self._candidates[role] = [w.candidate for w in pool.values()]
            heapq.heapify(heap)
        return heap

    def _least(self, role: Role) -> tuple[int, int, int]:
        """The least candidate among the active workers of ``role`` (as ``min`` over
        them): an entry that is not its worker's candidate any more is replaced."""
        heap, pool = self._candidate_heap(role), self._active(role)
        while heap[0] != (now := pool[heap[0][2]].candidate):
            heapq.heapreplace(heap, now)
        return heap[0]

    def _unloaded(self, w: SimWorker) -> None:
        heap = self._candidates.get(w.role) if w.role is not None else None
        if heap is not None and w.slot_id in self._active(w.role):
            heapq.heappush(heap, w.candidate)

    def _dispatch(self) -> None:
        if self.now < self.admission_paused_until:
            self.at(self.admission_paused_until, P_ARRIVAL, self._dispatch)
            return
        if not self.pending:
            return
        coloc = self._active(Role.COLOCATED)
        prefill = self._active(Role.PREFILL)
        decode = self._active(Role.DECODE)
        mode = route_mode(bool(prefill), bool(coloc), bool(prefill and decode))
        if mode is None:
            return  # nothing can serve: turns wait for capacity
        role = Role.COLOCATED if mode is Mode.COLOCATED else Role.PREFILL
        pool = self._active(role)
        local = decode if self.setup.policy.local_prefill else {}
        while self.pending:
            traj = self.pending.popleft()
            holder = (
                local.get(traj.decode_worker)
                if mode is Mode.DISAGGREGATED and traj.decode_worker is not None
                else None
            )
            if holder is not None and self._prefill_here(holder, traj):
                self.local_prefills += 1
                self._submit_prefill(holder, traj)
                continue
            held = pool.get(traj.worker) if traj.worker is not None else None
            least = self._least(role)
            key = self.setup.routing.choose(least, None if held is None else held.candidate)
            self._submit_prefill(pool[key], traj)

    def _prefill_here(self, w: SimWorker, traj: Traj) -> bool:
        """local_prefill: the decode worker holding the turn's prefix prefills it itself
        when that is cheaper than a prefill worker and a KV transfer."""
        prompt, uncached = self._prefill_need(w, traj)
        return prefill_locally(self.controller.profile, uncached, prompt, len(w.decode))

    def _prefill_need(self, w: SimWorker, traj: Traj) -> tuple[int, int]:
        """The turn's prompt -- with a response interrupted earlier (token-level resume)
        -- and the part of it ``w`` has not cached (all of it when the agent rewrote its
        history)."""
        prompt = traj.context + traj.spec.turns[traj.turn].new_tokens + traj.done_gen
        cached = w.cache.get(traj.spec.trajectory_id, 0) if self.workload.prefix_reuse else 0
        return prompt, prompt - min(cached, traj.context)

    def _submit_prefill(self, w: SimWorker, traj: Traj) -> None:
        turn = traj.spec.turns[traj.turn]
        prompt, tokens = self._prefill_need(w, traj)
        w.uncache(traj.spec.trajectory_id)  # the prefix now belongs to the running request
        req = Request(traj, prefill_tokens=max(1, tokens), gen_left=turn.gen_tokens - traj.done_gen)
        if self.setup.policy.tail_dispatch:
            profile, seq = self.controller.profile, next(self._seq)
            req.order = tail_dispatch_key(profile, self.turns_left, traj.step, traj.turn, seq)
        traj.prefilled += req.prefill_tokens
        self.prefilled_tokens += req.prefill_tokens
        req.kv_tokens = req.prompt_tokens = prompt  # the prompt's KV, allocated at admission
        if w.role is Role.DECODE:  # prefilled locally (local_prefill): decode preallocates
            req.kv_tokens = self._decode_reservation(req)
        else:
            traj.worker = w.slot_id
        w.routed += 1
        self._admit(w, "prefill", req)

    # -------------------------------------- a turn: prefill, KV transfer, decode, tool
    def _prefill_done(self, w: SimWorker, req: Request) -> None:
        if w.role is not Role.PREFILL:  # decode in place, KV already reserved
            self._enter(w, "decode", req, reserve=False)
            return
        # disaggregated: hand the KV to a decode worker, keep the prefix cached here
        self._release_kv(w, req, keep_cache=True)
        self._in_transit += 1
        self.at(
            self.now + self.cost.transfer_s(req.prompt_tokens),
            P_WORK,
            self._to_decode,
            req,
        )

    def _to_decode(self, req: Request) -> None:
        self._in_transit -= 1
        decode = self._active(Role.DECODE)
        if not decode:  # no decode worker any more: the turn is re-routed whole
            self._requeue(req.traj)
            return
        w = decode[self.setup.routing.choose(self._least(Role.DECODE), None)]
        w.routed += 1
        req.kv_tokens = self._decode_reservation(req)
        self._admit(w, "decode", req)

    def _decode_reservation(self, req: Request) -> int:
        """What a decode worker preallocates: the prompt and the response's whole budget
        (max_tokens, cut to the trajectory cap)."""
        cfg = self.workload
        budget = min(
            cfg.gen_tokens_max - req.traj.done_gen, cfg.max_trajectory_tokens - req.prompt_tokens
        )
        return req.prompt_tokens + max(req.gen_left, budget)

    def _turn_done(self, req: Request, w: SimWorker) -> None:
        traj = req.traj
        turn = traj.spec.turns[traj.turn]
        traj.context += turn.new_tokens + turn.kept_tokens
        if w.zone is Zone.OVERLAP:
            self.borrowed_turns += 1
        self._turns.append(
            TurnRecord(
                traj.spec.trajectory_id,
                traj.turn,
                traj.prefilled,  # new input tokens actually prefilled (cache misses too)
                turn.gen_tokens,
                traj.context,
                turn.env_s,
                w.slot_id,
                w.role,
                self.now - traj.turn_started_s,
            )
        )
        traj.done_gen = traj.prefilled = 0
        traj.turn += 1
        if traj.turn >= len(traj.spec.turns):
            if traj.finished_s is not None:
                raise SimInvariantError(f"trajectory {traj.spec.trajectory_id} finished twice")
            traj.finished_s = self.now
            for slot in traj.cached_on:  # its prefix will never be used again
                holder = self.workers.get(slot)
                if holder is not None:
                    holder.uncache(traj.spec.trajectory_id)
            self.trajs_finished += 1
            self.turns_left.observe(len(traj.spec.turns))
            self._left[traj.step] -= 1
            if self._left[traj.step] == 0:
                self._batch_done(traj.step)
            elif self.setup.policy.tail_start:
                self._maybe_start_next_batch()
            return
        self._in_transit += 1
        self.at(self.now + turn.env_s, P_ARRIVAL, self._env_done, traj)

    def _env_done(self, traj: Traj) -> None:
        self._in_transit -= 1
        traj.turn_started_s = self.now
        self._requeue(traj)

    def _requeue(self, traj: Traj) -> None:
        self.pending.append(traj)
        self._dispatch()

    # ------------------------------------------------------------------ timeline
    def _mark(self, w: SimWorker, state: str) -> None:
        w.state = state
        self._table_changed()
        self.timeline.append(
            (
                self.now,
                w.slot_id,
                w.role.value,
                state if w.zone is Zone.DEDICATED else f"{state}-borrowed",
            )
        )
