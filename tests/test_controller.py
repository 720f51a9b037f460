"""The controller event loop (PEARL.md section 6) driven with hand-written fakes: a
recording executor and a manual clock. Hand examples first, then random event sequences
answered by a fake backend in random order."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearl_hpc.core.controller import (
    CapacityGranted,
    CapacityReclaimed,
    Controller,
    Event,
    Reconfiguration,
    StepTelemetry,
    TrainersBack,
    TrainersLost,
    TrainingBegin,
    TrainingFinished,
    WorkerFailed,
    WorkerReady,
    WorkerReleased,
)
from pearl_hpc.core.orchestrator import CapacityUnit
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.table import ElasticSource, RoleTable
from pearl_hpc.core.tracker import IterationRecord, TurnRecord
from pearl_hpc.core.types import PDConfig, Role, Status, Zone
from tests.factories import ManualClock, RecordingExecutor, gpus, make_profile

TRAINING_GPUS = [f"t:{i}" for i in range(4)]
OVERLAP_SETS = [("t:0", "t:1"), ("t:2", "t:3")]
JOB = ElasticSource("5001", 0)


@dataclass
class DeadlineExecutor(RecordingExecutor):
    """A recording executor that also keeps the deadline of each stop."""

    deadlines: list[tuple[list[int], float | None]] = field(default_factory=list)

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        super().stop_workers(slot_ids, deadline_s)
        self.deadlines.append((list(slot_ids), deadline_s))


def make_controller(
    *, table: RoleTable | None = None, training: bool = False, **policy: Any
) -> tuple[Controller, DeadlineExecutor, ManualClock]:
    executor = DeadlineExecutor()
    clock = ManualClock(100.0)
    controller = Controller(
        make_profile(),
        executor,
        policy=PolicyConfig.from_dict(policy),
        clock=clock,
        table=table,
        check_invariants=True,
    )
    if training:
        controller.register_training(TRAINING_GPUS, overlap_gpu_sets=OVERLAP_SETS)
    return controller, executor, clock


def ready_all(controller: Controller, slot_ids: Sequence[int]) -> None:
    for slot_id in slot_ids:
        controller.handle(WorkerReady(slot_id))


def release_all(controller: Controller, slot_ids: Sequence[int]) -> None:
    for slot_id in slot_ids:
        controller.handle(WorkerReleased(slot_id))


def statuses(controller: Controller, slot_ids: Sequence[int]) -> list[Status]:
    return [controller.table.get(i).status for i in slot_ids]


def calls_named(executor: RecordingExecutor, name: str) -> list[Any]:
    return [arg for n, arg in executor.calls if n == name]


def running_base(
    num_workers: int = 4, **policy: Any
) -> tuple[Controller, DeadlineExecutor, ManualClock]:
    """Reserved workers started and admitted, no training GPUs."""
    controller, executor, clock = make_controller(**policy)
    controller.grant_reserved([gpus(i) for i in range(num_workers)])
    ready_all(controller, range(num_workers))
    executor.take()
    return controller, executor, clock


def borrowing_base(**policy: Any) -> tuple[Controller, DeadlineExecutor, ManualClock]:
    """Training step 0 running, 2 reserved workers admitted (slots 3, 4), 2 inactive
    overlap workers (slots 1, 2) on the training slot 0."""
    controller, executor, clock = make_controller(training=True, **policy)
    controller.handle(TrainingBegin(0))
    assert executor.take() == [("start_training", 0)]
    controller.grant_reserved([gpus(0), gpus(1)])
    assert executor.take() == [("start_workers", [3, 4])]
    ready_all(controller, [3, 4])
    assert executor.take() == [("admit", [3, 4])]
    return controller, executor, clock


# ---------------------------------------------------------------- admission
def test_reserved_capacity_is_admitted_atomically_when_all_are_ready() -> None:
    controller, executor, _ = make_controller()
    record = controller.grant_reserved([gpus(i) for i in range(4)])
    assert record is not None and record.plan.target.total == 4
    assert executor.take() == [("start_workers", [0, 1, 2, 3])]
    assert controller.free_units == []
    for slot_id in (2, 0, 3):
        controller.handle(WorkerReady(slot_id))
        assert executor.calls == []  # nobody is admitted alone
        assert statuses(controller, range(4)) == [Status.JOINING] * 4
    controller.handle(WorkerReady(1))
    assert executor.take() == [("admit", [0, 1, 2, 3])]
    assert statuses(controller, range(4)) == [Status.ACTIVE] * 4
    assert controller.table.current_config() == record.decision.target
    controller.handle(WorkerReady(1))  # a duplicate report changes nothing
    controller.handle(WorkerReady(42))  # nor one from a slot that does not exist
    assert executor.calls == []


def test_capacity_granted_starts_workers_on_the_granted_gpus() -> None:
    controller, executor, clock = running_base(expansion="always")
    clock.advance(5)
    record = controller.handle(CapacityGranted(JOB, (gpus(10), gpus(11))))
    assert record is not None and record.num_workers == 6
    starts = calls_named(executor, "start_workers")
    assert len(starts) == 1 and sorted(starts[0]) == [4, 5]
    for slot_id in (4, 5):
        slot = controller.table.get(slot_id)
        assert slot.source == JOB and slot.status is Status.JOINING and slot.since_s == 105.0
    assert {controller.table.get(i).gpu_ids for i in (4, 5)} == {gpus(10), gpus(11)}
    executor.take()
    ready_all(controller, [5, 4])
    assert executor.take() == [("admit", [4, 5])]


def test_components_of_a_heterogeneous_job_are_decided_on_together() -> None:
    controller, executor, _ = running_base(expansion="always")
    second = ElasticSource(JOB.job_id, 1)
    record = controller.handle(
        CapacityGranted(JOB, (gpus(10),), also=(CapacityGranted(second, (gpus(11),)),))
    )
    assert record is not None and record.num_workers == 6
    assert len(controller.history) == 2  # the base decision and one for the whole job
    starts = calls_named(executor, "start_workers")
    assert len(starts) == 1 and len(starts[0]) == 2
    assert {controller.table.get(i).source for i in starts[0]} == {JOB, second}


def test_gated_expansion_gives_unprofitable_capacity_straight_back() -> None:
    controller, executor, _ = running_base(expansion="gated", expected_capacity_window_s=60.0)
    record = controller.handle(CapacityGranted(JOB, (gpus(10),)))
    assert record is None and controller.expansions_rejected == 1
    assert executor.take() == [("release_capacity", JOB.tag)]
    assert controller.free_units == []
    assert len(controller.table) == 4


# ------------------------------------------------- the expansion gate at request time
def test_no_request_is_kept_for_a_worker_not_worth_its_preparation() -> None:
    """4 reserved workers: over a 60 s window worker 5 saves less than its preparation
    + finalisation, so none is requested; the grant-time gate agrees."""
    controller, executor, _ = running_base(
        expansion="gated", expected_capacity_window_s=60.0, preparation_s=30.0
    )
    demand = controller.elastic_demand(4)
    assert demand.workers == 0 and demand.window_s == 60.0
    assert demand.reason.startswith("reject expansion")
    assert controller.handle(CapacityGranted(JOB, (gpus(10),))) is None  # given back
    assert executor.take() == [("release_capacity", JOB.tag)]


def test_requests_are_kept_while_each_next_worker_is_worth_it() -> None:
    """Over a long window, workers are requested one by one while the next still saves
    more than it costs, up to the cap; with the ungated policy the cap."""
    controller, _, _ = running_base(1, expansion="gated", expected_capacity_window_s=3600.0)
    demand = controller.elastic_demand(16)
    assert 0 < demand.workers < 16  # the predictor's saving shrinks with every worker
    assert controller.elastic_demand(demand.workers - 1).workers == demand.workers - 1
    profile, config = controller.profile, controller.config
    from pearl_hpc.core.policies import gate_expansion_of

    def worth(k: int) -> bool:  # the (k+1)-th elastic worker, on top of 1 reserved
        gate = gate_expansion_of(
            controller.policies, config, profile, num_current=1 + k, num_new=1, window_s=3600.0
        )
        return gate.allow

    assert all(worth(k) for k in range(demand.workers)) and not worth(demand.workers)
    always, _, _ = running_base(1, expansion="always")
    assert always.elastic_demand(16).workers == 16


def test_the_window_is_learnt_from_grants_and_reclaims() -> None:
    """Capacity that Slurm takes back after 20 s, twice: the window falls from the
    configured 1800 s towards 20 s, and fewer workers are worth requesting."""
    controller, _, clock = running_base(1, expansion="gated", expected_capacity_window_s=1800.0)
    before = controller.elastic_demand(16)
    for job in ("7001", "7002"):
        source = ElasticSource(job, 0)
        controller.handle(CapacityGranted(source, (gpus(20 + int(job[-1])),)))
        clock.advance(20)
        controller.handle(CapacityReclaimed(source, clock() + 15))
    after = controller.elastic_demand(16)
    assert after.window_s == pytest.approx((1800 + 40) / 3)
    assert after.workers < before.workers
    # a reclaim naming every GPU of its component ends the stay too (the local
    # backend's); one naming some of them is a partial shrink and does not
    source = ElasticSource("7003", 0)
    controller.handle(CapacityGranted(source, (gpus(30), gpus(31))))
    clock.advance(10)
    controller.handle(CapacityReclaimed(source, clock() + 15, gpus(30)))
    assert controller.window.reclaims == 2
    controller.handle(CapacityReclaimed(source, clock() + 15, gpus(30) + gpus(31)))
    assert controller.window.reclaims == 3
    data = json.loads(json.dumps(controller.snapshot()))
    fresh, _, _ = make_controller()
    fresh.restore(data)  # a resumed master continues the estimate
    assert fresh.window.estimate_s(clock()) == pytest.approx(controller.window.estimate_s(clock()))
    assert fresh.window.reclaims == 3


def test_capacity_is_judged_up_to_the_runs_end_and_from_its_expected_start() -> None:
    """Over a long window a worker is worth requesting; when the run's master predicts
    its end within the worker's preparation, or Slurm expects to start the request after
    that end, none is; a grant then is given straight back."""
    controller, executor, clock = running_base(
        1, expansion="gated", expected_capacity_window_s=3600.0, preparation_s=30.0
    )
    open_ended = controller.elastic_demand(4)
    assert open_ended.workers > 0 and open_ended.window_s == 3600.0
    controller.expect_end(clock() + 600.0)  # ten minutes left: still worth it
    soon = controller.elastic_demand(4)
    assert 0 < soon.workers <= open_ended.workers and soon.window_s == 600.0
    late = controller.elastic_demand(4, starts_in_s=590.0)  # starts with 10 s left
    assert late.workers == 0 and late.window_s == 10.0 and late.starts_in_s == 590.0
    assert late.reason.startswith("reject expansion")
    controller.expect_end(clock() + 20.0)  # ends before a new worker is prepared
    assert controller.elastic_demand(4).workers == 0
    assert controller.handle(CapacityGranted(JOB, (gpus(10),))) is None
    assert executor.take() == [("release_capacity", JOB.tag)]
    always, _, clock = running_base(1, expansion="always")  # ungated: the cap, as before
    always.expect_end(clock() + 1.0)
    assert always.elastic_demand(4, starts_in_s=100.0).workers == 4


def test_the_runs_end_is_predicted_from_the_pace_of_its_last_steps() -> None:
    from pearl_hpc.core.window import run_end_s, usable_window_s

    assert run_end_s([], 5) == math.inf and run_end_s([40.0], 5) == math.inf
    assert run_end_s([40.0, 50.0], 3) == 80.0
    # the last PACE_STEPS periods: a slow start (the first step's 40 s) is forgotten
    assert run_end_s([40.0, 100.0, 110.0, 120.0, 130.0, 140.0], 2) == 160.0
    assert run_end_s([40.0, 50.0], 0) == 50.0
    assert usable_window_s(600.0, 100.0) == 600.0
    assert usable_window_s(600.0, 100.0, end_s=400.0) == 300.0
    assert usable_window_s(600.0, 100.0, end_s=400.0, starts_in_s=350.0) == 0.0


def test_capacity_reclaimed_stops_exactly_that_source_then_releases_it() -> None:
    controller, executor, clock = running_base(expansion="always")
    other = ElasticSource("6001", 1)
    controller.handle(CapacityGranted(JOB, (gpus(10), gpus(11))))
    controller.handle(CapacityGranted(other, (gpus(12),)))
    ready_all(controller, [4, 5, 6])
    executor.take()
    victims = sorted(s.slot_id for s in controller.table if s.source == JOB)
    assert len(victims) == 2
    clock.advance(1)
    record = controller.handle(CapacityReclaimed(JOB, deadline_s=130.0))
    assert record is not None and set(record.plan.remove) == set(victims)
    stops = calls_named(executor, "stop_workers")
    assert stops == [victims]
    assert executor.deadlines[-1] == (victims, 130.0)
    assert statuses(controller, victims) == [Status.LEAVING] * 2
    executor.take()
    controller.handle(WorkerReleased(victims[0]))
    assert executor.take() == []  # one worker still holds the job's GPUs
    controller.handle(WorkerReleased(victims[1]))
    assert executor.take() == [("release_capacity", JOB.tag)]
    assert all(s.source != JOB for s in controller.table)
    assert any(s.source == other for s in controller.table)
    controller.handle(WorkerReleased(victims[1]))  # late duplicate
    assert executor.take() == []


def _unit(gpu_ids: tuple[str, ...], source: ElasticSource | None) -> CapacityUnit:
    return CapacityUnit(gpu_ids, Zone.DEDICATED, source)


def test_reclaim_of_unused_capacity_releases_at_once() -> None:
    controller, executor, _ = running_base()
    controller.free_units.append(_unit(gpus(20), JOB))  # granted, never used
    assert controller.handle(CapacityReclaimed(JOB, deadline_s=1.0)) is None
    assert executor.take() == [("release_capacity", JOB.tag)]
    assert controller.free_units == []


def test_source_is_kept_while_any_of_its_gpus_are_still_free() -> None:
    controller, executor, _ = running_base(2, expansion="always")
    controller.handle(CapacityGranted(JOB, (gpus(10),)))
    ready_all(controller, [2])
    controller.free_units.append(_unit(gpus(11), JOB))  # granted, not used yet
    executor.take()
    controller.handle(WorkerFailed(2, "oom"))
    # the job still has a free GPU set: it is not given back, the set replaces the worker
    assert calls_named(executor, "release_capacity") == []
    assert calls_named(executor, "start_workers") == [[2]]
    assert controller.table.get(2).gpu_ids == gpus(11)


def test_reclaim_during_expansion_admits_the_rest_of_the_group() -> None:
    controller, executor, _ = running_base(2, expansion="always")
    other = ElasticSource("6001")
    controller.free_units.append(_unit(gpus(11), other))
    controller.handle(CapacityGranted(JOB, (gpus(10),)))
    (group,) = calls_named(executor, "start_workers")
    assert sorted(group) == [2, 3]  # both sources join as one group
    executor.take()
    from_job = next(i for i in group if controller.table.get(i).source == JOB)
    from_other = next(i for i in group if controller.table.get(i).source == other)
    controller.handle(WorkerReady(from_job))
    assert executor.take() == []
    controller.handle(CapacityReclaimed(other, deadline_s=50.0))
    # the stop goes out first, then the rest of the group is admitted
    assert executor.take() == [("stop_workers", [from_other]), ("admit", [from_job])]
    controller.handle(WorkerReleased(from_other))
    assert executor.take() == [("release_capacity", other.tag)]
    assert controller.table.current_config() == PDConfig.colocated(3)


def test_reclaim_of_a_joining_group_admits_none_of_it() -> None:
    """Regression: removing a whole joining group member by member used to admit the
    last ready member just before stopping it."""
    controller, executor, _ = running_base(2, expansion="always")
    controller.handle(CapacityGranted(JOB, (gpus(10), gpus(11))))
    executor.take()
    controller.handle(WorkerReady(3))
    controller.handle(CapacityReclaimed(JOB, deadline_s=50.0))
    assert executor.take() == [("stop_workers", [2, 3])]
    assert statuses(controller, [2, 3]) == [Status.LEAVING] * 2
    assert controller._groups == {}


# ------------------------------------------------------------------ failures
def test_failed_joining_worker_cancels_its_whole_admission_group() -> None:
    controller, executor, _ = running_base(2, expansion="always")
    controller.handle(CapacityGranted(JOB, (gpus(10), gpus(11), gpus(12))))
    group = calls_named(executor, "start_workers")[0]
    assert sorted(group) == [2, 3, 4]
    executor.take()
    controller.handle(WorkerReady(2))
    record = controller.handle(WorkerFailed(3, "CUDA error"))
    assert record is not None and "worker 3 failed: CUDA error" in record.cause
    assert 3 not in controller.table
    assert calls_named(executor, "stop_workers") == [[2, 4]]
    assert calls_named(executor, "admit") == []
    assert statuses(controller, [2, 4]) == [Status.LEAVING] * 2
    executor.take()
    controller.handle(WorkerReady(4))  # a late ready of a cancelled member
    assert executor.take() == []
    release_all(controller, [2, 4])
    assert executor.take() == [("release_capacity", JOB.tag)]
    assert controller.table.current_config() == PDConfig.colocated(2)
    assert statuses(controller, [0, 1]) == [Status.ACTIVE] * 2


def test_failed_active_worker_is_replaced_from_free_capacity() -> None:
    controller, executor, _ = running_base(3)
    controller.free_units.append(_unit(gpus(30), None))
    record = controller.handle(WorkerFailed(1))
    assert record is not None and record.num_workers == 3
    starts = calls_named(executor, "start_workers")
    assert starts == [[1]]  # the dead worker's slot id, reused by its replacement
    assert controller.table.get(1).gpu_ids == gpus(30)
    assert controller.table.get(1).status is Status.JOINING


def test_dead_elastic_worker_whose_capacity_went_too_releases_its_job() -> None:
    controller, executor, _ = running_base(2, expansion="always")
    controller.handle(CapacityGranted(JOB, (gpus(10),)))
    ready_all(controller, [2])
    executor.take()
    controller.handle(WorkerFailed(2, "job step ended"))
    assert executor.take()[0] == ("release_capacity", JOB.tag)
    assert controller.free_units == [] and 2 not in controller.table


def test_dead_worker_leaving_on_a_reclaim_is_not_replaced() -> None:
    controller, executor, _ = running_base(2, expansion="always")
    controller.handle(CapacityGranted(JOB, (gpus(10),)))
    ready_all(controller, [2])
    controller.handle(CapacityReclaimed(JOB, deadline_s=50.0))
    executor.take()
    controller.handle(WorkerFailed(2, "engine died"))
    assert executor.take()[0] == ("release_capacity", JOB.tag)
    assert controller.free_units == []


def test_reclaim_that_removes_every_decode_worker_forces_a_switch() -> None:
    table = RoleTable()
    for i in range(2):
        table.add_worker(gpus(i), zone=Zone.DEDICATED, role=Role.PREFILL, status=Status.ACTIVE)
    for i in range(2, 4):
        table.add_worker(
            gpus(i), zone=Zone.DEDICATED, role=Role.DECODE, status=Status.ACTIVE, source=JOB
        )
    controller, executor, _ = make_controller(table=table)
    record = controller.handle(CapacityReclaimed(JOB, deadline_s=10.0))
    assert record is not None
    assert record.decision.forced and record.decision.switch
    assert "forced switch" in record.decision.reason
    # two workers: 1P1D cannot hold the batch's KV (64 x 1.6 GB > 85 GB), so colocate
    assert record.decision.target == PDConfig.colocated(2)
    assert record.plan.remove == (2, 3)
    assert record.plan.role_changes == ((0, Role.COLOCATED), (1, Role.COLOCATED))
    assert executor.take() == [
        ("stop_workers", [2, 3]),  # removals before role changes
        ("change_roles", [(0, "colocated"), (1, "colocated")]),
    ]
    ready_all(controller, [0, 1])
    release_all(controller, [2, 3])
    assert executor.take() == [("release_capacity", JOB.tag)]
    assert controller.table.current_config() == PDConfig.colocated(2)  # valid again


def test_failed_training_slot_is_fatal() -> None:
    controller, _, _ = make_controller(training=True)
    with pytest.raises(RuntimeError, match="training slot 0 failed"):
        controller.handle(WorkerFailed(0, "node down"))


# ------------------------------------------------------------ intra-scale toggle
def test_training_begin_returns_borrowed_gpus_before_training_starts() -> None:
    controller, executor, _ = borrowing_base(toggle_cost_s=0.0)
    record = controller.handle(TrainingFinished(0))
    assert record is not None and record.borrowed and record.borrow_gate is not None
    assert executor.take() == [("start_workers", [1, 2])]
    ready_all(controller, [1, 2])
    assert executor.take() == [("admit", [1, 2])]

    record = controller.handle(TrainingBegin(1))
    assert record is not None and record.plan.remove[:2] == (1, 2)
    calls = executor.take()
    assert calls[0] == ("stop_workers", [1, 2])  # the very first thing done
    assert "start_training" not in [name for name, _ in calls]
    assert controller.training_state == "waiting"
    controller.handle(WorkerReleased(2))
    assert executor.take() == []
    assert controller.table.get(0).status is Status.INACTIVE
    controller.handle(WorkerReleased(1))
    assert executor.take() == [("start_training", 1)]
    assert controller.table.get(0).status is Status.ACTIVE
    assert statuses(controller, [1, 2]) == [Status.INACTIVE] * 2
    assert statuses(controller, [3, 4]) == [Status.ACTIVE] * 2


def test_lost_trainer_ranks_take_their_gpus_back_and_lend_none_until_back() -> None:
    """Trainer ranks started again after a loss load onto the GPUs an overlap engine may
    hold: the borrowed workers leave at the loss, whatever the training state, and no
    GPU is lent (a finished step, a grant) until the ranks are back."""
    controller, executor, _ = borrowing_base(toggle_cost_s=0.0)
    controller.handle(TrainingFinished(0))
    ready_all(controller, [1, 2])
    executor.take()
    record = controller.handle(TrainersLost())
    assert record is not None and record.cause == "the trainer ranks are lost: return borrowed GPUs"
    assert executor.take()[0] == ("stop_workers", [1, 2])
    release_all(controller, [1, 2])
    assert statuses(controller, [1, 2]) == [Status.INACTIVE] * 2
    controller.handle(TrainingFinished(1))  # (the step the loss interrupted)
    controller.handle(CapacityGranted(JOB, (gpus(5),)))
    ready_all(controller, [s.slot_id for s in controller.table if s.slot_id > 4])
    calls = executor.take()
    assert ("admit", [5]) in calls
    assert not [a for n, a in calls if n == "start_workers" and {1, 2} & set(a)]
    assert statuses(controller, [1, 2]) == [Status.INACTIVE] * 2
    record = controller.handle(TrainersBack())
    assert record is not None and record.borrowed
    assert ("start_workers", [1, 2]) in executor.take()


def test_lost_trainer_ranks_with_nothing_lent_change_nothing() -> None:
    controller, executor, _ = borrowing_base(toggle_cost_s=0.0)
    assert controller.handle(TrainersLost()) is None
    assert executor.take() == []


def test_training_begin_while_borrowed_workers_are_still_joining() -> None:
    controller, executor, _ = borrowing_base(toggle_cost_s=0.0)
    controller.handle(TrainingFinished(0))
    executor.take()
    controller.handle(WorkerReady(1))
    controller.handle(TrainingBegin(1))
    assert executor.take()[0] == ("stop_workers", [1, 2])
    controller.handle(WorkerReady(2))  # too late: it is leaving
    assert executor.take() == []
    release_all(controller, [1, 2])
    assert executor.take() == [("start_training", 1)]


def test_joining_survivor_of_a_cut_group_is_admitted_in_its_new_role() -> None:
    """Regression: when training took back the borrowed members of a joining group, the
    ready survivor was admitted in its old role and at once sent to change role."""
    controller, executor, _ = make_controller(
        training=True, borrowing="ungated", pd_policy="fixed-ratio"
    )
    record = controller.grant_reserved([gpus(0)])
    assert record is not None and record.decision.target == PDConfig(2, 1)
    assert executor.take() == [("start_workers", [3, 1, 2])]
    controller.handle(WorkerReady(3))
    record = controller.handle(TrainingBegin(1))
    assert record is not None and record.decision.target == PDConfig.colocated(1)
    assert executor.take() == [
        ("stop_workers", [1, 2]),
        ("change_roles", [(3, "colocated")]),
        ("admit", [3]),
    ]
    slot = controller.table.get(3)
    assert (slot.status, slot.role) == (Status.ACTIVE, Role.COLOCATED)


def test_training_starts_at_once_when_nothing_is_borrowed() -> None:
    controller, executor, _ = borrowing_base(borrowing="none")
    controller.handle(TrainingFinished(0))
    assert executor.take() == []
    assert controller.handle(TrainingBegin(1)) is None
    assert executor.take() == [("start_training", 1)]


def test_training_finished_reactivates_overlap_workers_when_it_pays() -> None:
    controller, executor, clock = borrowing_base(toggle_cost_s=0.0)
    clock.advance(3)
    assert controller.table.get(0).status is Status.ACTIVE
    record = controller.handle(TrainingFinished(0, unfinished_trajectories=64))
    assert controller.table.get(0).status is Status.INACTIVE
    assert record is not None and record.borrowed
    assert record.borrow_gate is not None and record.borrow_gate.allow
    assert record.borrow_gate.benefit_s > record.borrow_gate.cost_s
    adds = {a.slot_id: a for a in record.plan.add}
    assert set(adds) == {1, 2} and all(a.reactivate for a in adds.values())
    assert all(a.zone is Zone.OVERLAP for a in adds.values())
    assert executor.take() == [("start_workers", [1, 2])]
    assert statuses(controller, [1, 2]) == [Status.JOINING] * 2
    assert controller.table.get(1).since_s == 103.0


def test_gate_refuses_to_borrow_when_toggling_costs_more() -> None:
    controller, executor, _ = borrowing_base(toggle_cost_s=1e6)
    record = controller.handle(TrainingFinished(0))
    assert record is None and executor.take() == []
    assert statuses(controller, [1, 2]) == [Status.INACTIVE] * 2
    # nothing left to finish: only a few trajectories make borrowing even less useful
    controller2, executor2, _ = borrowing_base(toggle_cost_s=0.0)
    assert controller2.handle(TrainingFinished(0, unfinished_trajectories=0)) is None
    assert executor2.take() == []


def test_borrowing_none_never_touches_overlap_workers() -> None:
    controller, executor, _ = make_controller(training=True, borrowing="none", toggle_cost_s=0.0)
    controller.grant_reserved([gpus(0), gpus(1)])
    ready_all(controller, [3, 4])
    for step in range(3):
        controller.handle(TrainingBegin(step))
        controller.handle(TrainingFinished(step))
    assert statuses(controller, [1, 2]) == [Status.INACTIVE] * 2
    touched = [
        i
        for name, arg in executor.calls
        if name in ("start_workers", "stop_workers", "admit")
        for i in arg
    ]
    assert {1, 2}.isdisjoint(touched)
    assert calls_named(executor, "start_training") == [0, 1, 2]
    assert all(r.borrow_gate is None or not r.borrow_gate.allow for r in controller.history)


def test_gate_rejection_returns_borrowed_workers_it_no_longer_wants() -> None:
    controller, executor, _ = borrowing_base(toggle_cost_s=0.0)
    controller.handle(TrainingFinished(0))
    ready_all(controller, [1, 2])
    executor.take()
    # telemetry says toggling got very expensive: borrowed workers go back
    record = controller.handle(
        StepTelemetry(1, borrowed=True, activation_s=1e5, deactivation_s=1e5, training_wait_s=0.0)
    )
    assert record is not None and record.borrow_gate is not None
    assert not record.borrow_gate.allow
    assert record.plan.remove == (1, 2)
    assert executor.take()[0] == ("stop_workers", [1, 2])


# ------------------------------------------------------------------ telemetry
def test_step_telemetry_refits_the_profile() -> None:
    controller, _, _ = running_base(2)
    base = controller.profile
    turns = tuple(
        TurnRecord(traj, t, 300, 100, 1000 * (t + 1), 2.0, 0, Role.COLOCATED)
        for traj, num_turns in (("a", 10), ("b", 6))
        for t in range(num_turns)
    )
    iterations = (
        IterationRecord(0, Role.COLOCATED, 8, 8000, 0, 0.010),
        IterationRecord(0, Role.COLOCATED, 16, 16000, 0, 0.012),
        IterationRecord(0, Role.COLOCATED, 32, 32000, 0, 0.016),
    )
    controller.handle(StepTelemetry(3, turns=turns, iterations=iterations))
    profile = controller.profile
    assert profile.turns == pytest.approx(0.5 * 10 + 0.5 * base.turns)
    assert profile.env_s == pytest.approx(0.5 * 20.0 + 0.5 * base.env_s)
    assert profile.gen_tokens_per_turn == pytest.approx(0.5 * 100 + 0.5 * base.gen_tokens_per_turn)
    assert profile.new_tokens_per_turn == pytest.approx(0.5 * 300 + 0.5 * base.new_tokens_per_turn)
    assert profile.decode_fixed_s == pytest.approx(0.5 * 0.008 + 0.5 * base.decode_fixed_s)
    assert profile.decode_per_seq_s == pytest.approx(0.5 * 0.00025 + 0.5 * base.decode_per_seq_s)
    assert controller.tracker.steps_observed == 1


def test_events_that_arrive_together_are_decided_on_once() -> None:
    """The main job's flip: a grant and step 0's telemetry arrive together. One by one,
    the grant is decided on the prior (prefill-heavy: 1P1D) and the telemetry undoes it
    at once (2C); together, one decision on both. A reclaim among them is carried out
    at once (it must remove its workers), on everything the batch brought before it."""
    from pearl_hpc.config import REPO_CONFIGS, load_profile

    prior = load_profile(REPO_CONFIGS / "profiles" / "tiny-cpu-pd-prior.yaml")
    turns = tuple(TurnRecord(f"t{k}", t, 30, 62, 100 * (t + 1), 0.2, 0, Role.COLOCATED)
                  for k in range(64) for t in range(3))  # fmt: skip
    iterations = tuple(
        IterationRecord(0, Role.COLOCATED, n, 100 * n, chunk, 0.0054 + 2.8e-4 * n + 5.9e-5 * chunk)
        for n in (4, 8, 16, 32)
        for chunk in (0, 200)
    )
    telemetry = StepTelemetry(0, turns=turns, iterations=iterations)

    def one_worker() -> Controller:
        controller = Controller(prior, RecordingExecutor(), policy=PolicyConfig(
            expansion="always"), clock=ManualClock(100.0), check_invariants=True)  # fmt: skip
        controller.grant_reserved([gpus(0)])
        ready_all(controller, [0])
        return controller

    events = [CapacityGranted(JOB, (gpus(10),)), telemetry]
    apart = one_worker()
    assert [str(r.plan.target) for e in events if (r := apart.handle(e))] == ["1P1D", "2C"]
    together = one_worker()
    (result,) = together.handle_all(events)
    assert result.cause == "capacity granted by 5001+0; telemetry of step 0"
    assert str(result.plan.target) == "2C"
    assert together.table.role_counts() == apart.table.role_counts()
    assert together._deferred is None  # the next single event is decided at once

    other = ElasticSource("5002", 0)
    apart, together = one_worker(), one_worker()
    for controller in (apart, together):
        controller.handle(CapacityGranted(other, (gpus(20),)))  # 1P1D
    events = [CapacityGranted(JOB, (gpus(10),)), telemetry, CapacityReclaimed(other, 130.0)]
    for event in events:
        apart.handle(event)
    results = together.handle_all(events)
    assert results[0].cause == "capacity reclaimed by 5002+0"
    assert together.table.role_counts() == apart.table.role_counts()


def test_telemetry_feeds_the_toggle_cost_estimate() -> None:
    controller, _, _ = running_base(2, toggle_cost_s=10.0, toggle_ema_alpha=0.5)
    controller.handle(StepTelemetry(1, borrowed=True, activation_s=4.0, deactivation_s=2.0))
    assert controller.toggle.estimate_s == pytest.approx(8.0)
    controller.handle(StepTelemetry(2, borrowed=False, training_wait_s=4.0))
    assert controller.toggle.estimate_s == pytest.approx(6.0)
    # a borrow whose activation was its engine's first start (vLLM compiled): no sample
    controller.handle(StepTelemetry(3, borrowed=True, activation_s=30.0, toggle_sample=False))
    assert controller.toggle.estimate_s == pytest.approx(6.0)


# ------------------------------------------------------------------- journal
def _round_trip(controller: Controller, **policy: Any) -> Controller:
    fresh, _, _ = make_controller(**policy)
    fresh.restore(json.loads(json.dumps(controller.snapshot())))
    return fresh


def test_snapshot_restore_round_trip() -> None:
    policy: dict[str, Any] = {"toggle_cost_s": 0.0, "expansion": "always"}
    controller, executor, _ = borrowing_base(**policy)
    controller.handle(TrainingFinished(0, unfinished_trajectories=40))
    controller.handle(WorkerReady(1))  # a group half ready
    controller.handle(CapacityGranted(JOB, (gpus(10),)))
    controller.handle(StepTelemetry(1, borrowed=True, activation_s=3.0, deactivation_s=1.0))
    controller.free_units.append(_unit(gpus(40), ElasticSource("7", 2)))
    snapshot = controller.snapshot()
    assert snapshot["groups"] and snapshot["groups_ready"][0] == [1]

    fresh = _round_trip(controller, **policy)
    assert fresh.snapshot() == snapshot
    assert fresh.free_units == controller.free_units
    assert fresh.table.to_dict() == controller.table.to_dict()
    assert fresh.unfinished_trajectories == 40
    assert fresh.profile == controller.profile
    assert fresh.toggle.estimate_s == controller.toggle.estimate_s
    # and it behaves the same from there on
    executor.take()
    fresh_executor = fresh.executor
    assert isinstance(fresh_executor, RecordingExecutor)
    for c in (controller, fresh):
        c.handle(WorkerReady(2))
        c.handle(TrainingBegin(1))
    assert fresh_executor.take() == executor.take()
    assert fresh.snapshot() == controller.snapshot()


def test_restore_while_training_waits_for_returned_gpus() -> None:
    controller, executor, _ = borrowing_base(toggle_cost_s=0.0)
    controller.handle(TrainingFinished(0))
    ready_all(controller, [1, 2])
    controller.handle(TrainingBegin(1))
    executor.take()
    fresh = _round_trip(controller, toggle_cost_s=0.0)
    assert (fresh.training_state, fresh.training_step) == ("waiting", 1)
    fresh_executor = fresh.executor
    assert isinstance(fresh_executor, RecordingExecutor)
    release_all(fresh, [1, 2])
    assert fresh_executor.take() == [("start_training", 1)]


# ------------------------------------------------------------ random sequences
POLICIES = st.fixed_dictionaries(
    {
        "pd_policy": st.sampled_from(["adaptive", "colocated", "fixed-ratio"]),
        "borrowing": st.sampled_from(["none", "ungated", "gated"]),
        "expansion": st.sampled_from(["always", "gated"]),
        "toggle_cost_s": st.sampled_from([0.0, 9.44, 1e6]),
        "expected_capacity_window_s": st.sampled_from([60.0, 1800.0]),
    }
)
ACTIONS = [
    "respond",
    "respond",
    "respond",
    "grant",
    "reclaim",
    "fail",
    "begin",
    "finish",
    "telemetry",
]


class FakeBackend:
    """Answers executor calls the way a sane backend would, in an order chosen by the
    test: starts and re-roles end in WorkerReady, stops in WorkerReleased; a stopped or
    dead worker sends nothing more."""

    def __init__(self, policy: dict[str, Any], num_reserved: int) -> None:
        self.policy = policy
        self.controller, self.executor, self.clock = make_controller(training=True, **policy)
        self.pending: list[tuple[str, int]] = []  # ("ready" | "released", slot id)
        self.trainer = "idle"  # idle | waiting | running (the trainer's view)
        self.step = 0
        self.sources: dict[ElasticSource, str] = {}  # granted | reclaimed | released
        self.next_gpu = 100
        self.controller.grant_reserved([gpus(i) for i in range(num_reserved)])
        self.absorb(None)

    # -- events
    def send(self, event: Event) -> None:
        if isinstance(event, WorkerFailed):  # a dead worker reports nothing more
            self.pending = [p for p in self.pending if p[1] != event.slot_id]
        record = self.controller.handle(event)
        self.absorb(record)

    def absorb(self, record: Reconfiguration | None) -> None:
        table = self.controller.table
        calls = self.executor.take()
        admitted = {i for name, arg in calls if name == "admit" for i in arg}
        for name, arg in calls:
            if name == "start_workers":
                for slot_id in arg:
                    assert table.get(slot_id).status is Status.JOINING
                    self._expect(("ready", slot_id))
            elif name == "change_roles":
                for slot_id, role in arg:
                    slot = table.get(slot_id)
                    assert slot.effective_role.value == role
                    # a joining worker is retargeted (and may be admitted right after)
                    ok = (Status.JOINING, Status.REROLE) + (
                        (Status.ACTIVE,) * (slot_id in admitted)
                    )
                    assert slot.status in ok
                    if slot.status is Status.REROLE:  # a joining worker reports once
                        self._expect(("ready", slot_id))
            elif name == "stop_workers":
                for slot_id in arg:
                    assert table.get(slot_id).status is Status.LEAVING
                    self.pending = [p for p in self.pending if p != ("ready", slot_id)]
                    self._expect(("released", slot_id))
            elif name == "admit":
                assert arg == sorted(arg) and arg
                assert all(table.get(i).status is Status.ACTIVE for i in arg)
            elif name == "start_training":
                assert self.trainer == "waiting" and arg == self.step
                assert all(s.status is Status.INACTIVE for s in table.overlap_workers())
                self.trainer = "running"
            elif name == "release_capacity":
                source = next(s for s in self.sources if s.tag == arg)
                assert self.sources[source] != "released", f"{arg} released twice"
                assert all(s.source != source for s in table)
                assert all(u.source != source for u in self.controller.free_units)
                self.sources[source] = "released"
            else:  # pragma: no cover - the executor protocol has no other call
                raise AssertionError(name)
        if record is not None:
            plan = record.plan
            ids = [a.slot_id for a in plan.add] + list(plan.remove)
            ids += [s for s, _ in plan.role_changes]
            assert len(ids) == len(set(ids)), f"a slot twice in one plan: {plan}"

    def _expect(self, response: tuple[str, int]) -> None:
        if response not in self.pending:
            self.pending.append(response)

    # -- checks after every event
    def check(self) -> None:
        controller, table = self.controller, self.controller.table
        table.check_invariants()
        rollout_gpus = [g for s in table.rollout_slots() for g in s.gpu_ids]
        assert len(rollout_gpus) == len(set(rollout_gpus))
        free_gpus = [g for u in controller.free_units for g in u.gpu_ids]
        assert len(free_gpus) == len(set(free_gpus))
        assert not set(free_gpus) & set(rollout_gpus)
        # the in-service workers always form a valid configuration (or none at all)
        assert table.current_config() is not None or not table.in_service()
        training = table.training_slots()
        assert controller.training_state == self.trainer
        if self.trainer == "running":
            assert all(s.status is Status.ACTIVE for s in training)
            assert all(s.status is Status.INACTIVE for s in table.overlap_workers())
        else:
            assert all(s.status is Status.INACTIVE for s in training)
        # every joining slot is in exactly one admission group, and only those
        members = [m for g in controller._groups.values() for m in g.members]
        assert len(members) == len(set(members))
        joining = {s.slot_id for s in table.rollout_slots([Status.JOINING])}
        assert set(members) == joining
        for group in controller._groups.values():
            assert group.ready <= group.members and group.ready != group.members
        # the journal round trip is exact
        snapshot = controller.snapshot()
        restored = _round_trip(controller, **self.policy)
        assert restored.snapshot() == snapshot
        assert restored.table.to_dict() == table.to_dict()
        assert restored.free_units == controller.free_units
        assert (restored.training_state, restored.training_step) == (
            controller.training_state,
            controller.training_step,
        )
        assert [(g.members, g.ready) for g in restored._groups.values()] == [
            (g.members, g.ready) for g in controller._groups.values()
        ]

    # -- the end: let every outstanding answer arrive
    def drain(self, rng: random.Random) -> None:
        while self.pending:
            kind, slot_id = self.pending.pop(rng.randrange(len(self.pending)))
            self.send(WorkerReady(slot_id) if kind == "ready" else WorkerReleased(slot_id))
            self.check()
        table = self.controller.table
        assert all(s.status in (Status.ACTIVE, Status.INACTIVE) for s in table)
        assert self.trainer != "waiting", "training never started"
        for source, state in self.sources.items():
            if state == "reclaimed":
                raise AssertionError(f"{source.tag} was reclaimed but never released")
        config = table.current_config()
        assert config is None or sum(table.role_counts().values()) == config.total


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=POLICIES,
    num_reserved=st.integers(0, 4),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_random_event_sequences_keep_the_controller_consistent(
    policy: dict[str, Any], num_reserved: int, data: st.DataObject, seed: int
) -> None:
    backend = FakeBackend(policy, num_reserved)
    backend.check()
    for _ in range(data.draw(st.integers(5, 40), label="num_events")):
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        backend.clock.advance(data.draw(st.sampled_from([0.0, 1.0, 30.0])))
        table = backend.controller.table
        if action == "respond" and backend.pending:
            index = data.draw(st.integers(0, len(backend.pending) - 1))
            kind, slot_id = backend.pending.pop(index)
            backend.send(WorkerReady(slot_id) if kind == "ready" else WorkerReleased(slot_id))
        elif action == "grant":
            source = ElasticSource(f"{9000 + len(backend.sources)}", data.draw(st.integers(0, 1)))
            count = data.draw(st.integers(1, 3))
            gpu_sets = tuple(gpus(backend.next_gpu + i) for i in range(count))
            backend.next_gpu += count
            backend.sources[source] = "granted"
            backend.send(CapacityGranted(source, gpu_sets))
        elif action == "reclaim":
            live = [s for s, state in backend.sources.items() if state == "granted"]
            if live:
                source = data.draw(st.sampled_from(live))
                backend.sources[source] = "reclaimed"
                backend.send(CapacityReclaimed(source, backend.clock.now_s + 30.0))
        elif action == "fail":
            victims = [s.slot_id for s in table.rollout_slots()]
            if victims:
                backend.send(WorkerFailed(data.draw(st.sampled_from(victims)), "test"))
        elif action == "begin" and backend.trainer == "idle":
            backend.step += 1
            backend.trainer = "waiting"
            backend.send(TrainingBegin(backend.step))
        elif action == "finish" and backend.trainer == "running":
            backend.trainer = "idle"
            unfinished = data.draw(st.sampled_from([None, 0, 16, 64]))
            backend.send(TrainingFinished(backend.step, unfinished))
        elif action == "telemetry":
            backend.send(
                StepTelemetry(
                    backend.step,
                    borrowed=data.draw(st.booleans()),
                    activation_s=data.draw(st.sampled_from([0.0, 5.0, 500.0])),
                    deactivation_s=3.0,
                    training_wait_s=data.draw(st.sampled_from([0.0, 2.0])),
                )
            )
        backend.check()
    backend.drain(random.Random(seed))


def test_cancelled_reserved_workers_give_their_gpus_back_to_the_base_job() -> None:
    controller, executor, _ = make_controller()
    controller.grant_reserved([gpus(0), gpus(1), gpus(2)])
    controller.handle(WorkerReady(0))
    controller.handle(WorkerFailed(1, "engine crashed"))  # cancels slots 0 and 2
    executor.take()
    release_all(controller, [0, 2])
    assert sorted(u.gpu_ids for u in controller.free_units) == [gpus(0), gpus(2)]
    assert ("release_capacity", None) not in [(n, a) for n, a in executor.calls]


def test_a_joining_slot_without_an_admission_group_is_admitted_alone() -> None:
    table = RoleTable()
    table.add_worker(gpus(0), zone=Zone.DEDICATED, role=Role.COLOCATED, status=Status.JOINING)
    controller, executor, _ = make_controller(table=table)
    controller.handle(WorkerReady(0))
    assert calls_named(executor, "admit") == [[0]]
    assert statuses(controller, [0]) == [Status.ACTIVE]
