"""Seeded workload model of SWE-bench-like agentic rollout.

A trajectory is a list of turns ``(new_tokens, gen_tokens, kept_tokens, env_s)``: turn
0's new tokens are the task prompt, later ones the observations the environment
returned; a response has ``gen_tokens`` (reasoning + answer), of which only
``kept_tokens`` (the answer / tool call) stay in the context of later turns — Qwen3's
chat template drops earlier turns' reasoning. Turn counts,
observation sizes and environment times are heavy-tailed (log-normal, clipped); the
context grows turn by turn and the trajectory ends when it would pass
``max_trajectory_tokens`` (the last response is cut to fit) or after its turns.
The 16 trajectories of a group share a task: the same prompt and a shared difficulty
factor on their turn count. All randomness comes from one ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pearl_hpc.config.workload import WorkloadConfig


@dataclass(frozen=True, slots=True)
class Turn:
    new_tokens: int
    gen_tokens: int
    kept_tokens: int  # part of the response that stays in context (<= gen_tokens)
    env_s: float  # after this turn's response (0 after the last turn)


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    trajectory_id: str
    group_id: int
    turns: tuple[Turn, ...]

    @property
    def total_tokens(self) -> int:
        """Tokens of the trajectory as trained: every prompt/observation and response."""
        return sum(t.new_tokens + t.gen_tokens for t in self.turns)

    @property
    def final_context_tokens(self) -> int:
        return sum(t.new_tokens + t.kept_tokens for t in self.turns)

    @property
    def generated_tokens(self) -> int:
        return sum(t.gen_tokens for t in self.turns)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0)) if sigma > 0 else median


class WorkloadGenerator:
    def __init__(self, config: WorkloadConfig, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self._next_group = 0

    def batch(self, step: int) -> list[TrajectorySpec]:
        """The ``batch_size`` trajectories of one rollout step (whole groups; the last
        group is cut when batch_size is not a multiple of group_size)."""
        out: list[TrajectorySpec] = []
        cfg = self.config
        while len(out) < cfg.batch_size:
            group = self._next_group
            self._next_group += 1
            prompt = max(
                16, round(_lognormal(self.rng, cfg.prompt_tokens_median, cfg.prompt_tokens_sigma))
            )
            difficulty = _lognormal(self.rng, 1.0, cfg.task_difficulty_sigma)
            for member in range(min(cfg.group_size, cfg.batch_size - len(out))):
                out.append(self._trajectory(f"s{step}g{group}m{member}", group, prompt, difficulty))
        return out

    def _draw(self, median: float, sigma: float, cap: float) -> int:
        return int(min(cap, max(1, round(_lognormal(self.rng, median, sigma)))))

    def _trajectory(self, tid: str, group: int, prompt: int, difficulty: float) -> TrajectorySpec:
        cfg = self.config
        num_turns = self._draw(cfg.turns_median * difficulty, cfg.turns_sigma, cfg.max_turns)
        turns: list[Turn] = []
        context = 0
        for i in range(num_turns):
            new = (
                prompt
                if i == 0
                else self._draw(cfg.obs_tokens_median, cfg.obs_tokens_sigma, cfg.obs_tokens_max)
            )
            gen = self._draw(cfg.gen_tokens_median, cfg.gen_tokens_sigma, cfg.gen_tokens_max)
            kept = self._draw(cfg.kept_tokens_median, cfg.kept_tokens_sigma, gen)
            env = min(cfg.env_s_max, _lognormal(self.rng, cfg.env_s_median, cfg.env_s_sigma))
            room = cfg.max_trajectory_tokens - context
            if new >= room:  # the observation alone passes the cap: the trajectory ends
                break
            gen = min(gen, room - new)  # the engine's max_model_len cuts the response
            kept = min(kept, gen)
            context += new + kept
            last = i == num_turns - 1 or new + gen >= room
            turns.append(Turn(new, gen, kept, 0.0 if last else env))
            if last:
                break
        if not turns:  # a prompt longer than the cap still yields one truncated turn
            turns.append(Turn(cfg.max_trajectory_tokens - 1, 1, 1, 0.0))
        elif turns[-1].env_s:
            t = turns[-1]
            turns[-1] = Turn(t.new_tokens, t.gen_tokens, t.kept_tokens, 0.0)
        return TrajectorySpec(tid, group, tuple(turns))
