"""Minimal-change transition plans (PEARL.md section 5).

From the current in-service rollout set ``W`` (joining, active or changing role) and a
target ``(N_P, N_D, N_C)``, produce ``(add, remove, role_changes)`` with exactly
``D_worker + D_role`` changes, where ``D_worker = |W'\\W| + |W\\W'|`` and
``D_role = sum_r [n_src(r) - min(n_src(r), n_dst(r))]`` over the survivors.

Greedy (optimal):
  1. forced removals (reclaimed capacity, returned borrowed workers) leave first;
  2. if still too many workers, remove only from roles with a surplus — each such
     removal saves a role change — preferring overlap (borrowed) workers, then elastic
     ones, then workers still joining, then the highest slot id;
  3. survivors keep their role up to the target count of that role;
  4. remaining deficits are filled by re-assigned survivors (lowest slot first, roles in
     the order prefill, decode, colocated), then by new workers from ``available``,
     taken in the order given; among those taken, a unit shaped for a role
     (``CapacityUnit.role``) serves that role if the target needs it.
``remove`` lists overlap (borrowed) workers first: returning them is never delayed.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pearl_hpc.core.table import IN_SERVICE, ElasticSource, RoleTable, WorkerSlot
from pearl_hpc.core.types import ROLLOUT_ROLES, PDConfig, Role, Status, Zone
from pearl_hpc.errors import PearlError


class PlanError(PearlError):
    """The target cannot be reached with the capacity offered."""


@dataclass(frozen=True, slots=True)
class CapacityUnit:
    """GPUs that can host one new rollout worker: free dedicated GPUs (reserved or from
    an elastic job) or an INACTIVE overlap worker that can be re-activated."""

    gpu_ids: tuple[str, ...]
    zone: Zone = Zone.DEDICATED
    source: ElasticSource | None = None
    slot_id: int | None = None  # set for an existing inactive overlap worker
    role: Role | None = None  # the role its GPUs are shaped for (an elastic pool's)


@dataclass(frozen=True, slots=True)
class WorkerAdd:
    slot_id: int
    gpu_ids: tuple[str, ...]
    role: Role
    zone: Zone
    source: ElasticSource | None
    reactivate: bool  # an inactive overlap worker activating (vs a new process)


@dataclass(frozen=True)
class TransitionPlan:
    target: PDConfig
    add: tuple[WorkerAdd, ...] = ()
    remove: tuple[int, ...] = ()  # overlap (borrowed) workers first
    role_changes: tuple[tuple[int, Role], ...] = ()  # (slot_id, new role)

    @property
    def num_changes(self) -> int:
        return len(self.add) + len(self.remove) + len(self.role_changes)

    @property
    def is_empty(self) -> bool:
        return self.num_changes == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.spec(),
            "add": [
                {
                    "slot_id": a.slot_id,
                    "gpu_ids": list(a.gpu_ids),
                    "role": a.role.value,
                    "zone": a.zone.value,
                    "source": None if a.source is None else a.source.tag,
                    "reactivate": a.reactivate,
                }
                for a in self.add
            ],
            "remove": list(self.remove),
            "role_changes": [{"slot_id": s, "role": r.value} for s, r in self.role_changes],
        }


def _removal_key(slot: WorkerSlot) -> tuple[int, int, int, int]:
    """Lower sorts first = removed first."""
    return (
        0 if slot.zone is Zone.OVERLAP else 1,
        0 if slot.source is not None else 1,
        0 if slot.status is Status.JOINING else 1,
        -slot.slot_id,
    )


class _Units:
    """The units offered for new workers, taken in amortised O(1) each (a plan is linear
    in its new workers): the unit a new ``role`` worker goes to is the first offered
    that is shaped for that role, else the first shaped for none, else the first left."""

    def __init__(self, units: Sequence[CapacityUnit]) -> None:
        self.units = units
        self.by_shape: dict[Role | None, deque[int]] = defaultdict(deque)  # offered order
        for i, unit in enumerate(units):
            self.by_shape[unit.role].append(i)
        self.taken = [False] * len(units)
        self.first = 0  # no unit before this index is left
        self.unshaped = set(self.by_shape) <= {None}  # each new worker takes the next

    def take(self, role: Role) -> CapacityUnit:
        if self.unshaped:
            self.first += 1
            return self.units[self.first - 1]
        for wanted in (role, None):
            queue = self.by_shape.get(wanted)
            while queue and self.taken[queue[0]]:
                queue.popleft()
            if queue:
                return self._take(queue.popleft())
        while self.taken[self.first]:
            self.first += 1
        return self._take(self.first)

    def _take(self, i: int) -> CapacityUnit:
        self.taken[i] = True
        return self.units[i]


def plan_transition(
    table: RoleTable,
    target: PDConfig,
    available: Sequence[CapacityUnit] = (),
    must_remove: Iterable[int] = (),
) -> TransitionPlan:
    """Plan the minimal change from ``table``'s in-service set to ``target``."""
    current = [s for s in table.rollout_slots() if s.status in IN_SERVICE]
    forced_ids = set(must_remove)
    forced = [s for s in current if s.slot_id in forced_ids]
    pool = [s for s in current if s.slot_id not in forced_ids]

    want = {r: target.count(r) for r in ROLLOUT_ROLES}
    have: dict[Role, list[WorkerSlot]] = {r: [] for r in ROLLOUT_ROLES}
    for slot in pool:
        have[slot.effective_role].append(slot)

    # 2. voluntary removals, only from surplus roles
    excess = len(pool) - target.total
    removed = list(forced)
    if excess > 0:
        surplus = {r: max(0, len(have[r]) - want[r]) for r in ROLLOUT_ROLES}
        ranked = sorted((s for r in ROLLOUT_ROLES if surplus[r] for s in have[r]), key=_removal_key)
        for slot in ranked:
            if excess == 0:
                break
            role = slot.effective_role
            if surplus[role]:
                surplus[role] -= 1
                excess -= 1
                removed.append(slot)
        gone = {s.slot_id for s in removed}
        for r in ROLLOUT_ROLES:
            have[r] = [s for s in have[r] if s.slot_id not in gone]

    # 3. survivors keep their role up to the target; the rest are re-assigned
    spare: list[WorkerSlot] = []
    deficit: dict[Role, int] = {}
    for r in ROLLOUT_ROLES:
        keep = sorted(have[r], key=_removal_key, reverse=True)  # keep the most durable
        spare.extend(keep[want[r] :])
        deficit[r] = max(0, want[r] - len(keep))
    spare.sort(key=lambda s: s.slot_id)

    # 4. fill deficits: re-assigned survivors first, then new workers
    num_new = sum(deficit.values()) - len(spare)
    if num_new > len(available):
        raise PlanError(
            f"target {target} needs {num_new} new worker(s) but only {len(available)} "
            "capacity unit(s) are available: lower the target or grant more capacity"
        )
    offered = available[: max(0, num_new)]
    units = _Units(offered)
    new_ids = iter(table.next_slot_ids(sum(1 for u in offered if u.slot_id is None)))
    role_changes: list[tuple[int, Role]] = []
    adds: list[WorkerAdd] = []
    spare_iter = iter(spare)
    for r in ROLLOUT_ROLES:
        for _ in range(deficit[r]):
            survivor = next(spare_iter, None)
            if survivor is not None:
                role_changes.append((survivor.slot_id, r))
                continue
            unit = units.take(r)
            slot_id = unit.slot_id if unit.slot_id is not None else next(new_ids)
            adds.append(
                WorkerAdd(
                    slot_id, unit.gpu_ids, r, unit.zone, unit.source, unit.slot_id is not None
                )
            )

    remove = sorted(removed, key=lambda s: (s.zone is not Zone.OVERLAP, s.slot_id))
    return TransitionPlan(
        target=target,
        add=tuple(adds),
        remove=tuple(s.slot_id for s in remove),
        role_changes=tuple(role_changes),
    )
