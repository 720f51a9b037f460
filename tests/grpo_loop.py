"""Synchronous GRPO over real engines, for the tests: roll a batch out, train on it,
push the weights to the engines (the product's loop is the master's step pipeline)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from pearl_hpc.rollout.agent import ChatFormat, Env, RolloutConfig, rollout_batch
from pearl_hpc.rollout.router import Router
from pearl_hpc.train.grpo import GRPOTrainer, TrainStats
from pearl_hpc.train.sync import WeightSync


@dataclass(frozen=True)
class StepRecord:
    """One GRPO step as the curve and the benchmarks report it."""

    step: int
    mean_reward: float
    rollout_s: float
    train_s: float
    sync_s: float
    generated_tokens: int
    version: int  # trainer version after the step
    loss: float


async def grpo_steps(
    router: Router,
    chat: ChatFormat,
    make_env: Callable[[], Env],
    trainer: GRPOTrainer,
    rollout: RolloutConfig,
    *,
    steps: int,
    sync: WeightSync,
    on_step: Callable[[StepRecord], None] | None = None,
) -> list[StepRecord]:
    """``steps`` synchronous GRPO steps; the curve is returned (and reported per step)."""
    records = []
    for step in range(steps):
        t0 = time.perf_counter()
        trajectories = await rollout_batch(router, make_env, chat, rollout, step=step)
        t1 = time.perf_counter()
        stats: TrainStats = await asyncio.to_thread(trainer.train_step, trajectories)
        t2 = time.perf_counter()
        sync_s = await sync.publish(sync.stage(trainer.state_dict(), stats.version))
        record = StepRecord(
            step=step,
            mean_reward=stats.mean_reward,
            rollout_s=t1 - t0,
            train_s=t2 - t1,
            sync_s=sync_s,
            generated_tokens=sum(t.num_generated() for t in trajectories),
            version=stats.version,
            loss=stats.loss,
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records
