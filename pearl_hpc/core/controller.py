"""The controller event loop: pure, single writer, clock injected.

::

    Event ─> Controller.handle(event)
               │ 1. bookkeeping (table, free capacity, tracker, training state)
               │ 2. budget: dedicated workers + granted units (expansion gate)
               │            + idle training GPUs (borrowing gate; never while training)
               │ 3. PD policy -> Decision(target)          (pearl_hpc.core.decision)
               │ 4. plan_transition -> TransitionPlan      (pearl_hpc.core.orchestrator)
               └ 5. table updates + Executor calls: removals first (borrowed workers
                    first of all), then role changes, then background joins that are
                    admitted all at once when every member is ready.

The controller never waits: executors report completion with WorkerReady /
WorkerReleased / WorkerFailed events. It is the only writer of the role table; a real
backend feeds it events from one queue, the simulator from its event heap.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pearl_hpc.core.decision import Decision
from pearl_hpc.core.orchestrator import CapacityUnit, TransitionPlan, WorkerAdd, plan_transition
from pearl_hpc.core.policies import (
    GateDecision,
    Policies,
    PolicyConfig,
    ToggleCostEstimator,
    gate_borrowing_of,
    gate_expansion_of,
    make_policies,
)
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.table import IN_SERVICE, ElasticSource, RoleTable
from pearl_hpc.core.tracker import IterationRecord, RuntimeTracker, TurnRecord
from pearl_hpc.core.types import ROLLOUT_ROLES, Mode, PDConfig, Role, Status, TrainingState, Zone
from pearl_hpc.core.window import CapacityWindow, usable_window_s
from pearl_hpc.errors import SpecError


# ------------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class TrainingBegin:
    """The trainer wants to start step ``step``: borrowed GPUs must come back first."""

    step: int


@dataclass(frozen=True, slots=True)
class TrainingFinished:
    """Step ``step`` trained and its weights are published; training GPUs are idle."""

    step: int
    unfinished_trajectories: int | None = None  # R for the borrowing gate (None: B)


@dataclass(frozen=True, slots=True)
class CapacityGranted:
    """An elastic job (component) is running: one GPU set per prospective worker.
    ``also``: the job's other components, started with it (a heterogeneous job), decided
    on together with this one."""

    source: ElasticSource
    gpu_sets: tuple[tuple[str, ...], ...]
    also: tuple[CapacityGranted, ...] = ()
    role: Role | None = None  # the role its GPUs are shaped for (its pool's); None: any


@dataclass(frozen=True, slots=True)
class CapacityReclaimed:
    """An elastic job (component) must be given back by ``deadline_s``; with ``gpu_ids``
    only the workers and free units on those GPUs (a partial shrink of the job)."""

    source: ElasticSource
    deadline_s: float
    gpu_ids: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A worker finished starting, activating or changing role."""

    slot_id: int


@dataclass(frozen=True, slots=True)
class WorkerReleased:
    """A leaving worker drained (partial trajectories saved) and released its GPUs."""

    slot_id: int


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    """A worker stopped answering or its rank died (an elastic rank's capacity goes
    with it)."""

    slot_id: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class EngineRankBack:
    """The base job's engine rank on ``gpu_ids`` was relaunched after its death and
    serves again (an ``overlap`` one on a trainer's GPUs): its GPUs host a worker again."""

    gpu_ids: tuple[str, ...]
    overlap: bool = False


@dataclass(frozen=True, slots=True)
class TrainersLost:
    """The trainer ranks failed and are being started again: their GPUs come back from
    any overlap engine now (the new ranks load onto them), and none is lent until
    :class:`TrainersBack`."""


@dataclass(frozen=True, slots=True)
class TrainersBack:
    """The trainer ranks started again joined: their idle GPUs may be lent."""


@dataclass(frozen=True, slots=True)
class StepTelemetry:
    """Telemetry of one finished rollout step."""

    step: int
    turns: tuple[TurnRecord, ...] = ()
    iterations: tuple[IterationRecord, ...] = ()
    batch_size: int | None = None
    borrowed: bool = False  # training GPUs were lent during the step
    activation_s: float = 0.0  # measured overlap activation time
    deactivation_s: float = 0.0  # measured overlap return time
    training_wait_s: float = 0.0  # Training Begin -> training started
    # False: the step's borrow was its engine's first start (vLLM compiled): no sample
    # of what a borrow costs from then on
    toggle_sample: bool = True


Event = (
    TrainingBegin
    | TrainingFinished
    | CapacityGranted
    | CapacityReclaimed
    | WorkerReady
    | WorkerReleased
    | WorkerFailed
    | EngineRankBack
    | TrainersLost
    | TrainersBack
    | StepTelemetry
)


# ------------------------------------------------------------------------ executor
class Executor(Protocol):
    """How plans are carried out: the simulator, local processes or Slurm."""

    def start_workers(self, adds: Sequence[WorkerAdd]) -> None:
        """Start new workers / activate overlap workers in the background; report
        WorkerReady (or WorkerFailed) for each. Load the latest weights lazily."""

    def admit(self, slot_ids: Sequence[int]) -> None:
        """Atomic finalisation: route new requests to all of ``slot_ids`` at once."""

    def change_roles(self, changes: Sequence[tuple[int, Role]]) -> None:
        """Drain and re-role workers; report WorkerReady for each."""

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        """Stop routing, interrupt requests keeping partial trajectories, release the
        device; report WorkerReleased for each (before ``deadline_s`` if given)."""

    def start_training(self, step: int) -> None:
        """Training GPUs are free of rollout work: the trainer may start ``step``."""

    def release_capacity(self, source: ElasticSource) -> None:
        """Give an elastic job (component) back (e.g. ``scancel JOB+N``)."""


# ------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Reconfiguration:
    """One pass of decide -> plan -> execute, for logs, reports and tests."""

    time_s: float
    cause: str
    num_workers: int
    borrowed: bool
    decision: Decision
    plan: TransitionPlan
    borrow_gate: GateDecision | None = None
    expansion_gate: GateDecision | None = None


def mode_changes(history: Sequence[Reconfiguration]) -> tuple[list[tuple[float, Mode, Mode]], int]:
    """Of a controller's reconfigurations: the mode switches ``(time, from, to)`` in order,
    and how many changed the P:D ratio of a disaggregated target in place."""
    pairs = list(itertools.pairwise(r.plan.target for r in history))
    times = [r.time_s for r in history[1:]]
    switches = [
        (t, a.mode, b.mode) for t, (a, b) in zip(times, pairs, strict=True) if a.mode != b.mode
    ]
    ratios = sum(1 for a, b in pairs if a.mode is b.mode is Mode.DISAGGREGATED and a != b)
    return switches, ratios


@dataclass
class _AdmissionGroup:
    members: set[int]
    ready: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Demand:
    """The elastic workers worth requesting (:meth:`Controller.elastic_demand`)."""

    workers: int
    window_s: float  # the expected stay of new capacity it was judged over
    reason: str  # the expansion gate of the last worker considered
    starts_in_s: float = 0.0  # when the scheduler expects to start a request made now


class Controller:
    """PEARL's master-side brain. See the module docstring for the data flow."""

    def __init__(
        self,
        profile: WorkloadProfile,
        executor: Executor,
        *,
        policy: PolicyConfig | None = None,
        clock: Callable[[], float],
        table: RoleTable | None = None,
        check_invariants: bool = False,
        policies: Policies | None = None,
    ) -> None:
        self.config = policy or PolicyConfig()
        self.policies = policies or make_policies(self.config)
        self.tracker = RuntimeTracker(profile, ema_alpha=self.config.tracker_ema_alpha)
        self.toggle = ToggleCostEstimator(self.config.toggle_cost_s, self.config.toggle_ema_alpha)
        self.window = CapacityWindow(self.config.expected_capacity_window_s)
        self.run_end_s = math.inf  # the run's predicted end (:meth:`expect_end`)
        self.expansions_rejected = 0  # grants the expansion gate gave straight back
        self.executor = executor
        self.clock = clock
        self.table = table if table is not None else RoleTable()
        self.check = check_invariants
        self.free_units: list[CapacityUnit] = []  # granted dedicated GPU sets, unbound
        self.training_state = TrainingState.IDLE
        self.trainers_down = False  # between TrainersLost and TrainersBack: nothing lent
        self.training_step: int | None = None
        self.training_wait_started_s: float | None = None
        self.unfinished_trajectories: int | None = None
        self.history: list[Reconfiguration] = []
        self._groups: dict[int, _AdmissionGroup] = {}
        self.released_sources: set[ElasticSource] = set()  # given back; never twice
        self._next_group = 0
        self._deferred: list[str] | None = None  # causes held for one decision (handle_all)

    # ----------------------------------------------------------------- set-up
    def register_training(
        self, gpu_ids: Sequence[str], *, overlap_gpu_sets: Sequence[Sequence[str]] = ()
    ) -> None:
        """Declare the training GPUs and the overlap workers that may borrow them."""
        now = self.clock()
        self.table.add_worker(
            gpu_ids, zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE, now_s=now
        )
        for gpus in overlap_gpu_sets:
            self.table.add_worker(
                gpus, zone=Zone.OVERLAP, role=Role.COLOCATED, status=Status.INACTIVE, now_s=now
            )

    def grant_reserved(self, gpu_sets: Sequence[Sequence[str]]) -> Reconfiguration | None:
        """The base job's reserved rollout GPUs (no elastic source) join as capacity."""
        self.free_units.extend(CapacityUnit(tuple(g)) for g in gpu_sets)
        return self._reconfigure("reserved capacity", gate_expansion=False)

    @property
    def profile(self) -> WorkloadProfile:
        return self.tracker.profile

    def expect_end(self, end_s: float) -> None:
        """The run's master predicts the run ends at ``end_s`` (its clock): new capacity
        is judged over the part of its window before then (``inf``: not known)."""
        self.run_end_s = end_s

    def elastic_demand(self, max_workers: int, *, starts_in_s: float = 0.0) -> Demand:
        """How many elastic workers are worth requesting now: the expansion gate at
        request time. Worker ``k+1`` is asked for only while its predicted saving over
        the expected window (estimated from this run's grants and reclaims, from when the
        scheduler expects to start it, ``starts_in_s``, to at most the run's predicted
        end) exceeds preparation + finalisation, on top of the reserved workers and
        ``k`` elastic ones; at most ``max_workers``.

        NOTE: the gate runs when capacity is *requested*, not only when it is granted.
        On Slurm a request waits in the queue for minutes; gated only at grant time, the
        run would hold requests it cannot use by the time they start (and an elastic job
        on a preemptible partition preempts other users' work to start). A grant that
        no longer passes when it arrives (the window shrank meanwhile) is still given
        straight back (``expansions_rejected``)."""
        reserved = sum(
            1
            for s in self.table.rollout_slots()
            if s.zone is Zone.DEDICATED and s.source is None and s.status in IN_SERVICE
        ) + sum(1 for u in self.free_units if u.source is None)
        now = self.clock()
        window_s = usable_window_s(self.window.estimate_s(now), now, self.run_end_s, starts_in_s)
        workers, gate = 0, None
        while workers < max_workers:
            gate = gate_expansion_of(
                self.policies,
                self.config,
                self.profile,
                num_current=reserved + workers,
                num_new=1,
                window_s=window_s,
            )
            if not gate.allow:
                break
            workers += 1
        reason = gate.reason if gate is not None else "no elastic workers"
        return Demand(workers, window_s, reason, starts_in_s)

    # ------------------------------------------------------------------ events
    def handle_all(self, events: Sequence[Event]) -> list[Reconfiguration]:
        """Process events that arrived together, in order. A plan an event forces
        (borrowed GPUs returned at Training Begin, reclaimed capacity, a failed worker) is
        made at once; the decision the others ask for (a grant, a finished training step,
        telemetry that refits the profile) is made once, after the last, on all they
        changed: a grant and the telemetry beside it do not switch the mode twice."""
        results: list[Reconfiguration] = []
        self._deferred = []
        try:
            for event in events:
                result = self.handle(event)
                if result is not None:
                    results.append(result)
        finally:
            causes, self._deferred = self._deferred, None
        if causes:
            result = self._reconfigure("; ".join(causes))
            if result is not None:
                results.append(result)
        return results

    def handle(self, event: Event) -> Reconfiguration | None:
        """Process one event; returns the reconfiguration it caused, if any."""
        result: Reconfiguration | None
        match event:
            case TrainingBegin(step):
                result = self._on_training_begin(step)
            case TrainingFinished(step, unfinished):
                result = self._on_training_finished(step, unfinished)
            case CapacityGranted(also=also):
                grants = (event, *also)
                for grant in grants:
                    self.window.granted(grant.source.tag, self.clock())
                    self.free_units.extend(
                        CapacityUnit(tuple(g), Zone.DEDICATED, grant.source, role=grant.role)
                        for g in grant.gpu_sets
                    )
                tags = ", ".join(g.source.tag for g in grants)
                result = self._reconfigure(f"capacity granted by {tags}")
            case CapacityReclaimed(source, deadline_s, gpu_ids):
                if self._reclaims_all(source, gpu_ids):  # the scheduler ends its stay
                    self.window.ended(source.tag, self.clock(), reclaimed=True)
                result = self._on_reclaim(source, deadline_s, gpu_ids)
            case WorkerReady(slot_id):
                result = self._on_ready(slot_id)
            case WorkerReleased(slot_id):
                result = self._on_released(slot_id)
            case WorkerFailed(slot_id, reason):
                result = self._on_failed(slot_id, reason)
            case EngineRankBack(gpu_ids, overlap):
                result = self._on_rank_back(gpu_ids, overlap)
            case TrainersLost():
                self.trainers_down = True
                result = self._return_borrowed("the trainer ranks are lost")
            case TrainersBack():
                self.trainers_down = False
                result = self._reconfigure("the trainer ranks are back")
            case StepTelemetry():
                result = self._on_telemetry(event)
            case _:
                raise TypeError(f"unknown event {event!r}")
        if self.check:
            self.table.check_invariants()
        return result

    def _on_training_begin(self, step: int) -> Reconfiguration | None:
        self.training_state = TrainingState.WAITING
        self.training_step = step
        self.training_wait_started_s = self.clock()
        result = self._return_borrowed(f"training step {step} begins")
        self._maybe_start_training()
        return result

    def _return_borrowed(self, why: str) -> Reconfiguration | None:
        """Every overlap worker in service (or starting) leaves its training GPUs."""
        borrowed = [s.slot_id for s in self.table.overlap_workers() if s.status in IN_SERVICE]
        if not borrowed:
            return None
        return self._reconfigure(f"{why}: return borrowed GPUs", must_remove=borrowed)

    def _on_training_finished(self, step: int, unfinished: int | None) -> Reconfiguration | None:
        now = self.clock()
        for slot in self.table.training_slots():
            if slot.status is Status.ACTIVE:
                self.table.transition(slot.slot_id, Status.INACTIVE, now_s=now)
        self.training_state = TrainingState.IDLE
        self.unfinished_trajectories = unfinished
        return self._reconfigure(f"training step {step} finished")

    def _on_reclaim(
        self, source: ElasticSource, deadline_s: float, gpu_ids: tuple[str, ...] | None
    ) -> Reconfiguration | None:
        def hit(gpus: tuple[str, ...]) -> bool:
            return gpu_ids is None or not set(gpus).isdisjoint(gpu_ids)

        self.free_units = [u for u in self.free_units if u.source != source or not hit(u.gpu_ids)]
        victims = [
            s.slot_id for s in self.table.rollout_slots() if s.source == source and hit(s.gpu_ids)
        ]
        leaving = [i for i in victims if self.table.get(i).status is Status.LEAVING]
        if leaving:  # already draining: tighten their deadline
            self.executor.stop_workers(leaving, deadline_s)
        in_service = [i for i in victims if self.table.get(i).status in IN_SERVICE]
        if not victims:
            self._release_if_empty(source)
            return None
        if not in_service:
            return None
        return self._reconfigure(
            f"capacity reclaimed by {source.tag}", must_remove=in_service, deadline_s=deadline_s
        )

    def _on_ready(self, slot_id: int) -> Reconfiguration | None:
        if slot_id not in self.table:
            return None  # a late report from a worker already cancelled
        slot = self.table.get(slot_id)
        now = self.clock()
        if slot.status is Status.REROLE:
            self.table.transition(slot_id, Status.ACTIVE, now_s=now)
        elif slot.status is Status.JOINING:
            group_id = self._group_of(slot_id)
            if group_id is None:  # joined before a restart that kept no group: alone
                group_id = self._next_group
                self._next_group += 1
                self._groups[group_id] = _AdmissionGroup({slot_id})
            group = self._groups[group_id]
            group.ready.add(slot_id)
            if group.ready >= group.members:
                members = sorted(group.members)
                for member in members:
                    self.table.transition(member, Status.ACTIVE, now_s=now)
                del self._groups[group_id]
                self.executor.admit(members)
        return None

    def _on_released(self, slot_id: int) -> Reconfiguration | None:
        if slot_id not in self.table:
            return None
        slot = self.table.get(slot_id)
        if slot.status is not Status.LEAVING:
            return None
        if slot.zone is Zone.OVERLAP:
            self.table.transition(slot_id, Status.INACTIVE, now_s=self.clock())
        else:
            self.table.remove(slot_id)
            if slot.source is not None:
                self._release_if_empty(slot.source)
            else:  # reserved GPUs stay with the base job: they can host a worker again
                self.free_units.append(CapacityUnit(slot.gpu_ids))
        self._maybe_start_training()
        return None

    def _on_failed(self, slot_id: int, reason: str) -> Reconfiguration | None:
        """A dead worker's slot goes; an elastic job left without workers is released
        (its backend may grant a replacement)."""
        if slot_id not in self.table:
            return None
        slot = self.table.get(slot_id)
        if slot.role is Role.TRAINING:
            raise RuntimeError(f"training slot {slot_id} failed: {reason}")  # the job must restart
        group_id = self._group_of(slot_id) if slot.status is Status.JOINING else None
        self.table.fail(slot_id)
        if slot.source is not None:
            self._release_if_empty(slot.source)
        must_remove: list[int] = []
        if group_id is not None:  # all-or-nothing expansion: cancel the rest of the group
            group = self._groups.pop(group_id)
            must_remove = sorted(group.members - {slot_id})
        result = self._reconfigure(
            f"worker {slot_id} failed: {reason}".rstrip(": "),
            must_remove=must_remove,
            gate_expansion=False,
            reuse_free=not must_remove,
        )
        self._maybe_start_training()
        return result

    def _on_rank_back(self, gpu_ids: tuple[str, ...], overlap: bool) -> Reconfiguration | None:
        """A base engine rank relaunched: its GPUs come back where its death took them
        away (a failed slot was removed; a GPU set still held -- its rank died idle, and
        nothing tried it since -- stays as it is)."""
        held = any(s.gpu_ids == gpu_ids for s in self.table.rollout_slots()) or any(
            u.gpu_ids == gpu_ids for u in self.free_units
        )
        if held:
            return None
        if overlap:
            now = self.clock()
            self.table.add_worker(
                gpu_ids, zone=Zone.OVERLAP, role=Role.COLOCATED, status=Status.INACTIVE, now_s=now
            )
        else:
            self.free_units.append(CapacityUnit(gpu_ids))
        return self._reconfigure(f"engine rank on {','.join(gpu_ids)} back", gate_expansion=False)

    def _on_telemetry(self, event: StepTelemetry) -> Reconfiguration | None:
        self.tracker.observe_step(event.turns, event.iterations, batch_size=event.batch_size)
        if event.toggle_sample:
            self.toggle.observe(
                borrowed=event.borrowed,
                training_wait_s=event.training_wait_s,
                activation_s=event.activation_s,
                deactivation_s=event.deactivation_s,
            )
        return self._reconfigure(f"telemetry of step {event.step}")

    # -------------------------------------------------------------- decisions
    def _reconfigure(
        self,
        cause: str,
        *,
        must_remove: Sequence[int] = (),
        deadline_s: float | None = None,
        gate_expansion: bool = True,
        reuse_free: bool = True,
    ) -> Reconfiguration | None:
        if self._deferred is not None and not must_remove and gate_expansion and reuse_free:
            self._deferred.append(cause)  # decided once the batch of events is in
            return None
        now = self.clock()
        profile = self.profile
        forced = set(must_remove)
        survivors = [
            s
            for s in self.table.rollout_slots()
            if s.status in IN_SERVICE and s.slot_id not in forced
        ]
        num_dedicated = sum(1 for s in survivors if s.zone is Zone.DEDICATED)

        # Expansion gate on granted but unused dedicated units, against the dedicated
        # pool they join (borrowed workers leave at every Training Begin).
        free = list(self.free_units) if reuse_free else []
        expansion_gate = None
        if free and gate_expansion:
            expansion_gate = gate_expansion_of(
                self.policies,
                self.config,
                profile,
                num_current=num_dedicated,
                num_new=len(free),
                window_s=usable_window_s(self.window.estimate_s(now), now, self.run_end_s),
            )
            if not expansion_gate.allow:
                self.expansions_rejected += 1
                for source in {u.source for u in free if u.source is not None}:
                    self.free_units = [u for u in self.free_units if u.source != source]
                    self._release_if_empty(source)
                free = []
        num_dedicated += len(free)

        # Borrowing gate: training GPUs are lendable only while training is idle (and its
        # ranks are up: ranks started again load onto them).
        borrow_gate = None
        overlap_units: list[CapacityUnit] = []
        lendable = [
            s
            for s in self.table.overlap_workers()
            if s.slot_id not in forced and (s.status in IN_SERVICE or s.status is Status.INACTIVE)
        ]
        if lendable and self.training_state is TrainingState.IDLE and not self.trainers_down:
            borrow_gate = gate_borrowing_of(
                self.policies,
                profile,
                num_dedicated=num_dedicated,
                num_lendable=len(lendable),
                unfinished=self.unfinished_trajectories,
                toggle_cost_s=self.toggle.estimate_s,
            )
            if borrow_gate.allow:
                overlap_units = [
                    CapacityUnit(s.gpu_ids, Zone.OVERLAP, None, s.slot_id)
                    for s in lendable
                    if s.status is Status.INACTIVE
                ]
            else:
                forced |= {s.slot_id for s in lendable if s.status in IN_SERVICE}
        borrowing = borrow_gate is not None and borrow_gate.allow
        num_workers = num_dedicated + (len(lendable) if borrowing else 0)

        decision = self._decide(num_workers, forced)
        plan = plan_transition(self.table, decision.target, free + overlap_units, forced)
        if plan.is_empty:
            return None
        self._apply(plan, deadline_s, now)
        record = Reconfiguration(
            now, cause, num_workers, borrowing, decision, plan, borrow_gate, expansion_gate
        )
        self.history.append(record)
        return record

    def _decide(self, num_workers: int, forced: set[int]) -> Decision:
        """Run the PD policy against the survivors' configuration. Survivors that form
        no valid configuration (e.g. prefill workers whose decode workers were all
        reclaimed) force a switch to the best configuration, bypassing hysteresis."""
        counts = dict.fromkeys(ROLLOUT_ROLES, 0)
        for s in self.table.rollout_slots():
            if s.status in IN_SERVICE and s.slot_id not in forced:
                counts[s.effective_role] += 1
        p, d, c = counts[Role.PREFILL], counts[Role.DECODE], counts[Role.COLOCATED]
        if p + d + c == 0:
            return self.policies.pd.decide(self.profile, num_workers, None)
        try:
            current = PDConfig(p, d, c)
        except SpecError as exc:
            decision = self.policies.pd.decide(self.profile, num_workers, None)
            reason = f"forced switch: surviving workers {p}P{d}D{c}C are impossible ({exc}); "
            return dataclasses.replace(
                decision, forced=True, switch=True, reason=reason + decision.reason
            )
        return self.policies.pd.decide(self.profile, num_workers, current)

    # ---------------------------------------------------------------- execute
    def _apply(self, plan: TransitionPlan, deadline_s: float | None, now: float) -> None:
        # 1. removals, borrowed workers first (plan order)
        joining = {i for i in plan.remove if self.table.get(i).status is Status.JOINING}
        if plan.remove:
            for slot_id in plan.remove:
                self.table.transition(slot_id, Status.LEAVING, now_s=now)
            self.executor.stop_workers(list(plan.remove), deadline_s)
        # 2. role changes of survivors
        if plan.role_changes:
            for slot_id, role in plan.role_changes:
                if self.table.get(slot_id).status is Status.ACTIVE:
                    self.table.transition(slot_id, Status.REROLE, role=role, now_s=now)
                else:  # still joining or changing role: aim it at the new role
                    self.table.retarget(slot_id, role)
            self.executor.change_roles(list(plan.role_changes))
        # Removed members leave their admission groups only now, all at once: a member
        # removed by this plan is never admitted on its way out, and the rest of a group
        # is admitted in its new role rather than admitted and then re-roled.
        self._leave_groups(joining)
        # 3. joins in the background, admitted together
        if plan.add:
            used = {a.gpu_ids for a in plan.add}
            self.free_units = [u for u in self.free_units if u.gpu_ids not in used]
            group = _AdmissionGroup({a.slot_id for a in plan.add})
            for add in plan.add:
                if add.reactivate:
                    self.table.transition(add.slot_id, Status.JOINING, role=add.role, now_s=now)
                else:
                    self.table.add_worker(
                        add.gpu_ids,
                        zone=add.zone,
                        role=add.role,
                        source=add.source,
                        now_s=now,
                        slot_id=add.slot_id,
                    )
            self._groups[self._next_group] = group
            self._next_group += 1
            self.executor.start_workers(list(plan.add))

    def _maybe_start_training(self) -> None:
        if self.training_state is not TrainingState.WAITING:
            return
        if any(s.status is not Status.INACTIVE for s in self.table.overlap_workers()):
            return
        now = self.clock()
        for slot in self.table.training_slots():
            self.table.transition(slot.slot_id, Status.ACTIVE, now_s=now)
        self.training_state = TrainingState.RUNNING
        assert self.training_step is not None
        self.executor.start_training(self.training_step)

    def _group_of(self, slot_id: int) -> int | None:
        for group_id, group in self._groups.items():
            if slot_id in group.members:
                return group_id
        return None

    def _leave_groups(self, slot_ids: set[int]) -> None:
        for group_id, group in list(self._groups.items()):
            if group.members & slot_ids:
                group.members -= slot_ids
                group.ready -= slot_ids
                if not group.members:
                    del self._groups[group_id]
                elif group.ready >= group.members:  # the rest was only waiting for it
                    members = sorted(group.members)
                    for member in members:
                        self.table.transition(member, Status.ACTIVE, now_s=self.clock())
                    del self._groups[group_id]
                    self.executor.admit(members)

    def _reclaims_all(self, source: ElasticSource, gpu_ids: tuple[str, ...] | None) -> bool:
        """A reclaim of every GPU ``source`` holds (not a partial shrink of it)."""
        if gpu_ids is None:
            return True
        held = [u.gpu_ids for u in self.free_units if u.source == source]
        held += [s.gpu_ids for s in self.table.rollout_slots() if s.source == source]
        return all(not set(gpus).isdisjoint(gpu_ids) for gpus in held)

    def _release_if_empty(self, source: ElasticSource) -> None:
        if any(s.source == source for s in self.table.rollout_slots()):
            return
        if any(u.source == source for u in self.free_units):
            return
        if source in self.released_sources:  # e.g. a reclaim of a job already given back
            return
        self.released_sources.add(source)
        self.window.ended(source.tag, self.clock(), reclaimed=False)  # (if not reclaimed)
        self.executor.release_capacity(source)

    # ---------------------------------------------------------------- journal
    def snapshot(self) -> dict[str, Any]:
        """Everything needed to restart the master (see :mod:`pearl_hpc.master.journal`)."""
        return {
            "table": self.table.to_dict(),
            "free_units": [
                {
                    "gpu_ids": list(u.gpu_ids),
                    "zone": u.zone.value,
                    "source": None
                    if u.source is None
                    else [u.source.job_id, u.source.het_component],
                    "role": None if u.role is None else u.role.value,
                }
                for u in self.free_units
            ],
            "tracker": self.tracker.to_dict(),
            "toggle": self.toggle.to_dict(),
            "window": self.window.to_dict(),
            "training_state": self.training_state,
            "training_step": self.training_step,
            "unfinished_trajectories": self.unfinished_trajectories,
            "groups": [sorted(g.members) for g in self._groups.values()],
            "groups_ready": [sorted(g.ready) for g in self._groups.values()],
            "released_sources": sorted([s.job_id, s.het_component] for s in self.released_sources),
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.table.load(RoleTable.from_dict(data["table"]))  # its holders keep it
        self.free_units = [
            CapacityUnit(
                tuple(u["gpu_ids"]),
                Zone(u["zone"]),
                None
                if u["source"] is None
                else ElasticSource(str(u["source"][0]), int(u["source"][1])),
                role=None if u.get("role") is None else Role(u["role"]),
            )
            for u in data["free_units"]
        ]
        self.tracker.restore(data["tracker"])
        self.toggle.restore(data["toggle"])
        if "window" in data:
            self.window.restore(data["window"])
        self.training_state = TrainingState(data["training_state"])
        self.training_step = data["training_step"]
        self.unfinished_trajectories = data["unfinished_trajectories"]
        self._groups = {
            i: _AdmissionGroup(set(m), set(r))
            for i, (m, r) in enumerate(zip(data["groups"], data["groups_ready"], strict=True))
        }
        self._next_group = len(self._groups)
        self.released_sources = {
            ElasticSource(str(job), int(comp)) for job, comp in data.get("released_sources", [])
        }
