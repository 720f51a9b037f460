"""Minimal-change transition plans (PEARL.md section 5): hand examples and properties
over random tables, targets and forced removals."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearl_hpc.core.orchestrator import (
    CapacityUnit,
    PlanError,
    TransitionPlan,
    WorkerAdd,
    plan_transition,
)
from pearl_hpc.core.table import ElasticSource, RoleTable, WorkerSlot
from pearl_hpc.core.types import ROLLOUT_ROLES, PDConfig, Role, Status, Zone
from tests.factories import gpus, make_table

IN_SERVICE = (Status.JOINING, Status.ACTIVE, Status.REROLE)
JOB = ElasticSource("1001", 0)


def units(
    count: int, *, start: int = 100, source: ElasticSource | None = None
) -> list[CapacityUnit]:
    return [CapacityUnit(gpus(start + i), Zone.DEDICATED, source) for i in range(count)]


def in_service_ids(table: RoleTable) -> set[int]:
    return {s.slot_id for s in table.rollout_slots() if s.status in IN_SERVICE}


def apply_plan(table: RoleTable, plan: TransitionPlan) -> None:
    """Carry ``plan`` out the way the controller does, then let the leavers go."""
    for slot_id in plan.remove:
        table.transition(slot_id, Status.LEAVING)
    for slot_id, role in plan.role_changes:
        if table.get(slot_id).status is Status.ACTIVE:
            table.transition(slot_id, Status.REROLE, role=role)
        else:
            table.retarget(slot_id, role)
    for add in plan.add:
        if add.reactivate:
            table.transition(add.slot_id, Status.JOINING, role=add.role)
        else:
            table.add_worker(
                add.gpu_ids, zone=add.zone, role=add.role, source=add.source, slot_id=add.slot_id
            )
    table.check_invariants()
    for slot_id in plan.remove:
        if table.get(slot_id).zone is Zone.OVERLAP:
            table.transition(slot_id, Status.INACTIVE)
        else:
            table.remove(slot_id)
    table.check_invariants()


def target_counts(target: PDConfig) -> dict[Role, int]:
    return {r: target.count(r) for r in ROLLOUT_ROLES}


# ------------------------------------------------------------------ examples
def test_grow_adds_workers_without_role_changes() -> None:
    table = make_table(PDConfig(3, 5))
    plan = plan_transition(table, PDConfig(4, 6), units(3))
    assert plan.remove == () and plan.role_changes == ()
    assert plan.add == (
        WorkerAdd(8, gpus(100), Role.PREFILL, Zone.DEDICATED, None, False),
        WorkerAdd(9, gpus(101), Role.DECODE, Zone.DEDICATED, None, False),
    )
    assert plan.num_changes == 2
    apply_plan(table, plan)
    assert table.current_config() == PDConfig(4, 6)


def test_units_shaped_for_a_role_serve_that_role() -> None:
    """Two units from a decode pool and one from a prefill pool, offered decode first:
    the prefill worker goes to the prefill-shaped unit, the decode ones to theirs; the
    set of units taken is the one offered, whatever their shape."""
    table = make_table(PDConfig(1, 1))
    decode = [CapacityUnit(gpus(100 + i), Zone.DEDICATED, JOB, role=Role.DECODE) for i in range(2)]
    prefill = CapacityUnit(gpus(102), Zone.DEDICATED, JOB, role=Role.PREFILL)
    plan = plan_transition(table, PDConfig(2, 3), [*decode, prefill])
    assert {(a.gpu_ids, a.role) for a in plan.add} == {
        (gpus(102), Role.PREFILL),
        (gpus(100), Role.DECODE),
        (gpus(101), Role.DECODE),
    }
    # the units taken are the first ones offered: shaped for another role, still used
    plan = plan_transition(make_table(PDConfig(1, 1)), PDConfig(1, 2), [prefill, *decode])
    assert [(a.gpu_ids, a.role) for a in plan.add] == [(gpus(102), Role.DECODE)]
    plan = plan_transition(make_table(PDConfig.colocated(1)), PDConfig.colocated(2), [prefill])
    assert [(a.gpu_ids, a.role) for a in plan.add] == [(gpus(102), Role.COLOCATED)]


def test_same_target_is_an_empty_plan() -> None:
    table = make_table(PDConfig(3, 5))
    plan = plan_transition(table, PDConfig(3, 5), units(2))
    assert plan.is_empty


def test_colocated_to_disaggregated_rebinds_every_worker() -> None:
    # every colocated worker must take a new role: D_role = 8 - min(8, 0) = 8
    table = make_table(PDConfig.colocated(8))
    plan = plan_transition(table, PDConfig(5, 3))
    assert plan.add == () and plan.remove == ()
    assert plan.role_changes == tuple((i, Role.PREFILL if i < 5 else Role.DECODE) for i in range(8))
    apply_plan(table, plan)
    assert table.current_config() == PDConfig(5, 3)


def test_ratio_change_moves_only_the_surplus() -> None:
    table = make_table(PDConfig(3, 5))  # prefill 0-2, decode 3-7
    plan = plan_transition(table, PDConfig(5, 3))
    # survivors keep their role lowest slot first; the rest of the surplus moves
    assert plan.role_changes == ((6, Role.PREFILL), (7, Role.PREFILL))
    assert plan.num_changes == 2


def test_shrink_with_forced_removals() -> None:
    table = make_table(PDConfig(3, 5))
    plan = plan_transition(table, PDConfig(3, 3), must_remove=[6, 7])
    assert plan.remove == (6, 7)
    assert plan.add == () and plan.role_changes == ()


def test_forced_removal_of_every_prefill_worker_rebinds_decode_workers() -> None:
    table = make_table(PDConfig(3, 5))
    plan = plan_transition(table, PDConfig(2, 3), must_remove=[0, 1, 2])
    assert plan.remove == (0, 1, 2)
    assert plan.role_changes == ((6, Role.PREFILL), (7, Role.PREFILL))
    assert plan.num_changes == 5


def test_voluntary_shrink_removes_from_surplus_roles_only() -> None:
    table = make_table(PDConfig(3, 5))
    plan = plan_transition(table, PDConfig(3, 2))
    assert plan.remove == (5, 6, 7)  # the highest decode slots; prefill untouched
    assert plan.role_changes == ()


def test_voluntary_shrink_prefers_borrowed_then_elastic_then_joining() -> None:
    table = make_table(num_training_gpus=4, num_overlap_workers=2)  # overlap slots 1, 2
    table.transition(1, Status.JOINING, role=Role.COLOCATED)
    table.transition(1, Status.ACTIVE)
    for i in range(3):
        table.add_worker(gpus(i), zone=Zone.DEDICATED, role=Role.COLOCATED, status=Status.ACTIVE)
    elastic = table.add_worker(gpus(5), zone=Zone.DEDICATED, role=Role.COLOCATED, source=JOB)
    table.transition(elastic.slot_id, Status.ACTIVE)
    joining = table.add_worker(gpus(6), zone=Zone.DEDICATED, role=Role.COLOCATED)
    # in service: overlap 1, reserved 3-5, elastic 6, joining reserved 7
    assert plan_transition(table, PDConfig.colocated(5)).remove == (1,)
    assert plan_transition(table, PDConfig.colocated(4)).remove == (1, 6)
    assert plan_transition(table, PDConfig.colocated(3)).remove == (1, 6, joining.slot_id)
    assert plan_transition(table, PDConfig.colocated(2)).remove == (1, 5, 6, 7)


def test_borrowed_workers_are_listed_first_in_remove() -> None:
    table = RoleTable()
    for i in range(4):  # dedicated workers take the low slot ids 0-3
        table.add_worker(gpus(i), zone=Zone.DEDICATED, role=Role.COLOCATED, status=Status.ACTIVE)
    table.add_worker(
        ["t:0", "t:1", "t:2", "t:3"], zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE
    )
    for pair in (["t:0", "t:1"], ["t:2", "t:3"]):
        table.add_worker(pair, zone=Zone.OVERLAP, role=Role.COLOCATED, status=Status.ACTIVE)
    plan = plan_transition(table, PDConfig.colocated(2), must_remove=[0, 6, 2, 5])
    assert plan.remove == (5, 6, 0, 2)
    apply_plan(table, plan)
    assert [s.status for s in table.overlap_workers()] == [Status.INACTIVE, Status.INACTIVE]


def test_reactivating_inactive_overlap_workers() -> None:
    table = make_table(PDConfig(1, 1), num_training_gpus=4, num_overlap_workers=2)
    overlap = [
        CapacityUnit(s.gpu_ids, Zone.OVERLAP, None, s.slot_id) for s in table.overlap_workers()
    ]
    plan = plan_transition(table, PDConfig(2, 2), overlap)
    assert plan.add == (
        WorkerAdd(1, ("t:0", "t:1"), Role.PREFILL, Zone.OVERLAP, None, True),
        WorkerAdd(2, ("t:2", "t:3"), Role.DECODE, Zone.OVERLAP, None, True),
    )
    apply_plan(table, plan)
    assert table.get(1).status is Status.JOINING and table.get(1).role is Role.PREFILL
    assert table.current_config() == PDConfig(2, 2)


def test_new_workers_reuse_the_lowest_free_slot_ids_in_unit_order() -> None:
    table = make_table(PDConfig.colocated(5), status=Status.JOINING)
    table.remove(3)
    table.remove(1)
    plan = plan_transition(table, PDConfig.colocated(6), units(3, source=JOB))
    assert [(a.slot_id, a.gpu_ids, a.source) for a in plan.add] == [
        (1, gpus(100), JOB),
        (3, gpus(101), JOB),
        (5, gpus(102), JOB),
    ]


def test_joining_and_rerole_workers_count_by_their_target_role() -> None:
    table = make_table(PDConfig(2, 2))
    table.transition(0, Status.REROLE, role=Role.DECODE)  # 1P3D by effective role
    table.add_worker(gpus(9), zone=Zone.DEDICATED, role=Role.PREFILL)  # joining: 2P3D
    plan = plan_transition(table, PDConfig(2, 3))
    assert plan.is_empty
    plan = plan_transition(table, PDConfig(3, 2))
    assert len(plan.role_changes) == 1 and plan.num_changes == 1
    apply_plan(table, plan)
    assert table.role_counts() == {Role.PREFILL: 3, Role.DECODE: 2, Role.COLOCATED: 0}


def test_leaving_and_inactive_slots_are_not_in_service() -> None:
    table = make_table(PDConfig(2, 2), num_training_gpus=2, num_overlap_workers=1)
    table.transition(5, Status.LEAVING)  # a decode worker draining
    plan = plan_transition(table, PDConfig(2, 2), units(1))
    assert [a.role for a in plan.add] == [Role.DECODE]
    assert plan.remove == ()


def test_plan_error_when_capacity_is_short() -> None:
    table = make_table(PDConfig(3, 5))
    with pytest.raises(PlanError, match=r"needs 3 new worker\(s\) but only 2 capacity unit"):
        plan_transition(table, PDConfig(5, 6), units(2))
    with pytest.raises(PlanError, match="lower the target or grant more capacity"):
        plan_transition(table, PDConfig(3, 5), must_remove=[0])


def test_plan_to_dict() -> None:
    table = make_table(PDConfig(1, 2))  # prefill 0, decode 1-2
    plan = plan_transition(table, PDConfig(2, 2), units(2, source=JOB), must_remove=[2])
    assert plan.to_dict() == {
        "target": "2P2D",
        "add": [
            {
                "slot_id": 3,
                "gpu_ids": list(gpus(100)),
                "role": "prefill",
                "zone": "dedicated",
                "source": "1001+0",
                "reactivate": False,
            },
            {
                "slot_id": 4,
                "gpu_ids": list(gpus(101)),
                "role": "decode",
                "zone": "dedicated",
                "source": "1001+0",
                "reactivate": False,
            },
        ],
        "remove": [2],
        "role_changes": [],
    }


# ----------------------------------------------------------------- properties
@dataclass
class Case:
    table: RoleTable
    target: PDConfig
    available: list[CapacityUnit]
    must_remove: set[int]


@st.composite
def cases(draw: st.DrawFn, *, enough: bool = True) -> Case:
    table = RoleTable()
    num_overlap = draw(st.integers(0, 3))
    if num_overlap:
        table.add_worker(
            [f"t:{i}" for i in range(2 * num_overlap)],
            zone=Zone.OVERLAP,
            role=Role.TRAINING,
            status=Status.INACTIVE,
        )
    roles = st.sampled_from(list(ROLLOUT_ROLES))
    statuses = st.sampled_from(
        [Status.ACTIVE, Status.ACTIVE, Status.JOINING, Status.REROLE, Status.LEAVING]
    )
    for i in range(num_overlap):
        status = draw(st.sampled_from([Status.INACTIVE, *IN_SERVICE, Status.LEAVING]))
        slot = table.add_worker(
            [f"t:{2 * i}", f"t:{2 * i + 1}"],
            zone=Zone.OVERLAP,
            role=draw(roles),
            status=Status.INACTIVE,
        )
        _walk(table, slot, status, draw(roles))
    num_dedicated = draw(st.integers(0, 10))
    for i in range(num_dedicated):
        source = ElasticSource(f"j{draw(st.integers(0, 1))}") if draw(st.booleans()) else None
        slot = table.add_worker(
            gpus(i), zone=Zone.DEDICATED, role=draw(roles), status=Status.ACTIVE, source=source
        )
        _walk(table, slot, draw(statuses), draw(roles))
    # holes in the slot ids: some workers already gone
    for slot in list(table.rollout_slots()):
        if slot.zone is Zone.DEDICATED and draw(st.integers(0, 5)) == 0:
            table.fail(slot.slot_id)

    current = sorted(in_service_ids(table))
    must_remove = set(draw(st.lists(st.sampled_from(current), unique=True))) if current else set()
    if draw(st.booleans()):  # ids outside W are ignored: leaving, inactive, unknown
        must_remove |= {s.slot_id for s in table if s.status is Status.LEAVING} | {99}

    if draw(st.booleans()):
        n = draw(st.integers(0, 14))
        target = PDConfig.colocated(n)
    else:
        p = draw(st.integers(1, 7))
        target = PDConfig.disaggregated(p, draw(st.integers(1, 7)))

    pool = len(set(current) - must_remove)
    needed = max(0, target.total - pool)
    inactive = [
        CapacityUnit(s.gpu_ids, Zone.OVERLAP, None, s.slot_id)
        for s in table.overlap_workers()
        if s.status is Status.INACTIVE
    ]
    if enough:
        num_units = needed + draw(st.integers(0, 3))
    else:
        num_units = draw(st.integers(0, max(0, needed - 1)))
    dedicated = units(max(0, num_units - len(inactive)), source=ElasticSource("new", 2))
    available = draw(st.permutations(dedicated + inactive[: min(len(inactive), num_units)]))
    return Case(table, target, list(available), must_remove)


def _walk(table: RoleTable, slot: WorkerSlot, status: Status, role: Role) -> None:
    """Move a freshly added ACTIVE (or INACTIVE overlap) worker to ``status``."""
    sid = slot.slot_id
    if slot.status is Status.INACTIVE and status is not Status.INACTIVE:
        table.transition(sid, Status.JOINING)
        if status is Status.JOINING:
            return
        table.transition(sid, Status.ACTIVE)
    if status is Status.JOINING:  # a dedicated worker: re-add is simpler than rewind
        gpu_ids, zone, source, old_role = slot.gpu_ids, slot.zone, slot.source, slot.role
        table.fail(sid)
        table.add_worker(gpu_ids, zone=zone, role=old_role, source=source, slot_id=sid)
    elif status is Status.REROLE:
        new_role = (
            role if role is not slot.role else next(r for r in ROLLOUT_ROLES if r is not role)
        )
        table.transition(sid, Status.REROLE, role=new_role)
    elif status is Status.LEAVING:
        table.transition(sid, Status.LEAVING)


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cases())
def test_plan_has_exactly_the_minimum_number_of_changes(case: Case) -> None:
    table, target = case.table, case.target
    before = table.to_json()
    plan = plan_transition(table, target, case.available, case.must_remove)
    assert table.to_json() == before  # planning is pure

    slots = {s.slot_id: s for s in table}
    w = in_service_ids(table)
    forced = case.must_remove & w
    pool = w - forced
    removed, added = set(plan.remove), {a.slot_id for a in plan.add}
    assert len(removed) == len(plan.remove) and len(added) == len(plan.add)
    assert forced <= removed <= w
    assert not added & set(slots) - {a.slot_id for a in plan.add if a.reactivate}

    # (a) the change count from the definitions of PEARL.md section 5
    w_new = (w - removed) | added
    d_worker = len(w_new - w) + len(w - w_new)
    survivors = w & w_new
    n_src = Counter(slots[i].effective_role for i in survivors)
    n_dst = target_counts(target)
    d_role = sum(n_src[r] - min(n_src[r], n_dst[r]) for r in ROLLOUT_ROLES)
    assert plan.num_changes == d_worker + d_role
    assert len(plan.role_changes) == d_role

    # (b) ... and it is the minimum
    n_pool = Counter(slots[i].effective_role for i in pool)
    assert d_worker == len(forced) + abs(len(pool) - target.total)
    assert d_role == sum(max(0, n_pool[r] - n_dst[r]) for r in ROLLOUT_ROLES) - max(
        0, len(pool) - target.total
    )

    # shape: borrowed workers leave first; role changes are real changes of survivors
    zones = [slots[i].zone for i in plan.remove]
    assert zones == sorted(zones, key=lambda z: z is not Zone.OVERLAP)
    changed = [s for s, _ in plan.role_changes]
    assert len(set(changed)) == len(changed) and set(changed) <= survivors
    assert all(slots[s].effective_role is not r for s, r in plan.role_changes)
    voluntary = Counter(slots[i].effective_role for i in removed - forced)
    assert all(voluntary[r] <= max(0, n_pool[r] - n_dst[r]) for r in ROLLOUT_ROLES)
    # new workers take the first units offered, new processes the lowest free ids
    assert [a.gpu_ids for a in plan.add] == [u.gpu_ids for u in case.available[: len(plan.add)]]
    fresh = [a.slot_id for a in plan.add if not a.reactivate]
    assert sorted(fresh) == table.next_slot_ids(len(fresh))

    # (c) carrying the plan out reaches the target and keeps every invariant
    apply_plan(table, plan)
    assert table.role_counts() == n_dst
    assert in_service_ids(table) == w_new


@SETTINGS
@given(cases(enough=False))
def test_plan_error_exactly_when_capacity_is_short(case: Case) -> None:
    pool = in_service_ids(case.table) - case.must_remove
    needed = case.target.total - len(pool)
    if len(case.available) >= needed:
        plan = plan_transition(case.table, case.target, case.available, case.must_remove)
        assert len(plan.add) == max(0, needed)
    else:
        with pytest.raises(PlanError):
            plan_transition(case.table, case.target, case.available, case.must_remove)


def test_a_plan_grows_linearly_with_its_new_workers() -> None:
    """16x the workers costs well under 32x the time (a quadratic plan would be ~256x),
    measured in one process: a cold start placing every worker on a unit shaped for its
    role, for none, or for the other role."""
    import statistics
    import time

    shapes = (Role.PREFILL, Role.DECODE, None, Role.DECODE)

    def cold_s(n: int) -> float:
        units = [CapacityUnit((f"g{i}",), role=shapes[i % 4]) for i in range(n)]
        target = PDConfig(n // 4, n - n // 4, 0)
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan = plan_transition(RoleTable(), target, units)
            samples.append(time.perf_counter() - t0)
            assert len(plan.add) == n
        return statistics.median(samples)

    small, large = cold_s(1024), cold_s(16 * 1024)
    assert large / small < 32, f"1,024 workers: {small * 1e3:.1f} ms, 16,384: {large * 1e3:.1f} ms"


@given(
    shapes=st.lists(st.sampled_from([None, *ROLLOUT_ROLES]), max_size=30),
    wants=st.lists(st.sampled_from(ROLLOUT_ROLES), max_size=30),
)
def test_new_workers_take_units_in_the_order_offered(shapes: list, wants: list) -> None:
    """Each new worker takes the first unit offered shaped for its role, else the first
    shaped for none, else the first left (a list scan, as a reference)."""
    from pearl_hpc.core.orchestrator import _Units

    units = [CapacityUnit((f"g{i}",), role=r) for i, r in enumerate(shapes)]
    left, taker = list(units), _Units(units)
    for role in wants[: len(units)]:
        expected = next(
            (u for wanted in (role, None) for u in left if u.role is wanted), left[0]
        )
        left.remove(expected)
        assert taker.take(role) is expected
