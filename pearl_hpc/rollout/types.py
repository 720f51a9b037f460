"""Records shared by the engines, the router, the agent loop and the trainer.

A trajectory is a list of token *segments*: prompt and environment tokens
(``generated=False``, masked out of the loss) and model tokens (``generated=True``).
Segments carry token ids, never text, so what the trainer scores is exactly what the
engines produced. A generated segment is one engine attempt: the log-probability the
engine sampled each token with (the *behaviour* policy, for the trainer's off-policy
correction) and the weight version it ran; a turn drained mid-generation and resumed
elsewhere is two or more generated segments in a row.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of tokens from one source."""

    token_ids: tuple[int, ...]
    generated: bool  # True: sampled by the policy (trained on); False: prompt/environment
    # generated: each token's log-probability under the engine's sampling distribution
    # (after temperature); () when the engine did not report them
    logprobs: tuple[float, ...] = ()
    weight_version: int | None = None  # generated: the weights that sampled it

    def to_list(self) -> list[Any]:
        if not self.generated or (not self.logprobs and self.weight_version is None):
            return [list(self.token_ids), self.generated]
        return [list(self.token_ids), True, list(self.logprobs), self.weight_version]

    @classmethod
    def from_list(cls, data: list[Any]) -> Segment:
        ids, generated, *rest = data
        logprobs, version = rest if rest else ((), None)
        return cls(tuple(ids), bool(generated), tuple(float(x) for x in logprobs), version)


@dataclass(slots=True)
class TurnStats:
    """What one finished turn cost, for the runtime tracker."""

    turn_index: int
    new_input_tokens: int  # prompt / observation tokens added before this turn
    generated_tokens: int  # tokens the model generated in this turn (all attempts)
    context_tokens: int  # tokens in context after the turn
    env_s: float  # environment time after the turn's response
    worker_ids: tuple[str, ...]  # workers that served the turn (> 1 after a resume / PD)
    interruptions: int = 0  # times the turn was drained and resumed elsewhere
    generate_s: float = 0.0  # from the turn's request to its response (queue, PD, resumes)


@dataclass(slots=True)
class Trajectory:
    """One multi-turn rollout: ``prompt -> response -> observation -> response ...``."""

    trajectory_id: str
    group_id: str  # GRPO group: trajectories of the same prompt share it
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None  # set when the environment says done
    done: bool = False
    weight_versions: set[int] = field(default_factory=set)  # versions that generated it
    turns: list[TurnStats] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def loss_mask(self) -> list[int]:
        """1 for policy tokens, 0 for prompt / environment tokens; same length as token_ids."""
        return [int(s.generated) for s in self.segments for _ in s.token_ids]

    def behaviour_logprobs(self) -> list[float]:
        """The engine's log-probability of every token (same length as token_ids); NaN
        for prompt / environment tokens and for tokens the engine gave none for."""
        out: list[float] = []
        for s in self.segments:
            if s.generated and len(s.logprobs) == len(s.token_ids):
                out.extend(s.logprobs)
            else:
                out.extend([math.nan] * len(s.token_ids))
        return out

    def num_generated(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.generated)

    @property
    def min_weight_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, for the run's trajectory journal."""
        return {
            "trajectory_id": self.trajectory_id,
            "group_id": self.group_id,
            "segments": [s.to_list() for s in self.segments],
            "reward": self.reward,
            "done": self.done,
            "weight_versions": sorted(self.weight_versions),
            "turns": [asdict(t) for t in self.turns],
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(
            trajectory_id=str(data["trajectory_id"]),
            group_id=str(data["group_id"]),
            segments=[Segment.from_list(s) for s in data["segments"]],
            reward=data["reward"],
            done=bool(data["done"]),
            weight_versions={int(v) for v in data["weight_versions"]},
            turns=[TurnStats(**{**t, "worker_ids": tuple(t["worker_ids"])}) for t in data["turns"]],
            info=dict(data["info"]),
        )


def fold_log(records: Iterable[dict[str, Any]]) -> dict[str, Trajectory]:
    """Each trajectory of a step's trajectory log (``trajectories/step-N.jsonl``) as its
    records fold, by id: a record carries what a turn added (``from_segment`` /
    ``from_turn``), or a whole trajectory (the log of an earlier release); a torn or
    malformed record, or one that does not continue what came before, is skipped."""
    out: dict[str, Trajectory] = {}
    for record in records:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            traj = _fold(out.get(str(record["trajectory_id"])), record)
            if traj is not None:
                out[traj.trajectory_id] = traj
    return out


def _fold(before: Trajectory | None, record: dict[str, Any]) -> Trajectory | None:
    """``before`` with ``record`` applied (None: the record does not continue it)."""
    if "from_segment" not in record:  # a whole trajectory
        return Trajectory.from_dict(record)
    segments, turns = int(record["from_segment"]), int(record["from_turn"])
    have = (0, 0) if before is None else (len(before.segments), len(before.turns))
    if have != (segments, turns):
        return None
    traj = Trajectory.from_dict(record)  # the new part, with the current small fields
    if before is not None:
        traj.segments = before.segments + traj.segments
        traj.turns = before.turns + traj.turns
    return traj
