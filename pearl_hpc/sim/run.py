"""Run simulated systems side by side and collect the results (``pearl-hpc simulate``)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pearl_hpc.config import REPO_CONFIGS, load_profile
from pearl_hpc.config.traces import AvailabilityTrace, load_segment, load_trace
from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.routing import RoutingPolicy
from pearl_hpc.sim.breakdown import worker_seconds
from pearl_hpc.sim.costmodel import CHUNK_TOKENS, CostModel, SimConfigError
from pearl_hpc.sim.engine import Simulator
from pearl_hpc.sim.fluid import fluid_bound
from pearl_hpc.sim.systems import RESERVED_ROLLOUT_GPUS, ROUTERS, make_setup
from pearl_hpc.sim.workload import WorkloadConfig

DEFAULT_WORKLOAD = REPO_CONFIGS / "workloads" / "swe-bench.yaml"
OVERHEAD_S_PER_TURN = 0.3  # T_over seed, as in the shipped profiles
DEFAULT_SYSTEMS = ("roll", "roll-large", "rlboost+", "pearl")


def initial_profile(cost: CostModel, workload: WorkloadConfig) -> WorkloadProfile:
    """The controller's starting belief, derived from the cost model and the workload
    config's medians; the runtime tracker refits it from telemetry every step."""
    ctx = workload.max_trajectory_tokens / 2
    n = 8
    a_s = cost.decode_iteration_s(1, ctx)
    b_s = (cost.decode_iteration_s(n + 1, (n + 1) * ctx) - a_s) / n
    t_prefill = cost.prefill_iteration_s(CHUNK_TOKENS, ctx) / CHUNK_TOKENS
    turns = min(workload.max_turns, workload.turns_median * 2)
    kv = cost.kv_bytes_per_token
    return WorkloadProfile(
        batch_size=workload.batch_size,
        turns=turns,
        new_tokens_per_turn=workload.obs_tokens_median,
        gen_tokens_per_turn=workload.gen_tokens_median,
        prefill_s_per_token=t_prefill,
        decode_fixed_s=a_s,
        decode_per_seq_s=max(b_s, 0.0),
        overhead_s_per_turn=OVERHEAD_S_PER_TURN,
        env_s=turns * workload.env_s_median,
        decode_bubble_ratio=1.0,
        kv_bytes_per_token=kv,
        transfer_bytes_per_s=cost.kv_transfer_rate,
        kv_bytes_per_trajectory=workload.max_trajectory_tokens * kv,
        kv_capacity_bytes_per_worker=cost.kv_capacity_tokens * kv,
    )


@dataclasses.dataclass
class SimRequest:
    model: str = "qwen3-8b"
    gpu: str = "h800"
    tp: int = 2
    systems: Sequence[str] | None = None  # None: DEFAULT_SYSTEMS (just pearl with a sweep)
    segment: int | None = 2
    trace_path: str | None = None
    trace_scale: float = 1.0  # GPUs per instance of the trace (a pool scaled to a cluster)
    start_s: float = 0.0
    duration_s: float | None = None
    rollout_gpus: int | None = None  # fixed resources (no elastic trace)
    training_gpus: int = 16
    batch_size: int | None = None
    max_trajectory_tokens: int | None = None
    max_staleness: int | None = None  # None: the workload's
    seed: int = 0
    workload_path: str | Path = DEFAULT_WORKLOAD
    sweep_static: bool = False
    router: str = "own"  # own (each system's router) | sticky | shortest-queue
    kv_bandwidth_from: str | Path | None = None  # a calibrated profile: its transfer_bytes_per_s

    def resolve_trace(self) -> tuple[AvailabilityTrace | None, float]:
        """The elastic trace (None for fixed resources) and the simulated duration."""
        if self.trace_path is not None:
            full = load_trace(self.trace_path)
            duration = (
                self.duration_s if self.duration_s is not None else full.duration_s - self.start_s
            )
            trace = full.window(self.start_s, duration)
        elif self.segment is not None:
            trace = load_segment(self.segment)
            duration = self.duration_s if self.duration_s is not None else trace.duration_s
            if duration > trace.duration_s:
                raise SimConfigError(
                    f"--duration-s {duration:g} is longer than segment {self.segment} "
                    f"({trace.duration_s:g} s)"
                )
        else:
            trace = None
            duration = 7200.0 if self.duration_s is None else self.duration_s
        if self.rollout_gpus is not None:
            trace = None
        if trace is not None:
            trace = trace.scaled(self.trace_scale)
        if duration <= 0:
            raise SimConfigError(f"--duration-s must be > 0, got {duration:g}")
        return trace, duration


def system_names(req: SimRequest) -> list[str]:
    if req.systems is not None:
        names = list(req.systems)
    else:
        names = [] if req.sweep_static else list(DEFAULT_SYSTEMS)
    if req.sweep_static:
        if req.rollout_gpus is None:
            raise SimConfigError(
                "--sweep-static needs fixed resources: --rollout-gpus N --no-elastic"
            )
        workers = req.rollout_gpus // req.tp
        if "pd-only" not in names:  # the decision engine alone: adaptive PD, no borrowing
            names.append("pd-only")
        names += ["static-coloc"] + [f"static-{p}P{workers - p}D" for p in range(1, workers)]
    return names


def _summary(sim: Simulator) -> dict[str, Any]:
    """One system's part of the document: deterministic for a seed (no wall times)."""
    steps = [s for s in sim.steps if s.finished_s > 0]
    per_step = [
        {
            "step": s.step,
            "started_s": round(s.started_s, 3),
            "finished_s": round(s.finished_s, 3),
            "duration_s": round(s.duration_s, 3),
            "rollout_s": round(s.finished_s - s.rollout_started_s, 3),
            "throughput_tokens_per_s": round(s.throughput_tokens_per_s, 3),
            "rollout_tokens": s.generated_tokens,
            "trained_tokens": s.trained_tokens,
            "mode": s.mode,
            "num_prefill": s.num_prefill,
            "num_decode": s.num_decode,
            "num_colocated": s.num_colocated,
            "borrowed_workers": s.borrowed_workers,
            "dedicated_rollout_gpus": s.dedicated_gpus,
            "training_return_wait_s": round(s.training_return_s, 3),
            "idle_worker_s": round(s.idle_worker_s, 3),
        }
        for s in steps
    ]
    mean = statistics.fmean(s.throughput_tokens_per_s for s in steps) if steps else 0.0
    return {
        "throughput_tokens_per_s": round(mean, 3),
        # the same tokens over the time they took: PEARL's per-step mean breaks when
        # batches overlap (pearl+), two completing close together make a tiny window
        "aggregate_tokens_per_s": round(
            sum(s.generated_tokens + s.trained_tokens for s in steps)
            / max(1e-9, max((s.finished_s for s in steps), default=0.0)),
            3,
        ),
        "rollout_tokens": sum(s.generated_tokens for s in steps),
        "trained_tokens": sum(s.trained_tokens for s in steps),
        "steps": len(steps),
        "preempted_turns": sim.preempted_turns,
        "kv_waits": sim.kv_waits,  # admissions that waited for KV room on their worker
        # grants the expansion gate found not worth their preparation (given back)
        "expansions_rejected": sim.controller.expansions_rejected,
        "local_prefills": sim.local_prefills,
        # rollout workers serving nothing (the batch tail, environment waits)
        "idle_worker_share": round(
            sum(s.idle_worker_s for s in steps) / max(1e-9, sum(s.active_worker_s for s in steps)),
            4,
        ),
        "prefill_time_share": round(sim.prefill_busy_s / max(sim.busy_s, 1e-9), 4),
        "prefill_token_share": round(
            sim.prefilled_tokens
            / max(1, sim.prefilled_tokens + sum(s.generated_tokens for s in steps)),
            4,
        ),
        "interrupted_turns": sim.interrupted_turns,
        "reconfigurations": len(sim.controller.history),
        "trajectories_started": sim.trajs_started,
        "trajectories_finished": sim.trajs_finished,
        "events": sim.events,
        "per_step": per_step,
    }


def simulate(
    req: SimRequest,
    *,
    progress: Callable[[str, float, float], None] | None = None,
    keep: dict[str, Simulator] | None = None,
) -> dict[str, Any]:
    """Run every requested system on the same seed; returns the ``--json`` document.
    ``progress(system, simulated_s, total_s)`` is called as the runs advance; ``keep``
    receives the finished simulators (for reports)."""
    cost = CostModel.from_names(req.gpu, req.model, req.tp)
    if req.kv_bandwidth_from is not None:
        measured = load_profile(req.kv_bandwidth_from).transfer_bytes_per_s
        cost = dataclasses.replace(cost, kv_transfer_bytes_per_s=measured)
    workload = WorkloadConfig.load(req.workload_path)
    changes: dict[str, Any] = {}
    if req.batch_size is not None:
        changes["batch_size"] = req.batch_size
    if req.max_trajectory_tokens is not None:
        changes["max_trajectory_tokens"] = req.max_trajectory_tokens
    if req.max_staleness is not None:
        changes["staleness"] = req.max_staleness
    workload = dataclasses.replace(workload, **changes)
    if req.router not in ROUTERS:
        raise SimConfigError(f"--router {req.router!r}: choose {', '.join(ROUTERS)}")
    if workload.batch_size < 1 or workload.max_trajectory_tokens < 64:
        raise SimConfigError("--batch-size must be >= 1 and --max-trajectory-tokens >= 64")
    trace, duration = req.resolve_trace()
    profile = initial_profile(cost, workload)
    names = system_names(req)
    setups = {
        name: make_setup(
            name,
            base=PolicyConfig(),
            trace=trace,
            segment=req.segment if req.trace_path is None else None,
            rollout_gpus=req.rollout_gpus,
            training_gpus=req.training_gpus,
            tp=req.tp,
            routing=None if req.router == "own" else RoutingPolicy(req.router),
        )
        for name in names
    }  # every name is checked before anything runs
    # the same GPUs at perfect utilisation with free reconfiguration (sim/fluid.py)
    bound = fluid_bound(
        cost,
        workload,
        seed=req.seed,
        duration_s=duration,
        reserved_rollout_gpus=req.rollout_gpus or RESERVED_ROLLOUT_GPUS,
        training_gpus=req.training_gpus,
        trace=trace,
    )
    results: dict[str, Any] = {}
    for name, setup in setups.items():
        tick = None if progress is None else (lambda t, n=name: progress(n, t, duration))
        sim = Simulator(
            setup, cost, workload, profile, seed=req.seed, duration_s=duration, progress=tick
        ).run()
        results[name] = _summary(sim)
        results[name]["worker_seconds"] = worker_seconds(sim, bound, duration)
        if keep is not None:
            keep[name] = sim
        if progress is not None:
            progress(name, duration, duration)
    doc: dict[str, Any] = {
        "model": cost.model.name,
        "gpu": cost.gpu.name,
        "tp": req.tp,
        "segment": req.segment if req.trace_path is None and req.rollout_gpus is None else None,
        "trace": trace.name if trace is not None else None,
        "rollout_gpus": req.rollout_gpus,
        "training_gpus": req.training_gpus,
        "duration_s": duration,
        "seed": req.seed,
        "batch_size": workload.batch_size,
        "max_trajectory_tokens": workload.max_trajectory_tokens,
        "router": req.router,
        "kv_transfer_gb_per_s": round(cost.kv_transfer_rate / 1e9, 3),
        "systems": results,
    }
    doc["fluid_bound"] = bound.to_dict()
    for r in results.values():
        r["share_of_fluid_bound"] = round(r["aggregate_tokens_per_s"] / bound.tokens_per_s, 4)
    for base in ("roll", "rlboost+", "static-coloc"):
        if base in results and results[base]["throughput_tokens_per_s"] > 0:
            ref = results[base]["throughput_tokens_per_s"]
            doc[f"ratios_vs_{base}"] = {
                n: round(r["throughput_tokens_per_s"] / ref, 4) for n, r in results.items()
            }
    return doc
