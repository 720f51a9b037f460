"""Held-out evaluation: each problem once, greedy, through the same agent loop as
training (``pearl-hpc eval``).

pass@1 is the share of problems whose trajectory earned the full reward (``code``: every
hidden test passed); the mean reward and the environment faults are reported beside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pearl_hpc.rollout.agent import ChatFormat, RolloutConfig, run_trajectory
from pearl_hpc.rollout.envs.base import Environment
from pearl_hpc.rollout.router import Router
from pearl_hpc.rollout.tasks import Task

FULL_REWARD = 1.0 - 1e-9


@dataclass(frozen=True)
class EvalItem:
    seed: int
    task: Task | None = None  # a run.tasks eval row (None: the environment's own split)
    name: str = ""  # how the report names it (default: the task's id, or seed-N)


@dataclass
class EvalResult:
    problems: int
    passed: int
    mean_reward: float
    env_failures: int
    per_problem: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pass_at_1(self) -> float:
        return self.passed / self.problems if self.problems else 0.0


async def evaluate(
    router: Router,
    chat: ChatFormat,
    make_env: Callable[[], Environment],
    items: Sequence[EvalItem],
    config: RolloutConfig,
    *,
    concurrency: int = 16,
    on_done: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Run every item's trajectory (``concurrency`` at a time); ``on_done(k, n)`` after
    each."""
    limit = asyncio.Semaphore(concurrency)
    finished = 0

    async def one(i: int, item: EvalItem) -> dict[str, Any]:
        nonlocal finished
        async with limit:
            traj = await run_trajectory(
                router,
                make_env(),
                chat,
                trajectory_id=f"eval-{i}",
                group_id=f"eval-{i}",
                env_seed=item.seed,
                sample_seed=item.seed,
                config=config,
                task=item.task,
            )
        finished += 1
        if on_done is not None:
            on_done(finished, len(items))
        return {
            "id": item.name or (item.task["id"] if item.task is not None else f"seed-{item.seed}"),
            "reward": traj.reward,
            "turns": len(traj.turns),
            "failed": traj.info.get("failed", ""),
        }

    rows = list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))
    rewards = [float(r["reward"] or 0.0) for r in rows]
    return EvalResult(
        problems=len(rows),
        passed=sum(r >= FULL_REWARD for r in rewards),
        mean_reward=sum(rewards) / len(rows) if rows else 0.0,
        env_failures=sum(bool(r["failed"]) for r in rows),
        per_problem=rows,
    )
