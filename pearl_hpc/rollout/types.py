"""Records shared by the engines, the router, the agent loop and the trainer.

A trajectory is a list of token *segments*: prompt and environment tokens
(``generated=False``, masked out of the loss) and model tokens (``generated=True``).
Segments carry token ids, never text, so what the trainer scores is exactly what the
engines produced.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of tokens from one source."""

    token_ids: tuple[int, ...]
    generated: bool  # True: sampled by the policy (trained on); False: prompt/environment


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
            "segments": [[list(s.token_ids), s.generated] for s in self.segments],
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
            segments=[Segment(tuple(ids), bool(gen)) for ids, gen in data["segments"]],
            reward=data["reward"],
            done=bool(data["done"]),
            weight_versions={int(v) for v in data["weight_versions"]},
            turns=[TurnStats(**{**t, "worker_ids": tuple(t["worker_ids"])}) for t in data["turns"]],
            info=dict(data["info"]),
        )
