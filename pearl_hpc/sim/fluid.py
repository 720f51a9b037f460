"""The fluid bound: what the same GPUs could deliver at perfect utilisation with free
reconfiguration, to say how far a simulated system is from the best any could do.

A batch needs rollout worker-seconds ``w`` and a training step of ``t_train`` seconds:

- ``w``: every turn's uncached prompt prefilled at compute speed (the chunk's FLOPs, no
  iteration overhead) and every generated token decoded in a batch as large as the KV
  holds at the batch's mean decode context (the weights' read shared by the most
  sequences); no tail, no environment wait, no transfer, no preemption;
- ``t_train``: the training step of the simulator's cost model (weight sync included).

Over a window of ``T`` seconds with ``R`` rollout worker-seconds (reserved + elastic, as
the trace grants them) and ``W`` training workers that serve rollout whenever they do
not train (borrowing at no cost), ``B`` batches fit when
``B * w <= R + W * (T - B * t_train)`` and ``B * t_train <= T``, so

    B = min(T / t_train, (R + W * T) / (w + W * t_train))

and the bound is ``B x (generated + trained tokens per batch) / T`` -- the same tokens
``aggregate_tokens_per_s`` counts. The per-batch work is the mean per trajectory over
~1024 trajectories drawn from the workload generator with the run's seed, times the
batch size. Pure: no simulation runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from pearl_hpc.config.traces import AvailabilityTrace
from pearl_hpc.sim.costmodel import CostModel
from pearl_hpc.sim.workload import TrajectorySpec, WorkloadConfig, WorkloadGenerator

SAMPLE_TRAJECTORIES = 1024  # drawn for the per-trajectory work
SAMPLE_BATCH = 256  # trajectories per drawn batch


@dataclass(frozen=True)
class BatchWork:
    """One batch at perfect utilisation."""

    rollout_worker_s: float
    generated_tokens: int
    trained_tokens: int
    prefill_worker_s: float = 0.0  # of rollout_worker_s: the prompts' prefill


@dataclass(frozen=True)
class FluidBound:
    tokens_per_s: float
    batches: float  # batches the window holds at the bound
    rollout_worker_s_per_batch: float
    training_s_per_batch: float
    rollout_worker_s: float  # R: reserved + elastic worker-seconds of the window
    limited_by: str  # "training" (the serial steps) or "rollout" (the GPUs)
    prefill_worker_s_per_batch: float = 0.0  # of rollout_worker_s_per_batch

    def to_dict(self) -> dict[str, float | str]:
        return {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "batches": round(self.batches, 3),
            "rollout_worker_s_per_batch": round(self.rollout_worker_s_per_batch, 3),
            "training_s_per_batch": round(self.training_s_per_batch, 3),
            "rollout_worker_s": round(self.rollout_worker_s, 3),
            "limited_by": self.limited_by,
            "prefill_worker_s_per_batch": round(self.prefill_worker_s_per_batch, 3),
        }


def batch_work(cost: CostModel, batch: list[TrajectorySpec], prefix_reuse: bool) -> BatchWork:
    """Rollout worker-seconds of ``batch`` at perfect utilisation (see the module)."""
    prefill_s = 0.0
    decode_tokens = 0
    decode_context = 0.0  # token-weighted context while decoding
    for spec in batch:
        context = 0
        for turn in spec.turns:
            prompt = context + turn.new_tokens
            uncached = turn.new_tokens if prefix_reuse else prompt
            prefill_s += cost.prefill_chunk_s(uncached, prompt - uncached / 2)
            decode_tokens += turn.gen_tokens
            decode_context += turn.gen_tokens * (prompt + turn.gen_tokens / 2)
            context = prompt + turn.kept_tokens
    mean_context = decode_context / max(1, decode_tokens)
    seqs = max(1, int(cost.kv_capacity_tokens / max(1.0, mean_context)))
    per_token_s = cost.decode_iteration_s(seqs, seqs * mean_context) / seqs
    return BatchWork(
        prefill_s + decode_tokens * per_token_s,
        sum(s.generated_tokens for s in batch),
        sum(s.total_tokens for s in batch),
        prefill_s,
    )


def step_integral(points: Iterable[tuple[float, float]], end_s: float) -> float:
    """The integral over ``[0, end_s]`` of a right-continuous step function given as
    ``(time, value)`` points in time order (nothing before the first)."""
    total = 0.0
    for (t, value), (t_next, _) in itertools.pairwise([*points, (math.inf, 0.0)]):
        lo, hi = max(0.0, t), min(end_s, t_next)
        if hi > lo:
            total += value * (hi - lo)
    return total


def elastic_gpu_s(trace: AvailabilityTrace | None, duration_s: float) -> float:
    """GPU-seconds the trace grants over ``[0, duration_s]`` (nothing before its first
    point)."""
    if trace is None:
        return 0.0
    return step_integral(zip(trace.times_s, trace.counts, strict=True), duration_s)


def fluid_bound(
    cost: CostModel,
    workload: WorkloadConfig,
    *,
    seed: int,
    duration_s: float,
    reserved_rollout_gpus: int,
    training_gpus: int,
    trace: AvailabilityTrace | None,
    lend_training_gpus: bool = True,
) -> FluidBound:
    """The bound for a window of ``duration_s`` (see the module)."""
    drawn = dataclasses.replace(workload, batch_size=min(workload.batch_size, SAMPLE_BATCH))
    gen = WorkloadGenerator(drawn, seed)
    sample = [gen.batch(step) for step in range(-(-SAMPLE_TRAJECTORIES // drawn.batch_size))]
    per_traj = batch_work(cost, [t for b in sample for t in b], workload.prefix_reuse)
    scale = workload.batch_size / sum(len(b) for b in sample)
    w = per_traj.rollout_worker_s * scale
    tokens = (per_traj.generated_tokens + per_traj.trained_tokens) * scale
    t_train = cost.training_step_s(per_traj.trained_tokens * scale, training_gpus)
    rollout_s = (reserved_rollout_gpus * duration_s + elastic_gpu_s(trace, duration_s)) / cost.tp
    lent = training_gpus / cost.tp if lend_training_gpus else 0.0
    by_gpus = (rollout_s + lent * duration_s) / (w + lent * t_train)
    by_training = duration_s / t_train
    batches = min(by_gpus, by_training)
    return FluidBound(
        batches * tokens / duration_s,
        batches,
        w,
        t_train,
        rollout_s,
        "training" if by_training <= by_gpus else "rollout",
        per_traj.prefill_worker_s * scale,
    )
