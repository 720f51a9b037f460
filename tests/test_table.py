"""The unified GPU-worker-role table (PEARL.md section 2): lifecycle, invariants, slot
reuse, retargeting and the JSON journal, by hand and by a hypothesis state machine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pearl_hpc.core.table import ElasticSource, RoleTable, WorkerSlot
from pearl_hpc.core.types import PDConfig, Role, Status, Zone
from pearl_hpc.errors import InvariantError, TransitionError
from tests.factories import gpus, make_table

REMOVED = "removed"
ALL_TARGETS: tuple[Status | str, ...] = (*Status, REMOVED)

# The lifecycle written out independently of the table's own tables (module docstring of
# pearl_hpc.core.table): kind -> from status -> legal targets.
EXPECTED_LEGAL: dict[str, dict[Status, set[Status | str]]] = {
    "dedicated": {
        Status.JOINING: {Status.ACTIVE, Status.LEAVING, REMOVED},
        Status.ACTIVE: {Status.REROLE, Status.LEAVING},
        Status.REROLE: {Status.ACTIVE, Status.LEAVING},
        Status.LEAVING: {REMOVED},  # dedicated GPUs are released, never parked
    },
    "overlap": {
        Status.JOINING: {Status.ACTIVE, Status.LEAVING, REMOVED},
        Status.ACTIVE: {Status.REROLE, Status.LEAVING},
        Status.REROLE: {Status.ACTIVE, Status.LEAVING},
        Status.LEAVING: {Status.INACTIVE},  # the process is kept alive
        Status.INACTIVE: {Status.JOINING, REMOVED},
    },
    "training": {
        Status.ACTIVE: {Status.INACTIVE},
        Status.INACTIVE: {Status.ACTIVE, REMOVED},
    },
}


def _slot_in(kind: str, status: Status) -> tuple[RoleTable, int]:
    """A table holding one slot of ``kind`` in ``status`` (reached through the lifecycle)."""
    table = RoleTable()
    if kind == "training":
        slot = table.add_worker(
            ["t:0", "t:1"], zone=Zone.OVERLAP, role=Role.TRAINING, status=status
        )
        return table, slot.slot_id
    if kind == "overlap":
        table.add_worker(
            ["t:0", "t:1"], zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE
        )
        slot = table.add_worker(
            ["t:0", "t:1"], zone=Zone.OVERLAP, role=Role.PREFILL, status=Status.INACTIVE
        )
        path = {
            Status.INACTIVE: [],
            Status.JOINING: [Status.JOINING],
            Status.ACTIVE: [Status.JOINING, Status.ACTIVE],
            Status.REROLE: [Status.JOINING, Status.ACTIVE, Status.REROLE],
            Status.LEAVING: [Status.JOINING, Status.ACTIVE, Status.LEAVING],
        }[status]
    else:
        slot = table.add_worker(gpus(0), zone=Zone.DEDICATED, role=Role.PREFILL)
        path = {
            Status.JOINING: [],
            Status.ACTIVE: [Status.ACTIVE],
            Status.REROLE: [Status.ACTIVE, Status.REROLE],
            Status.LEAVING: [Status.ACTIVE, Status.LEAVING],
        }[status]
    for step in path:
        role = Role.DECODE if step is Status.REROLE else None
        table.transition(slot.slot_id, step, role=role)
    assert table.get(slot.slot_id).status is status
    return table, slot.slot_id


def _move(table: RoleTable, slot_id: int, target: Status | str) -> None:
    if target == REMOVED:
        table.remove(slot_id)
        return
    assert isinstance(target, Status)
    role = None
    if target is Status.REROLE:
        role = Role.COLOCATED  # differs from both prefill and decode
    table.transition(slot_id, target, role=role, now_s=7.0)


LIFECYCLE_CASES = [
    (kind, source, target, target in legal)
    for kind, table_ in EXPECTED_LEGAL.items()
    for source, legal in table_.items()
    for target in ALL_TARGETS
]


@pytest.mark.parametrize(
    ("kind", "source", "target", "legal"),
    LIFECYCLE_CASES,
    ids=[f"{k}-{s.value}-{t if isinstance(t, str) else t.value}" for k, s, t, _ in LIFECYCLE_CASES],
)
def test_lifecycle_table(kind: str, source: Status, target: Status | str, legal: bool) -> None:
    table, slot_id = _slot_in(kind, source)
    before = table.to_dict()
    if legal:
        _move(table, slot_id, target)
        if target == REMOVED:
            assert slot_id not in table
        else:
            assert table.get(slot_id).status is target
            assert table.get(slot_id).since_s == 7.0
        assert table.version == before["table_version"] + 1
        table.check_invariants()
    else:
        with pytest.raises(TransitionError) as err:
            _move(table, slot_id, target)
        target_name = target if isinstance(target, str) else target.value
        message = str(err.value)
        assert f"slot {slot_id}" in message
        assert f"illegal move {source.value} -> {target_name}" in message
        assert table.to_dict() == before  # a rejected move changes nothing


@pytest.mark.parametrize("status", list(Status))
def test_fail_removes_from_any_status(status: Status) -> None:
    for kind in ("dedicated", "overlap"):
        if status not in EXPECTED_LEGAL[kind]:
            continue
        table, slot_id = _slot_in(kind, status)
        table.fail(slot_id)
        assert slot_id not in table
        table.check_invariants()


def test_rerole_moves_pending_role_then_commits_it() -> None:
    table = make_table(PDConfig(2, 2))
    slot = table.transition(0, Status.REROLE, role=Role.DECODE)
    assert (slot.role, slot.pending_role, slot.effective_role) == (
        Role.PREFILL,
        Role.DECODE,
        Role.DECODE,
    )
    assert table.role_counts() == {Role.PREFILL: 1, Role.DECODE: 3, Role.COLOCATED: 0}
    table.transition(0, Status.ACTIVE)
    assert (slot.role, slot.pending_role) == (Role.DECODE, None)
    table.transition(1, Status.REROLE, role=Role.DECODE)
    table.transition(1, Status.LEAVING)  # an abandoned rerole keeps the old role
    assert (table.get(1).role, table.get(1).pending_role) == (Role.PREFILL, None)
    table.check_invariants()


@pytest.mark.parametrize("role", [None, Role.PREFILL, Role.TRAINING])
def test_rerole_needs_a_new_rollout_role(role: Role | None) -> None:
    table = make_table(PDConfig(1, 1))
    with pytest.raises(TransitionError, match="REROLE needs a new rollout role"):
        table.transition(0, Status.REROLE, role=role)
    assert table.get(0).status is Status.ACTIVE


def test_role_only_with_rerole_or_activation() -> None:
    table = make_table(PDConfig(1, 1), num_training_gpus=2, num_overlap_workers=1)
    dedicated = table.in_service()[0].slot_id
    with pytest.raises(TransitionError, match="role can only be given"):
        table.transition(dedicated, Status.LEAVING, role=Role.DECODE)
    # an overlap worker activating may take any rollout role
    overlap = table.overlap_workers()[0].slot_id
    table.transition(overlap, Status.JOINING, role=Role.DECODE)
    assert table.get(overlap).role is Role.DECODE
    assert table.role_counts()[Role.DECODE] == 2


def test_unknown_slot_is_a_transition_error() -> None:
    table = make_table(PDConfig(1, 1))
    with pytest.raises(TransitionError, match="slot 9 does not exist"):
        table.transition(9, Status.LEAVING)


@pytest.mark.parametrize(
    ("status", "zone"),
    [
        (Status.REROLE, Zone.DEDICATED),
        (Status.LEAVING, Zone.DEDICATED),
        (Status.INACTIVE, Zone.DEDICATED),
    ],
)
def test_new_rollout_worker_start_status(status: Status, zone: Zone) -> None:
    table = RoleTable()
    with pytest.raises(TransitionError):
        table.add_worker(gpus(0), zone=zone, role=Role.DECODE, status=status)
    assert len(table) == 0
    assert table.next_slot_ids(1) == [0]


# ------------------------------------------------------------------ invariants
def test_gpu_bound_to_two_rollout_workers() -> None:
    table = make_table(PDConfig(1, 1))
    with pytest.raises(InvariantError, match="already bound to rollout worker 0"):
        table.add_worker(["n0:1", "z:0"], zone=Zone.DEDICATED, role=Role.DECODE)
    # also between overlap workers on the same training GPU, whatever their status
    table = make_table(num_training_gpus=4, num_overlap_workers=1)
    with pytest.raises(InvariantError):
        table.add_worker(
            ["t:1", "t:2"], zone=Zone.OVERLAP, role=Role.DECODE, status=Status.INACTIVE
        )
    # the failed add did not consume the slot id and bound nothing
    assert table.next_slot_ids(1) == [2]
    slot = table.add_worker(
        ["t:2", "t:3"], zone=Zone.OVERLAP, role=Role.DECODE, status=Status.INACTIVE
    )
    assert slot.slot_id == 2
    table.check_invariants()


@pytest.mark.parametrize("gpu_ids", [(), ("a", "a")])
def test_bad_gpu_sets(gpu_ids: tuple[str, ...]) -> None:
    with pytest.raises(InvariantError):
        RoleTable().add_worker(gpu_ids, zone=Zone.DEDICATED, role=Role.PREFILL)


def test_overlap_worker_cannot_activate_while_training_is_active() -> None:
    table = make_table(num_training_gpus=4, num_overlap_workers=2)
    table.transition(0, Status.ACTIVE)  # training step runs
    with pytest.raises(InvariantError, match="cannot activate while training slots \\[0\\]"):
        table.transition(1, Status.JOINING)
    assert table.get(1).status is Status.INACTIVE
    # a new overlap worker on the busy training GPUs may only register idle
    table.remove(2)
    with pytest.raises(InvariantError, match="cannot start while training is active"):
        table.add_worker(["t:2", "t:3"], zone=Zone.OVERLAP, role=Role.DECODE)
    table.add_worker(["t:2", "t:3"], zone=Zone.OVERLAP, role=Role.DECODE, status=Status.INACTIVE)
    # after the step the overlap worker may activate
    table.transition(0, Status.INACTIVE)
    table.transition(1, Status.JOINING)
    table.check_invariants()


@pytest.mark.parametrize("status", [Status.JOINING, Status.ACTIVE, Status.REROLE, Status.LEAVING])
def test_training_cannot_start_while_overlap_worker_is_busy(status: Status) -> None:
    table = make_table(num_training_gpus=4, num_overlap_workers=2)
    for step in {
        Status.JOINING: [Status.JOINING],
        Status.ACTIVE: [Status.JOINING, Status.ACTIVE],
        Status.REROLE: [Status.JOINING, Status.ACTIVE, Status.REROLE],
        Status.LEAVING: [Status.JOINING, Status.LEAVING],
    }[status]:
        table.transition(2, step, role=Role.DECODE if step is Status.REROLE else None)
    with pytest.raises(InvariantError, match=r"overlap workers \[2\] still hold its GPUs"):
        table.transition(0, Status.ACTIVE)
    assert table.get(0).status is Status.INACTIVE
    table.check_invariants()


def test_training_starts_once_overlap_workers_are_inactive() -> None:
    table = make_table(num_training_gpus=4, num_overlap_workers=2)
    table.transition(1, Status.JOINING)
    table.transition(1, Status.ACTIVE)
    table.transition(1, Status.LEAVING)
    table.transition(1, Status.INACTIVE)
    table.transition(0, Status.ACTIVE)
    assert table.training_active()
    table.check_invariants()


def test_zones_keep_to_their_gpus() -> None:
    table = make_table(PDConfig(1, 1), num_training_gpus=2)
    with pytest.raises(InvariantError, match="dedicated worker on training GPUs"):
        table.add_worker(["t:1", "z:0"], zone=Zone.DEDICATED, role=Role.PREFILL)
    with pytest.raises(InvariantError, match="training GPUs only"):
        table.add_worker(
            ["t:0", "z:0"], zone=Zone.OVERLAP, role=Role.PREFILL, status=Status.INACTIVE
        )
    with pytest.raises(InvariantError, match="dedicated rollout GPU"):
        table.add_worker(["n0:0"], zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE)
    with pytest.raises(InvariantError, match="overlap zone"):
        table.add_worker(["z:9"], zone=Zone.DEDICATED, role=Role.TRAINING, status=Status.INACTIVE)
    with pytest.raises(InvariantError, match="already belongs to training slot"):
        table.add_worker(["t:1"], zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE)
    table.check_invariants()


def test_training_slot_hosting_overlap_workers_cannot_go() -> None:
    table = make_table(num_training_gpus=2, num_overlap_workers=1)
    with pytest.raises(InvariantError, match="still hosts overlap workers \\[1\\]"):
        table.remove(0)
    with pytest.raises(InvariantError):
        table.fail(0)
    table.remove(1)
    table.remove(0)
    assert len(table) == 0


def test_check_invariants_sees_corruption() -> None:
    table = make_table(PDConfig(1, 1), num_training_gpus=2)
    table.check_invariants()
    table.get(1).gpu_ids = ("t:0", "t:1")  # a dedicated worker moved onto training GPUs
    with pytest.raises(InvariantError):
        table.check_invariants()
    table = make_table(PDConfig(1, 1))
    table.get(1).pending_role = Role.COLOCATED  # pending role outside REROLE
    with pytest.raises(InvariantError, match="pending role"):
        table.check_invariants()


# ------------------------------------------------------------------ slot reuse
def test_removed_slot_ids_are_reused_lowest_first() -> None:
    table = make_table(PDConfig.colocated(5), status=Status.JOINING)
    table.remove(3)
    table.fail(1)
    survivors = {s.slot_id: s.gpu_ids for s in table}
    assert table.next_slot_ids(3) == [1, 3, 5]
    added = [
        table.add_worker([f"x:{i}"], zone=Zone.DEDICATED, role=Role.DECODE).slot_id
        for i in range(3)
    ]
    assert added == [1, 3, 5]
    for slot_id, gpu_ids in survivors.items():  # survivors never renumbered
        assert table.get(slot_id).gpu_ids == gpu_ids
    assert [s.slot_id for s in table] == [0, 1, 2, 3, 4, 5]


def test_explicit_slot_ids() -> None:
    table = make_table(PDConfig.colocated(2))
    table.add_worker(["x:0"], zone=Zone.DEDICATED, role=Role.COLOCATED, slot_id=5)
    assert table.next_slot_ids(4) == [2, 3, 4, 6]  # skipped ids stay free
    with pytest.raises(InvariantError, match="already in use"):
        table.add_worker(["x:1"], zone=Zone.DEDICATED, role=Role.COLOCATED, slot_id=5)
    table.add_worker(["x:1"], zone=Zone.DEDICATED, role=Role.COLOCATED, slot_id=3)
    assert table.next_slot_ids(3) == [2, 4, 6]
    assert table.add_worker(["x:2"], zone=Zone.DEDICATED, role=Role.COLOCATED).slot_id == 2
    table.check_invariants()


# ------------------------------------------------------------------- retarget
def test_retarget_joining_and_rerole() -> None:
    table = make_table(PDConfig(1, 1))
    joining = table.add_worker(["x:0"], zone=Zone.DEDICATED, role=Role.PREFILL)
    version = table.version
    table.retarget(joining.slot_id, Role.DECODE)
    assert joining.role is Role.DECODE and joining.status is Status.JOINING
    assert table.version == version + 1
    table.transition(0, Status.REROLE, role=Role.DECODE)
    table.retarget(0, Role.COLOCATED)
    slot = table.get(0)
    assert (slot.role, slot.pending_role, slot.status) == (
        Role.PREFILL,
        Role.COLOCATED,
        Status.REROLE,
    )
    assert table.role_counts() == {Role.PREFILL: 0, Role.DECODE: 2, Role.COLOCATED: 1}
    table.check_invariants()


def test_retarget_rejects_serving_and_training_slots() -> None:
    table = make_table(PDConfig(1, 1), num_training_gpus=2)
    with pytest.raises(TransitionError, match="only JOINING or REROLE"):
        table.retarget(1, Role.DECODE)  # ACTIVE
    with pytest.raises(TransitionError, match="rollout roles"):
        table.retarget(0, Role.DECODE)  # the training slot
    table.add_worker(["x:0"], zone=Zone.DEDICATED, role=Role.PREFILL)
    with pytest.raises(TransitionError, match="rollout roles"):
        table.retarget(3, Role.TRAINING)
    assert table.get(3).role is Role.PREFILL


# -------------------------------------------------------------------- journal
def _rich_table() -> RoleTable:
    table = make_table(PDConfig(2, 3), num_training_gpus=4, num_overlap_workers=2)
    job = ElasticSource("4242", 1)
    table.add_worker(["e:0", "e:1"], zone=Zone.DEDICATED, role=Role.DECODE, source=job, now_s=3.5)
    table.transition(3, Status.REROLE, role=Role.DECODE, now_s=4.0)
    table.transition(1, Status.JOINING, role=Role.DECODE, now_s=5.0)
    table.transition(5, Status.LEAVING, now_s=6.0)
    table.remove(5)
    return table


def test_json_round_trip() -> None:
    table = _rich_table()
    text = table.to_json()
    back = RoleTable.from_json(text)
    assert back.to_dict() == table.to_dict()
    assert back.to_json() == text
    assert back.next_slot_ids(3) == table.next_slot_ids(3) == [5, 9, 10]
    assert back.get(3).pending_role is Role.DECODE
    assert back.get(1).role is Role.DECODE and back.get(1).status is Status.JOINING
    assert back.get(8).source == ElasticSource("4242", 1)
    assert back.get(8).since_s == 3.5
    # the restored table keeps working: its GPU index is rebuilt
    with pytest.raises(InvariantError):
        back.add_worker(["e:1"], zone=Zone.DEDICATED, role=Role.DECODE)


def _corrupt(mutate: Any) -> dict[str, Any]:
    data = json.loads(_rich_table().to_json())
    mutate(data)
    return data


def _slot(data: dict[str, Any], slot_id: int) -> dict[str, Any]:
    return next(s for s in data["slots"] if s["slot_id"] == slot_id)


CORRUPTIONS = {
    "gpu twice": lambda d: _slot(d, 4).update(gpu_ids=["n0:0", "n9:9"]),
    "wrong version": lambda d: d.update(version=99),
    "no version": lambda d: d.pop("version"),
    "slot twice": lambda d: d["slots"].append(dict(_slot(d, 4), gpu_ids=["q:0"])),
    "slot beyond next id": lambda d: d.update(next_slot_id=5),
    "free id in use": lambda d: d["free_slot_ids"].append(4),
    "free id twice": lambda d: d["free_slot_ids"].append(5),
    "free id beyond next id": lambda d: d["free_slot_ids"].append(12),
    "dedicated on training gpus": lambda d: _slot(d, 4).update(gpu_ids=["t:0"]),
    "overlap off training gpus": lambda d: _slot(d, 1).update(gpu_ids=["q:0", "q:1"]),
    "pending role without rerole": lambda d: _slot(d, 4).update(pending_role="decode"),
    "busy overlap under active training": lambda d: _slot(d, 0).update(status="active"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_snapshot_is_rejected(name: str) -> None:
    data = _corrupt(CORRUPTIONS[name])
    with pytest.raises(InvariantError):
        RoleTable.from_dict(data)


def test_wrong_version_message_names_both_versions() -> None:
    data = _corrupt(lambda d: d.update(version=2))
    with pytest.raises(InvariantError, match="version 2 is not 1"):
        RoleTable.from_json(json.dumps(data))


# ------------------------------------------------------------ state machine
NUM_DEDICATED_GPUS = 8
NUM_TRAINING_GPUS = 6
ROLLOUT = [Role.PREFILL, Role.DECODE, Role.COLOCATED]
dedicated_gpu = st.sampled_from([f"d:{i}" for i in range(NUM_DEDICATED_GPUS)])
training_gpu = st.sampled_from([f"t:{i}" for i in range(NUM_TRAINING_GPUS)])
any_gpu = st.one_of(dedicated_gpu, training_gpu)
gpu_set = st.lists(any_gpu, min_size=1, max_size=3, unique=True)
rollout_role = st.sampled_from(ROLLOUT)
maybe_role = st.one_of(st.none(), st.sampled_from(list(Role)))


def _independent_invariants(table: RoleTable) -> None:
    """The four invariants, checked without the table's own indexes."""
    slots = list(table)
    training = [s for s in slots if s.role is Role.TRAINING]
    rollout = [s for s in slots if s.role is not Role.TRAINING]
    training_gpus = {g: s for s in training for g in s.gpu_ids}
    seen: dict[str, int] = {}
    for s in rollout:
        for g in s.gpu_ids:
            assert g not in seen, f"GPU {g} in rollout slots {seen[g]} and {s.slot_id}"
            seen[g] = s.slot_id
        on_training = [g for g in s.gpu_ids if g in training_gpus]
        if s.zone is Zone.OVERLAP:
            assert len(on_training) == len(s.gpu_ids)
            if s.status is not Status.INACTIVE:
                assert all(training_gpus[g].status is not Status.ACTIVE for g in s.gpu_ids)
        else:
            assert not on_training
        assert (s.status is Status.REROLE) == (s.pending_role is not None)
    assert sum(len(s.gpu_ids) for s in training) == len(training_gpus)
    for s in training:
        assert s.zone is Zone.OVERLAP and s.status in (Status.ACTIVE, Status.INACTIVE)
    assert len({s.slot_id for s in slots}) == len(slots)


class RoleTableMachine(RuleBasedStateMachine):
    """Random add / transition / retarget / remove / fail; illegal moves must raise and
    leave the table as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.table = RoleTable()
        self.gpus_of: dict[int, tuple[str, ...]] = {}  # model: slot -> fixed GPU set

    @initialize(split=st.integers(0, NUM_TRAINING_GPUS))
    def training(self, split: int) -> None:
        """One or two training slots over the training GPUs."""
        parts = [range(0, split), range(split, NUM_TRAINING_GPUS)]
        for part in parts:
            if len(part):
                slot = self.table.add_worker(
                    [f"t:{i}" for i in part],
                    zone=Zone.OVERLAP,
                    role=Role.TRAINING,
                    status=Status.INACTIVE,
                )
                self.gpus_of[slot.slot_id] = slot.gpu_ids

    def _attempt(self, action: Any) -> WorkerSlot | None:
        before = self.table.to_dict()
        ids_before = self.table.next_slot_ids(4)
        try:
            return action()
        except (TransitionError, InvariantError):
            after = self.table.to_dict()
            # a refused add may raise the high-water mark, but never loses a free id
            for key in ("next_slot_id", "free_slot_ids"):
                del before[key]
                del after[key]
            assert after == before
            assert self.table.next_slot_ids(4) == ids_before
            return None

    def _slot_ids(self) -> list[int]:
        return [s.slot_id for s in self.table]

    @rule(
        gpu_ids=gpu_set,
        zone=st.sampled_from(list(Zone)),
        role=st.sampled_from(list(Role)),
        status=st.sampled_from(list(Status)),
        explicit=st.one_of(st.none(), st.integers(0, 12)),
    )
    def add(
        self,
        gpu_ids: list[str],
        zone: Zone,
        role: Role,
        status: Status,
        explicit: int | None,
        source: ElasticSource | None = None,
    ) -> None:
        expected_id = explicit if explicit is not None else self.table.next_slot_ids(1)[0]
        slot = self._attempt(
            lambda: self.table.add_worker(
                gpu_ids, zone=zone, role=role, status=status, slot_id=explicit, source=source
            )
        )
        if slot is not None:
            assert slot.slot_id == expected_id  # lowest free id first
            assert slot.slot_id not in self.gpus_of
            self.gpus_of[slot.slot_id] = tuple(gpu_ids)

    @rule(
        gpu_ids=st.lists(dedicated_gpu, min_size=1, max_size=2, unique=True),
        role=rollout_role,
        status=st.sampled_from([Status.JOINING, Status.ACTIVE]),
        elastic=st.booleans(),
    )
    def add_dedicated(self, gpu_ids: list[str], role: Role, status: Status, elastic: bool) -> None:
        """A plausible dedicated add (may still collide on a GPU)."""
        source = ElasticSource("77", 1) if elastic else None
        self.add(gpu_ids, Zone.DEDICATED, role, status, None, source)

    @rule(gpu_ids=st.lists(training_gpu, min_size=1, max_size=2, unique=True), role=rollout_role)
    def add_overlap(self, gpu_ids: list[str], role: Role) -> None:
        """A plausible overlap worker, registered idle (may still collide on a GPU)."""
        self.add(gpu_ids, Zone.OVERLAP, role, Status.INACTIVE, None)

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), status=st.sampled_from(list(Status)), role=maybe_role)
    def transition(self, data: st.DataObject, status: Status, role: Role | None) -> None:
        slot_id = data.draw(st.sampled_from(self._slot_ids()))
        self._attempt(lambda: self.table.transition(slot_id, status, role=role))

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), role=st.sampled_from(list(Role)))
    def retarget(self, data: st.DataObject, role: Role) -> None:
        slot_id = data.draw(st.sampled_from(self._slot_ids()))
        self._attempt(lambda: self.table.retarget(slot_id, role))

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        slot_id = data.draw(st.sampled_from(self._slot_ids()))
        if self._attempt(lambda: self.table.remove(slot_id)) is not None:
            del self.gpus_of[slot_id]

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        slot_id = data.draw(st.sampled_from(self._slot_ids()))
        if self._attempt(lambda: self.table.fail(slot_id)) is not None:
            del self.gpus_of[slot_id]

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), rerole=st.sampled_from([None, None, None, *ROLLOUT]))
    def walk_forward(self, data: st.DataObject, rerole: Role | None) -> None:
        """Take a legal step (random moves alone rarely reach deep statuses)."""
        slot = self.table.get(data.draw(st.sampled_from(self._slot_ids())))
        if slot.status is Status.LEAVING and slot.zone is Zone.DEDICATED:
            if self._attempt(lambda: self.table.remove(slot.slot_id)) is not None:
                del self.gpus_of[slot.slot_id]
            return
        steps = {
            Status.JOINING: Status.ACTIVE,
            Status.ACTIVE: Status.INACTIVE if slot.role is Role.TRAINING else Status.LEAVING,
            Status.REROLE: Status.ACTIVE,
            Status.LEAVING: Status.INACTIVE,
            Status.INACTIVE: Status.ACTIVE if slot.role is Role.TRAINING else Status.JOINING,
        }
        target = steps[slot.status]
        if slot.is_rollout and slot.status is Status.ACTIVE and rerole not in (None, slot.role):
            self._attempt(lambda: self.table.transition(slot.slot_id, Status.REROLE, role=rerole))
            return
        self._attempt(lambda: self.table.transition(slot.slot_id, target))

    @invariant()
    def consistent(self) -> None:
        self.table.check_invariants()
        _independent_invariants(self.table)
        assert {s.slot_id: s.gpu_ids for s in self.table} == self.gpus_of  # never renumbered
        text = self.table.to_json()
        back = RoleTable.from_json(text)
        assert back.to_dict() == self.table.to_dict()
        assert back.to_json() == text
        assert back.next_slot_ids(3) == self.table.next_slot_ids(3)
        in_service = [
            s
            for s in self.table
            if s.is_rollout and s.status in (Status.JOINING, Status.ACTIVE, Status.REROLE)
        ]
        counts = self.table.role_counts()
        assert sum(counts.values()) == len(in_service)


RoleTableMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRoleTableMachine = RoleTableMachine.TestCase
