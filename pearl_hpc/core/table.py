"""The unified GPU–worker–role table (PEARL.md section 2).

One table keyed by **stable worker slots** ``w -> (G_w, R_w, a_w)``: a slot is bound to a
fixed GPU set for the worker's whole life, survivors never change slot, and a new worker
reuses the lowest free slot id, so communicator ranks, routing entries and weight
broadcast keep their indices across reconfigurations.

Lifecycle (one transition function, :meth:`RoleTable.transition`; anything else raises
:class:`~pearl_hpc.errors.TransitionError`)::

    from \\ to   JOINING   ACTIVE    REROLE   LEAVING   INACTIVE        removed
    (new)       rollout   bootstrap  -        -         overlap/train   -
    JOINING     -         admitted   -        aborted   -               start failed
    ACTIVE      -         -          rollout  rollout   training idle   (fail only)
    REROLE      -         new role   -        rollout   -               (fail only)
    LEAVING     -         -          -        -         overlap         dedicated
    INACTIVE    overlap   training   -        -         -               yes

``fail`` removes a slot from any status (the process is gone).

Invariants (checked on every mutation, and all at once by :meth:`check_invariants`):
  1. no GPU is bound to two rollout workers (whatever their status);
  2. an overlap GPU is never active for training and rollout at once: a training slot
     is ACTIVE only while every overlap rollout worker on its GPUs is INACTIVE;
  3. overlap rollout workers live on training GPUs; dedicated workers never do;
  4. training slots have role training and live in the overlap zone.

One writer: only the controller mutates the table, one event at a time; backends send
events, never edit the table.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pearl_hpc.core.types import ROLLOUT_ROLES, PDConfig, Role, Status, Zone
from pearl_hpc.errors import InvariantError, TransitionError

SNAPSHOT_VERSION = 1

# Statuses counted as the current rollout set W (serving, or about to serve).
IN_SERVICE = frozenset({Status.JOINING, Status.ACTIVE, Status.REROLE})

_REMOVED = "removed"
_LEGAL_ROLLOUT: dict[Status, frozenset[Status | str]] = {
    Status.JOINING: frozenset({Status.ACTIVE, Status.LEAVING, _REMOVED}),
    Status.ACTIVE: frozenset({Status.REROLE, Status.LEAVING}),
    Status.REROLE: frozenset({Status.ACTIVE, Status.LEAVING}),
    Status.LEAVING: frozenset({Status.INACTIVE, _REMOVED}),
    Status.INACTIVE: frozenset({Status.JOINING, _REMOVED}),
}
_LEGAL_TRAINING: dict[Status, frozenset[Status | str]] = {
    Status.ACTIVE: frozenset({Status.INACTIVE}),
    Status.INACTIVE: frozenset({Status.ACTIVE, _REMOVED}),
}


@dataclass(frozen=True, slots=True)
class ElasticSource:
    """Where a slot's GPUs came from: a Slurm (heterogeneous) job and its component."""

    job_id: str
    het_component: int = 0

    @property
    def tag(self) -> str:
        """``JOB+N``, the form squeue prints and ``scancel`` takes."""
        return f"{self.job_id}+{self.het_component}"


@dataclass(slots=True)
class WorkerSlot:
    slot_id: int
    gpu_ids: tuple[str, ...]  # fixed for the worker's life
    zone: Zone
    role: Role  # current role (for REROLE: the role being left)
    status: Status
    source: ElasticSource | None = None  # None: reserved (base job) capacity
    pending_role: Role | None = None  # REROLE only: the role being entered
    since_s: float = 0.0  # time of the last status change

    @property
    def effective_role(self) -> Role:
        """The role this slot counts as in the target configuration."""
        return self.pending_role if self.pending_role is not None else self.role

    @property
    def is_rollout(self) -> bool:
        return self.role.is_rollout

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot_id": self.slot_id,
            "gpu_ids": list(self.gpu_ids),
            "zone": self.zone.value,
            "role": self.role.value,
            "status": self.status.value,
            "source": None
            if self.source is None
            else {"job_id": self.source.job_id, "het_component": self.source.het_component},
            "pending_role": None if self.pending_role is None else self.pending_role.value,
            "since_s": self.since_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerSlot:
        source = data.get("source")
        pending = data.get("pending_role")
        return cls(
            slot_id=int(data["slot_id"]),
            gpu_ids=tuple(str(g) for g in data["gpu_ids"]),
            zone=Zone(data["zone"]),
            role=Role(data["role"]),
            status=Status(data["status"]),
            source=None
            if source is None
            else ElasticSource(str(source["job_id"]), int(source["het_component"])),
            pending_role=None if pending is None else Role(pending),
            since_s=float(data.get("since_s", 0.0)),
        )


class RoleTable:
    """The single source of truth for which worker runs where and in which role."""

    def __init__(self) -> None:
        self._slots: dict[int, WorkerSlot] = {}
        self._rollout_gpu_owner: dict[str, int] = {}
        self._training_gpu_owner: dict[str, int] = {}
        self._free_ids: list[int] = []  # min-heap of released slot ids
        self._next_id = 0
        self.version = 0  # bumped on every mutation; names communicator epochs

    def load(self, other: RoleTable) -> None:
        """Take ``other``'s contents (a restored snapshot): whoever holds this table (the
        controller, its executor) sees them."""
        self.__dict__.update(other.__dict__)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(sorted(self._slots.values(), key=lambda s: s.slot_id))

    def __contains__(self, slot_id: object) -> bool:
        return slot_id in self._slots

    def get(self, slot_id: int) -> WorkerSlot:
        try:
            return self._slots[slot_id]
        except KeyError:
            raise TransitionError(f"slot {slot_id} does not exist in the role table") from None

    def rollout_slots(self, statuses: Iterable[Status] | None = None) -> list[WorkerSlot]:
        wanted = None if statuses is None else frozenset(statuses)
        return [s for s in self if s.is_rollout and (wanted is None or s.status in wanted)]

    def in_service(self) -> list[WorkerSlot]:
        """The current rollout set W: joining, active or changing role."""
        return self.rollout_slots(IN_SERVICE)

    def training_slots(self) -> list[WorkerSlot]:
        return [s for s in self if s.role is Role.TRAINING]

    def overlap_workers(self) -> list[WorkerSlot]:
        return [s for s in self if s.is_rollout and s.zone is Zone.OVERLAP]

    def training_gpu_ids(self) -> set[str]:
        return set(self._training_gpu_owner)

    def training_active(self) -> bool:
        return any(s.status is Status.ACTIVE for s in self.training_slots())

    def role_counts(self) -> dict[Role, int]:
        """Counts of the in-service rollout set by effective (target) role."""
        counts = dict.fromkeys(ROLLOUT_ROLES, 0)
        for slot in self._slots.values():
            if slot.is_rollout and slot.status in IN_SERVICE:
                counts[slot.effective_role] += 1
        return counts

    def serving_config(self) -> PDConfig:
        """The configuration in service now, workers still joining included: ``1P2D``
        when both disaggregated roles serve, else ``nC`` (n >= 1). A step's record names
        its rollout by it (the real run's and the simulator's)."""
        roles = [s.role for s in self.rollout_slots() if s.status in IN_SERVICE]
        n_p, n_d, n_c = (roles.count(r) for r in (Role.PREFILL, Role.DECODE, Role.COLOCATED))
        if n_p and n_d:
            return PDConfig.disaggregated(n_p, n_d)
        return PDConfig.colocated(max(1, n_c + n_p + n_d))

    def current_config(self) -> PDConfig | None:
        """The in-service set as a PD configuration, or None when it is empty or not a
        valid configuration (e.g. prefill workers left without any decode worker)."""
        counts = self.role_counts()
        if sum(counts.values()) == 0:
            return None
        p, d, c = counts[Role.PREFILL], counts[Role.DECODE], counts[Role.COLOCATED]
        if c and (p or d):
            return None
        if (p == 0) != (d == 0):
            return None
        return PDConfig(p, d, c)

    def next_slot_ids(self, count: int) -> list[int]:
        """The ids the next ``count`` new slots will get (lowest free first)."""
        ids = heapq.nsmallest(count, self._free_ids)
        nxt = self._next_id
        while len(ids) < count:
            ids.append(nxt)
            nxt += 1
        return ids

    # ---------------------------------------------------------------- mutations
    def add_worker(
        self,
        gpu_ids: Iterable[str],
        *,
        zone: Zone,
        role: Role,
        status: Status = Status.JOINING,
        source: ElasticSource | None = None,
        now_s: float = 0.0,
        slot_id: int | None = None,
    ) -> WorkerSlot:
        """Create a slot. Rollout workers start JOINING (or ACTIVE when bootstrapping or
        restoring, INACTIVE for an overlap worker registered idle); training slots start
        INACTIVE or ACTIVE. ``slot_id`` defaults to the lowest free id."""
        gpus = tuple(str(g) for g in gpu_ids)
        if not gpus:
            raise InvariantError("a worker needs at least one GPU")
        if len(set(gpus)) != len(gpus):
            raise InvariantError(f"GPU set {gpus} names a GPU twice")
        if role is Role.TRAINING:
            if zone is not Zone.OVERLAP:
                raise InvariantError("training slots live in the overlap zone")
            if status not in (Status.INACTIVE, Status.ACTIVE):
                raise TransitionError("a training slot starts INACTIVE or ACTIVE")
        elif status not in (Status.JOINING, Status.ACTIVE, Status.INACTIVE):
            raise TransitionError(
                f"a new rollout worker starts JOINING, ACTIVE or INACTIVE, not {status.value}"
            )
        elif status is Status.INACTIVE and zone is not Zone.OVERLAP:
            raise TransitionError("only overlap workers may be registered INACTIVE")
        slot_id = self._claim_slot_id(slot_id)
        slot = WorkerSlot(slot_id, gpus, zone, role, status, source, None, now_s)
        try:
            self._check_placement(slot)
        except InvariantError:
            self._release_slot_id(slot_id)
            raise
        self._slots[slot_id] = slot
        owners = self._training_gpu_owner if role is Role.TRAINING else self._rollout_gpu_owner
        for gpu in gpus:
            owners[gpu] = slot_id
        self.version += 1
        return slot

    def transition(
        self, slot_id: int, status: Status, *, role: Role | None = None, now_s: float = 0.0
    ) -> WorkerSlot:
        """Move a slot to ``status``. ``role`` is required for REROLE (the new role) and
        allowed for INACTIVE -> JOINING (an overlap worker activating in a role)."""
        slot = self.get(slot_id)
        self._check_legal(slot, status)
        if status is Status.REROLE:
            if role is None or not role.is_rollout or role is slot.role:
                raise TransitionError(
                    f"slot {slot_id}: REROLE needs a new rollout role different from "
                    f"{slot.role.value}"
                )
        elif role is not None and not (
            slot.status is Status.INACTIVE and status is Status.JOINING and role.is_rollout
        ):
            raise TransitionError(
                f"slot {slot_id}: a role can only be given with REROLE or on activation"
            )
        if slot.role is Role.TRAINING and status is Status.ACTIVE:
            busy = self._busy_overlap_workers(slot.gpu_ids)
            if busy:
                raise InvariantError(
                    f"training slot {slot_id} cannot start: overlap workers {busy} still "
                    "hold its GPUs (return them first)"
                )
        if slot.is_rollout and slot.zone is Zone.OVERLAP and status is Status.JOINING:
            trainers = self._active_trainers(slot.gpu_ids)
            if trainers:
                raise InvariantError(
                    f"overlap worker {slot_id} cannot activate while training slots "
                    f"{trainers} are active on its GPUs"
                )
        if status is Status.REROLE:
            slot.pending_role = role
        elif slot.status is Status.REROLE and status is Status.ACTIVE:
            assert slot.pending_role is not None
            slot.role, slot.pending_role = slot.pending_role, None
        else:
            slot.pending_role = None
            if role is not None:
                slot.role = role
        slot.status = status
        slot.since_s = now_s
        self.version += 1
        return slot

    def retarget(self, slot_id: int, role: Role) -> WorkerSlot:
        """Aim a slot that is not serving yet (JOINING or REROLE) at another role."""
        slot = self.get(slot_id)
        if not role.is_rollout or not slot.is_rollout:
            raise TransitionError(f"slot {slot_id}: only rollout workers take rollout roles")
        if slot.status is Status.JOINING:
            slot.role = role
        elif slot.status is Status.REROLE:
            slot.pending_role = role
        else:
            raise TransitionError(
                f"slot {slot_id} is {slot.status.value}: only JOINING or REROLE slots can be "
                "retargeted (use REROLE for an active worker)"
            )
        self.version += 1
        return slot

    def remove(self, slot_id: int) -> WorkerSlot:
        """Remove a slot through the lifecycle (JOINING, dedicated LEAVING, INACTIVE)."""
        slot = self.get(slot_id)
        self._check_legal(slot, _REMOVED)
        return self._drop(slot)

    def fail(self, slot_id: int) -> WorkerSlot:
        """Remove a slot whose process died, whatever its status."""
        return self._drop(self.get(slot_id))

    # -------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Check every invariant over the whole table (O(slots x GPUs))."""
        rollout_owner: dict[str, int] = {}
        training_owner: dict[str, int] = {}
        for slot in self:
            owners = training_owner if slot.role is Role.TRAINING else rollout_owner
            for gpu in slot.gpu_ids:
                if gpu in owners:
                    raise InvariantError(
                        f"GPU {gpu} is bound to slots {owners[gpu]} and {slot.slot_id}"
                    )
                owners[gpu] = slot.slot_id
        if rollout_owner != self._rollout_gpu_owner or training_owner != self._training_gpu_owner:
            raise InvariantError("GPU ownership index is out of sync with the slots")
        for slot in self:
            if slot.role is Role.TRAINING:
                if slot.zone is not Zone.OVERLAP:
                    raise InvariantError(f"training slot {slot.slot_id} is not in the overlap zone")
                if slot.status is Status.ACTIVE and self._busy_overlap_workers(slot.gpu_ids):
                    raise InvariantError(
                        f"GPUs of training slot {slot.slot_id} are active for training and "
                        "rollout at once"
                    )
            else:
                on_training = [g for g in slot.gpu_ids if g in training_owner]
                if slot.zone is Zone.OVERLAP and len(on_training) != len(slot.gpu_ids):
                    raise InvariantError(
                        f"overlap worker {slot.slot_id} has GPUs outside the training GPUs"
                    )
                if slot.zone is Zone.DEDICATED and on_training:
                    raise InvariantError(
                        f"dedicated worker {slot.slot_id} sits on training GPUs {on_training}"
                    )
                if (slot.status is Status.REROLE) != (slot.pending_role is not None):
                    raise InvariantError(f"slot {slot.slot_id}: pending role without REROLE")
        if any(i in self._slots for i in self._free_ids):
            raise InvariantError("a free slot id is also in use")
        # a duplicate or out-of-range free id would later hand out a slot id twice
        if len(set(self._free_ids)) != len(self._free_ids) or any(
            not 0 <= i < self._next_id for i in self._free_ids
        ):
            raise InvariantError("free slot ids must be distinct and below the next slot id")

    # ---------------------------------------------------------------- journal
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "table_version": self.version,
            "next_slot_id": self._next_id,
            "free_slot_ids": sorted(self._free_ids),
            "slots": [s.to_dict() for s in self],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoleTable:
        if data.get("version") != SNAPSHOT_VERSION:
            raise InvariantError(
                f"role-table snapshot version {data.get('version')!r} is not "
                f"{SNAPSHOT_VERSION}: it was written by another pearl_hpc release"
            )
        table = cls()
        for raw in data["slots"]:
            slot = WorkerSlot.from_dict(raw)
            if slot.slot_id in table._slots:
                raise InvariantError(f"snapshot names slot {slot.slot_id} twice")
            table._slots[slot.slot_id] = slot
            owners = (
                table._training_gpu_owner
                if slot.role is Role.TRAINING
                else table._rollout_gpu_owner
            )
            for gpu in slot.gpu_ids:
                if gpu in owners:
                    raise InvariantError(f"snapshot binds GPU {gpu} twice")
                owners[gpu] = slot.slot_id
        table._next_id = int(data["next_slot_id"])
        table._free_ids = [int(i) for i in data["free_slot_ids"]]
        heapq.heapify(table._free_ids)
        table.version = int(data["table_version"])
        if any(i >= table._next_id for i in table._slots):
            raise InvariantError("snapshot slot id beyond next_slot_id")
        table.check_invariants()
        return table

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RoleTable:
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------- helpers
    def _claim_slot_id(self, slot_id: int | None) -> int:
        if slot_id is None:
            if self._free_ids:
                return heapq.heappop(self._free_ids)
            self._next_id += 1
            return self._next_id - 1
        if slot_id in self._slots:
            raise InvariantError(f"slot {slot_id} is already in use")
        if slot_id >= self._next_id:
            # ids between the old and new high-water mark become free, never lost
            for skipped in range(self._next_id, slot_id):
                heapq.heappush(self._free_ids, skipped)
            self._next_id = slot_id + 1
        else:
            try:
                self._free_ids.remove(slot_id)
            except ValueError:
                raise InvariantError(f"slot {slot_id} is not free") from None
            heapq.heapify(self._free_ids)
        return slot_id

    def _release_slot_id(self, slot_id: int) -> None:
        heapq.heappush(self._free_ids, slot_id)

    def _check_placement(self, slot: WorkerSlot) -> None:
        if slot.role is Role.TRAINING:
            for gpu in slot.gpu_ids:
                if gpu in self._training_gpu_owner:
                    raise InvariantError(
                        f"GPU {gpu} already belongs to training slot "
                        f"{self._training_gpu_owner[gpu]}"
                    )
                owner = self._rollout_gpu_owner.get(gpu)
                if owner is not None and self._slots[owner].zone is Zone.DEDICATED:
                    raise InvariantError(
                        f"GPU {gpu} is a dedicated rollout GPU of slot {owner}, not a training GPU"
                    )
            return
        for gpu in slot.gpu_ids:
            if gpu in self._rollout_gpu_owner:
                raise InvariantError(
                    f"GPU {gpu} is already bound to rollout worker {self._rollout_gpu_owner[gpu]}"
                )
        on_training = [g for g in slot.gpu_ids if g in self._training_gpu_owner]
        if slot.zone is Zone.OVERLAP:
            if len(on_training) != len(slot.gpu_ids):
                raise InvariantError("an overlap worker must sit on training GPUs only")
            if slot.status is not Status.INACTIVE and self._active_trainers(slot.gpu_ids):
                raise InvariantError("an overlap worker cannot start while training is active")
        elif on_training:
            raise InvariantError(f"dedicated worker on training GPUs {on_training}")

    def _check_legal(self, slot: WorkerSlot, target: Status | str) -> None:
        legal = _LEGAL_TRAINING if slot.role is Role.TRAINING else _LEGAL_ROLLOUT
        allowed = legal.get(slot.status, frozenset())
        ok = target in allowed
        if ok and slot.is_rollout:
            overlap = slot.zone is Zone.OVERLAP
            # overlap workers go back to INACTIVE; dedicated ones are removed
            if slot.status is Status.LEAVING:
                ok = (target is Status.INACTIVE) == overlap
            elif slot.status is Status.INACTIVE:
                ok = overlap
        if not ok:
            target_name = target if isinstance(target, str) else target.value
            raise TransitionError(
                f"slot {slot.slot_id} ({slot.zone.value} {slot.role.value}): illegal move "
                f"{slot.status.value} -> {target_name}"
            )

    def _busy_overlap_workers(self, gpu_ids: Iterable[str]) -> list[int]:
        busy = set()
        for gpu in gpu_ids:
            owner = self._rollout_gpu_owner.get(gpu)
            if owner is not None and self._slots[owner].status is not Status.INACTIVE:
                busy.add(owner)
        return sorted(busy)

    def _active_trainers(self, gpu_ids: Iterable[str]) -> list[int]:
        active = set()
        for gpu in gpu_ids:
            owner = self._training_gpu_owner.get(gpu)
            if owner is not None and self._slots[owner].status is Status.ACTIVE:
                active.add(owner)
        return sorted(active)

    def _drop(self, slot: WorkerSlot) -> WorkerSlot:
        if slot.role is Role.TRAINING:
            overlap = [o for o in self._busy_or_idle_overlap(slot.gpu_ids)]
            if overlap:
                raise InvariantError(
                    f"training slot {slot.slot_id} still hosts overlap workers {overlap}"
                )
        owners = self._training_gpu_owner if slot.role is Role.TRAINING else self._rollout_gpu_owner
        for gpu in slot.gpu_ids:
            owners.pop(gpu, None)
        del self._slots[slot.slot_id]
        self._release_slot_id(slot.slot_id)
        self.version += 1
        return slot

    def _busy_or_idle_overlap(self, gpu_ids: Iterable[str]) -> list[int]:
        return sorted({self._rollout_gpu_owner[g] for g in gpu_ids if g in self._rollout_gpu_owner})
