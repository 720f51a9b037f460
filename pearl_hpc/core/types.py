"""Small shared vocabulary: roles, statuses, zones, modes and the PD configuration."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from pearl_hpc.errors import SpecError


class Role(StrEnum):
    """What a worker slot does. Rollout roles are prefill, decode and colocated."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    TRAINING = "training"

    @property
    def is_rollout(self) -> bool:
        return self is not Role.TRAINING

    @property
    def letter(self) -> str:
        return {"prefill": "P", "decode": "D", "colocated": "C", "training": "T"}[self.value]


ROLLOUT_ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE, Role.COLOCATED)


class Status(StrEnum):
    """Lifecycle of a worker slot (see :class:`pearl_hpc.core.table.RoleTable`)."""

    JOINING = "joining"  # starting or activating; serves nothing until admitted
    ACTIVE = "active"  # serves requests (rollout) or runs a training step (training)
    REROLE = "rerole"  # draining to change role; becomes ACTIVE in its new role
    LEAVING = "leaving"  # draining before release; partial trajectories are kept
    INACTIVE = "inactive"  # process alive, device state released (overlap workers, idle training)

    @property
    def is_transitioning(self) -> bool:
        return self in (Status.JOINING, Status.REROLE, Status.LEAVING)


class Zone(StrEnum):
    """Dedicated rollout GPUs (reserved + elastic) or training GPUs time-shared by an
    overlap rollout worker."""

    DEDICATED = "dedicated"
    OVERLAP = "overlap"


class TrainingState(StrEnum):
    """Where the training side is in a step (the controller's; journalled).

        IDLE ──TrainingBegin──> WAITING ──borrowed GPUs all returned──> RUNNING
          ^                                                               │
          └──────────────────────────TrainingFinished─────────────────────┘

    Borrowing is allowed only while IDLE; WAITING holds the step until every overlap
    worker is INACTIVE (the mandatory return)."""

    IDLE = "idle"
    WAITING = "waiting"  # for the borrowed GPUs to come back
    RUNNING = "running"


class Mode(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


_SPEC_RE = re.compile(r"^\s*(?:(\d+)\s*([PpDdCc]))+\s*$")
_SPEC_PART_RE = re.compile(r"(\d+)\s*([PpDdCc])")


@dataclass(frozen=True, slots=True)
class PDConfig:
    """A rollout configuration ``pi = (N_P, N_D, N_C)``: fully colocated
    (``N_P = N_D = 0``) or fully disaggregated (``N_C = 0``, ``N_P, N_D >= 1``)."""

    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise SpecError(f"worker counts must be >= 0, got {self.spec()}")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise SpecError(
                f"{self.spec()} mixes colocated and disaggregated workers; use either NC or NpPNdD"
            )
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise SpecError(
                f"{self.spec()} is disaggregated without both roles; "
                "it needs at least 1 prefill and 1 decode worker"
            )

    @classmethod
    def colocated(cls, num_workers: int) -> PDConfig:
        return cls(num_colocated=num_workers)

    @classmethod
    def disaggregated(cls, num_prefill: int, num_decode: int) -> PDConfig:
        return cls(num_prefill=num_prefill, num_decode=num_decode)

    @property
    def total(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def mode(self) -> Mode:
        return Mode.DISAGGREGATED if self.num_prefill else Mode.COLOCATED

    def count(self, role: Role) -> int:
        return {
            Role.PREFILL: self.num_prefill,
            Role.DECODE: self.num_decode,
            Role.COLOCATED: self.num_colocated,
        }.get(role, 0)

    def roles(self) -> list[Role]:
        """One role per worker: prefill first, then decode, then colocated."""
        return (
            [Role.PREFILL] * self.num_prefill
            + [Role.DECODE] * self.num_decode
            + [Role.COLOCATED] * self.num_colocated
        )

    def spec(self) -> str:
        if self.num_prefill or self.num_decode:
            return f"{self.num_prefill}P{self.num_decode}D"
        return f"{self.num_colocated}C"

    def __str__(self) -> str:
        return self.spec()


def parse_spec(text: str) -> PDConfig:
    """Parse ``8C`` / ``3P5D`` (case-insensitive, each letter at most once)."""
    if not _SPEC_RE.match(text or ""):
        raise SpecError(f"cannot parse SPEC {text!r}: write NC (e.g. 8C) or NpPNdD (e.g. 3P5D)")
    counts = {"P": 0, "D": 0, "C": 0}
    seen: set[str] = set()
    for number, letter in _SPEC_PART_RE.findall(text):
        letter = letter.upper()
        if letter in seen:
            raise SpecError(f"SPEC {text!r} names {letter} twice: write e.g. 3P5D")
        seen.add(letter)
        counts[letter] = int(number)
    config = PDConfig(counts["P"], counts["D"], counts["C"])
    if config.total == 0:
        raise SpecError(f"SPEC {text!r} has no workers: at least one is needed")
    return config
