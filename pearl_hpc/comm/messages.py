"""Messages of the MPI control plane: flat records, pickled by mpi4py.

The master sends a :class:`Command` to one member over that member's *link* (the base
job's world, or the merged communicator of the elastic job component it joined with);
members answer with a :class:`Report` on the same link. Collective commands (``admit``,
``shrink``, ``partition``) are sent to every member of the universe and then entered by
all of them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

TAG_COMMAND = 11
TAG_REPORT = 12


class Op(StrEnum):
    # point to point: one member
    ROLE = "role"  # become prefill / decode / colocated / training / idle (args: role)
    DRAIN = "drain"  # stop taking work, interrupt requests, keep partial output
    RELEASE = "release"  # free the device; stay in the plane, idle
    TRAIN = "train"  # run a training step (args: step, trajectories as dicts)
    PUBLISH = "publish"  # trainer: broadcast the latest weights (args: version, members)
    CATCH_UP = "catch_up"  # trainer: latest weights to one engine (args: name, host, port)
    LEAVE = "leave"  # leave the plane (Disconnect) and exit: the job is being given back
    SHUTDOWN = "shutdown"  # the run is over: leave and exit
    PREPARE = "prepare"  # answer now: the master enters a collective call once all have
    # collective: every member of the universe
    ADMIT = "admit"  # merge the joined group (args: group) into the universe
    SHRINK = "shrink"  # keep only the listed members (args: members), the rest are gone
    PARTITION = "partition"  # Comm.Split into role groups (args: epoch, colors)


COLLECTIVE = frozenset({Op.ADMIT, Op.SHRINK, Op.PARTITION})


class Kind(StrEnum):
    HELLO = "hello"  # first report after joining: who and where I am
    HEARTBEAT = "heartbeat"
    ACK = "ack"  # a command is done (args echo what it did, e.g. timings)
    SIGNAL = "signal"  # my job got a signal (preemption / time limit): drain me
    TELEMETRY = "telemetry"
    ERROR = "error"  # a command failed (args: message)


@dataclass(frozen=True)
class Command:
    op: Op
    seq: int  # the master's command counter; acks echo it
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    kind: Kind
    member_id: str  # "base:3" (base job world rank 3) or "123+1:0" (job 123 component 1, rank 0)
    seq: int = -1  # the command acknowledged; -1 for unsolicited reports
    args: dict[str, Any] = field(default_factory=dict)


# the off-policy figures of a TRAIN ack (pearl_hpc/train/objective.py)
OFF_POLICY_FIGURES = (
    "clip_frac",
    "mismatch_mean",
    "mismatch_max",
    "capped_frac",
    "behaviour_coverage",
)
