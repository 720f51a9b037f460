"""Where a simulated system's worker-seconds went, against the fluid bound's (where
``share_of_fluid_bound`` loses the rest).

The bound may use ``R`` rollout worker-seconds (reserved + every elastic GPU the trace
offers) and the training workers ``W`` for the whole window (``W x T``: training, or
lent to rollout). A simulated run spends the same ``R + W x T``, in these parts (each in
worker-seconds; they sum to it):

- ``fluid_work``: the finished batches' work at the bound's efficiency (their count
  times its rollout worker-seconds per batch);
- ``prefill_beyond_fluid``: iterations that carry a prefill chunk beyond the bound's
  prefill of those batches: prefixes prefilled again (cache misses, every weight
  update's empty cache, preemption), the decode steps riding in those iterations, their
  eager launch and overhead;
- ``decode_beyond_fluid``: decode-only iterations beyond the bound's decode: batches
  smaller than the KV holds, per-iteration overhead (both parts include the work of
  batches still running at the window's end);
- ``active_idle``: active workers with nothing to run: batch tails, environment waits,
  the staleness barrier before the next batch;
- ``held_not_serving``: workers held but not active: starting (preparation, activation),
  changing role, draining; dedicated capacity held with no worker on it;
- ``offered_not_held``: elastic GPUs the trace offered that the system declined or gave
  back (the expansion gate, reclaims);
- ``training``: the training steps on the training workers;
- ``training_idle``: training workers neither training nor lent (borrowing off, gated,
  or waiting for the next batch).

Computed after the run from its state timeline, budget and steps: nothing is added to
the event loop.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pearl_hpc.sim.engine import Simulator
from pearl_hpc.sim.fluid import FluidBound, step_integral

PARTS = (
    "fluid_work",
    "prefill_beyond_fluid",
    "decode_beyond_fluid",
    "active_idle",
    "held_not_serving",
    "offered_not_held",
    "training",
    "training_idle",
)


def state_seconds(sim: Simulator, end_s: float) -> dict[str, float]:
    """Worker-seconds in each timeline state (``active``, ``starting-borrowed``, ...)
    up to ``end_s``."""
    spent: dict[str, float] = defaultdict(float)
    since: dict[int, tuple[float, str]] = {}
    for t, slot, _role, state in sim.timeline:
        if slot in since:
            t0, old = since.pop(slot)
            spent[old] += min(t, end_s) - min(t0, end_s)
        if not state.startswith("off"):
            since[slot] = (t, state)
    for t0, state in since.values():
        spent[state] += max(0.0, end_s - t0)
    return spent


def held_gpu_seconds(sim: Simulator, end_s: float) -> float:
    """Dedicated GPU-seconds the system held (its budget) up to ``end_s``."""
    return step_integral(sim.budget, end_s)


def worker_seconds(sim: Simulator, bound: FluidBound, duration_s: float) -> dict[str, Any]:
    """The parts of the module's docstring for ``sim`` over ``[0, duration_s]``, in
    worker-seconds, with each one's share of ``R + W x T``."""
    tp = sim.cost.tp
    lent = sim.setup.training_gpus / tp
    capacity = bound.rollout_worker_s + lent * duration_s
    states = state_seconds(sim, duration_s)
    borrowed = sum(s for state, s in states.items() if state.endswith("-borrowed"))
    dedicated = held_gpu_seconds(sim, duration_s) / tp
    active = states["active"] + states["active-borrowed"]
    busy = active - sim.idle_worker_s
    finished = [s for s in sim.steps if 0 < s.finished_s <= duration_s]
    fluid = len(finished) * bound.rollout_worker_s_per_batch
    fluid_prefill = len(finished) * bound.prefill_worker_s_per_batch
    trained = [s for s in sim.steps if 0 < s.trained_s <= duration_s]
    training = lent * sum(
        sim.cost.training_step_s(s.trained_tokens, sim.setup.training_gpus) for s in trained
    )
    parts = {
        "fluid_work": fluid,
        "prefill_beyond_fluid": sim.prefill_busy_s - fluid_prefill,
        "decode_beyond_fluid": busy - sim.prefill_busy_s - (fluid - fluid_prefill),
        "active_idle": sim.idle_worker_s,
        "held_not_serving": dedicated - states["active"] + borrowed - states["active-borrowed"],
        "offered_not_held": bound.rollout_worker_s - dedicated,
        "training": training,
        "training_idle": lent * duration_s - training - borrowed,
    }
    return {
        "capacity_worker_s": round(capacity, 1),
        "worker_s": {k: round(v, 1) for k, v in parts.items()},
        "share": {k: round(v / capacity, 4) if capacity else 0.0 for k, v in parts.items()},
    }


def markdown(systems: dict[str, dict[str, Any]]) -> str:
    """The breakdown of every system as a table of shares of ``R + W x T``."""
    names = [n for n, r in systems.items() if "worker_seconds" in r]
    lines = [
        "| where the worker-seconds went | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for part in PARTS:
        cells = [f"{systems[n]['worker_seconds']['share'][part]:.1%}" for n in names]
        lines.append(f"| {part.replace('_', ' ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
