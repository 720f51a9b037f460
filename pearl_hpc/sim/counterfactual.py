"""A finished run replayed through the simulator: how far the simulator is from what the
run measured (``pearl-hpc validate-sim``), and what other systems would have done with
the same inputs (the counterfactual of ``pearl-hpc report``).

The inputs are :mod:`pearl_hpc.sim.replay`'s. Every system runs the run's recorded
trajectories on its recorded capacity with the run's measured costs; only the policies
and which resources a system uses differ:

- ``pearl``: the run's own policies (the simulated twin of the measured run);
- ``no borrowing`` / ``no elastic`` / ``colocated only``: PEARL less one mechanism
  (idle training GPUs not borrowed; the elastic grants not taken; no disaggregation);
- ``static colocated`` and ``static XPYD``: the run's reserved rollout workers in one
  fixed configuration, nothing borrowed or granted (what the same base job gives
  without PEARL); the best of the splits is kept;
- ``rlboost+``: elastic colocation (every grant taken at once, shortest-queue routing,
  no borrowing; as in :mod:`pearl_hpc.sim.systems`).

What the replay leaves out is :data:`NOT_MODELLED` (the error figures carry it).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from pearl_hpc.core.controller import mode_changes
from pearl_hpc.core.policies import BorrowingName, ExpansionName, PDPolicyName
from pearl_hpc.core.routing import RoutingPolicy, RoutingRule
from pearl_hpc.sim.breakdown import held_gpu_seconds, state_seconds
from pearl_hpc.sim.engine import Simulator
from pearl_hpc.sim.entities import SimSetup
from pearl_hpc.sim.replay import RunRecord
from pearl_hpc.sim.workload import WorkloadConfig

PEARL = "pearl"


def setups(record: RunRecord) -> dict[str, SimSetup]:
    """The systems replayed on ``record``'s inputs, ``pearl`` first (one that would
    equal another for this run -- no elastic capacity, no overlap worker -- is left out)."""
    cfg = record.cfg
    policy = cfg.policy
    reserved = cfg.workers.reserved_rollout
    pearl = SimSetup(
        PEARL,
        policy,
        reserved_rollout_gpus=reserved,
        training_gpus=cfg.workers.training_gpus,
        elastic=record.capacity,
        overlap=cfg.workers.overlap > 0,
        grace_s=cfg.elastic.grace_s,
        after_startup=True,
        overlap_workers=cfg.workers.overlap,
    )
    colocated = dataclasses.replace(policy, pd_policy=PDPolicyName.COLOCATED)
    static = dataclasses.replace(
        pearl,
        policy=dataclasses.replace(colocated, borrowing=BorrowingName.NONE),
        elastic=None,
        overlap=False,
    )
    out = {PEARL: pearl}
    if pearl.overlap:
        out["no borrowing"] = dataclasses.replace(
            pearl, policy=dataclasses.replace(policy, borrowing=BorrowingName.NONE), overlap=False
        )
    if record.capacity is not None:
        out["no elastic"] = dataclasses.replace(pearl, elastic=None)
    if policy.pd_policy is not PDPolicyName.COLOCATED:
        out["colocated only"] = dataclasses.replace(pearl, policy=colocated)
    out["static colocated"] = static
    for p in range(1, reserved):
        split = dataclasses.replace(
            static.policy, pd_policy=PDPolicyName.FIXED_RATIO, prefill_fraction=p / reserved
        )
        out[f"static {p}P{reserved - p}D"] = dataclasses.replace(static, policy=split)
    if record.capacity is not None:
        out["rlboost+"] = dataclasses.replace(
            static,
            policy=dataclasses.replace(static.policy, expansion=ExpansionName.ALWAYS),
            elastic=record.capacity,
            routing=RoutingRule(RoutingPolicy.SHORTEST_QUEUE),
        )
    return {name: dataclasses.replace(s, name=name) for name, s in out.items()}


def replay(record: RunRecord, setup: SimSetup) -> Simulator:
    """``setup`` over the run's recorded steps; ends when the last one has trained."""
    cfg = record.cfg
    batches = record.batches
    workload = WorkloadConfig(
        batch_size=max(len(b) for b in batches),
        group_size=cfg.run.group_size,
        staleness=cfg.run.max_staleness,
        max_trajectory_tokens=max(
            s.final_context_tokens + s.turns[-1].gen_tokens for b in batches for s in b
        ),
        gen_tokens_max=cfg.run.max_tokens_per_turn,
    )
    sim = Simulator(
        setup,
        record.cost,  # type: ignore[arg-type]  # MeasuredCost: CostModel's interface
        workload,
        record.prior,
        seed=cfg.run.seed,
        duration_s=100 * record.run_s + 3600.0,
        batches=lambda step: batches[step],
        max_steps=len(batches),
    )
    return sim.run()


def _worker_s(sim: Simulator, reserved: int) -> tuple[float, float]:
    """Borrowed workers' active seconds and elastic workers' held seconds, to the end of
    the last step."""
    end = max((s.trained_s for s in sim.steps), default=sim.now)
    elastic = held_gpu_seconds(sim, end) - reserved * end  # (the replay's tp is 1)
    return state_seconds(sim, end)["active-borrowed"], elastic


def system_row(record: RunRecord, name: str, sim: Simulator) -> dict[str, Any]:
    """One system's line of the counterfactual table."""
    steps = [s for s in sim.steps if s.trained_s > 0]
    done = len(steps) == len(record.steps)
    run_s = steps[-1].trained_s if done else float("nan")
    switches, ratios = mode_changes(sim.controller.history)
    borrowed_s, elastic_s = _worker_s(sim, sim.setup.reserved_rollout_gpus)
    generated = sum(s.generated_tokens for s in steps)
    return {
        "system": name,
        "finished": done,
        "run_s": round(run_s, 2),
        "rollout_s": round(sum(s.finished_s - s.rollout_started_s for s in steps), 2),
        "tokens_per_s": round(generated / run_s, 1) if done and run_s > 0 else 0.0,
        "mode_changes": len(switches),
        "ratio_changes": ratios,
        "borrow_cycles": sum(1 for *_, state in sim.timeline if state == "active-borrowed"),
        "borrowed_turns": sim.borrowed_turns,
        "borrowed_worker_s": round(borrowed_s, 1),
        "elastic_worker_s": round(elastic_s, 1),
        "per_step": [
            {
                "step": s.step,
                "rollout_s": round(s.finished_s - s.rollout_started_s, 3),
                "config": s.config,
                "trained_s": round(s.trained_s, 3),
            }
            for s in steps
        ],
    }


def _error(simulated: float, measured: float) -> float:
    return (simulated - measured) / measured if measured else 0.0


def validation(record: RunRecord, pearl: Mapping[str, Any]) -> dict[str, Any]:
    """The simulated twin against the measured run: per step and overall."""
    rows = []
    for m, s in zip(record.steps, pearl["per_step"], strict=False):
        rows.append(
            {
                "step": m.step,
                "measured_rollout_s": round(m.rollout_s, 3),
                "simulated_rollout_s": s["rollout_s"],
                "rollout_error": round(_error(s["rollout_s"], m.rollout_s), 4),
                "measured_config": m.config,
                "simulated_config": s["config"],
                "measured_tokens_per_s": round(m.tokens_per_s, 1),
                "simulated_tokens_per_s": round(
                    m.generated_tokens / s["rollout_s"] if s["rollout_s"] > 0 else 0.0, 1
                ),
            }
        )
    measured_rollout = sum(m.rollout_s for m in record.steps)
    return {
        "per_step": rows,
        "rollout_error": round(_error(pearl["rollout_s"], measured_rollout), 4),
        "mean_abs_step_error": round(
            statistics.fmean(abs(r["rollout_error"]) for r in rows) if rows else 0.0, 4
        ),
        "run_error": round(_error(pearl["run_s"], record.run_s), 4),
        "configs_agree": sum(r["measured_config"] == r["simulated_config"] for r in rows),
        "steps": len(rows),
    }


def inputs(record: RunRecord) -> dict[str, Any]:
    """What the replay was given, for the reader to judge the error by."""
    p = record.cost.profile
    trace = record.capacity
    return {
        "startup_s": round(record.startup_s, 3),
        "steps": len(record.steps),
        "trajectories": sum(len(b) for b in record.batches),
        "turns": sum(len(s.turns) for b in record.batches for s in b),
        "decode_iteration_s": f"{p.decode_fixed_s:.3g} + {p.decode_per_seq_s:.3g} * sequences",
        "prefill_s_per_token": float(f"{p.prefill_s_per_token:.3g}"),
        "train_s_per_token": float(f"{record.cost.train_s_per_token:.3g}"),
        "weight_sync_s": round(record.cost.weight_sync_s, 3),
        "latencies_s": {k: round(v, 3) for k, v in record.cost.latencies.items()},
        "latency_sources": dict(record.sources),
        "controller_prior": record.prior_source,
        "capacity": None
        if trace is None
        else [[t, c] for t, c in zip(trace.times_s, trace.counts, strict=True)],
    }


def counterfactual(record: RunRecord) -> dict[str, Any]:
    """Every system of :func:`setups` replayed; the validation of ``pearl``'s twin."""
    rows = [system_row(record, name, replay(record, s)) for name, s in setups(record).items()]
    statics = [r for r in rows if r["system"].startswith("static ") and r["finished"]]
    best = min(statics, key=lambda r: r["run_s"]) if statics else None
    pearl = rows[0]
    for r in rows:
        r["best_static"] = r is best
        r["vs_pearl"] = round(r["run_s"] / pearl["run_s"], 3) if r["finished"] else None
    c = record.counters
    return {
        "run": record.name,
        "inputs": inputs(record),
        "measured": {
            "run_s": round(record.run_s, 2),
            "rollout_s": round(sum(m.rollout_s for m in record.steps), 2),
            "tokens_per_s": round(sum(m.generated_tokens for m in record.steps) / record.run_s, 1),
            "mode_changes": c.get("mode_changes", 0),
            "ratio_changes": c.get("ratio_changes", 0),
            "borrow_cycles": c.get("borrow_cycles", 0),
            "borrowed_turns": c.get("borrowed_turns", 0),
        },
        "validation": validation(record, pearl),
        "systems": rows,
    }


NOT_MODELLED = (
    "per-token effects inside a turn (the iteration is linear in sequences), CPU contention "
    "between engines, trainers and the master on shared cores, a distinct cost for each "
    "engine start (all take the run's mean), the master's own latency per event, a borrow "
    "cancelled before its engine was up (the run gives its GPU back at once; the twin pays "
    "the measured deactivation)"
)


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def format_inputs(doc: Mapping[str, Any]) -> str:
    i = doc["inputs"]
    lat = ", ".join(f"{k} {v:g} s ({i['latency_sources'][k]})" for k, v in i["latencies_s"].items())
    cap = i["capacity"]
    capacity = "none" if cap is None else ", ".join(f"{c} elastic at {t:g} s" for t, c in cap)
    return (
        f"start-up {i['startup_s']:g} s (its own phase, not replayed); {i['steps']} steps, "
        f"{i['trajectories']} trajectories, {i['turns']} turns as recorded; decode iteration "
        f"{i['decode_iteration_s']} s, prefill {i['prefill_s_per_token']:g} s/token, training "
        f"{i['train_s_per_token']:g} s/token + sync {i['weight_sync_s']:g} s; {lat}; "
        f"capacity: {capacity}; controller prior: {i['controller_prior']}"
    )


def format_validation(doc: Mapping[str, Any]) -> str:
    """The twin against the run: a markdown table per step, then the overall line."""
    v = doc["validation"]
    lines = [
        "| step | config measured | config simulated | rollout s measured | simulated | error "
        "| tokens/s measured | simulated |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in v["per_step"]:
        lines.append(
            f"| {r['step']} | {r['measured_config']} | {r['simulated_config']} | "
            f"{r['measured_rollout_s']:.2f} | {r['simulated_rollout_s']:.2f} | "
            f"{_pct(r['rollout_error'])} | {r['measured_tokens_per_s']:.0f} | "
            f"{r['simulated_tokens_per_s']:.0f} |"
        )
    m, pearl = doc["measured"], doc["systems"][0]
    lines.append("")
    lines.append(
        f"overall: rollout {_pct(v['rollout_error'])} ({pearl['rollout_s']:g} s simulated, "
        f"{m['rollout_s']:g} s measured), per step mean |error| {v['mean_abs_step_error']:.1%}; "
        f"run after start-up {_pct(v['run_error'])} ({pearl['run_s']:g} s vs {m['run_s']:g} s); "
        f"serving configuration the same in {v['configs_agree']} of {v['steps']} steps"
    )
    return "\n".join(lines)


def format_systems(doc: Mapping[str, Any]) -> str:
    """The counterfactual table: the measured run, then every replayed system."""
    m = doc["measured"]
    lines = [
        "| system | run s | run time vs pearl | rollout s | tokens/s | mode / ratio changes "
        "| borrow cycles (turns) | borrowed worker-s | elastic worker-s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| measured run | {m['run_s']:.1f} | | {m['rollout_s']:.1f} | {m['tokens_per_s']:.0f} | "
        f"{m['mode_changes']} / {m['ratio_changes']} | {m['borrow_cycles']} "
        f"({m['borrowed_turns']}) | | |",
    ]
    for r in doc["systems"]:
        name = r["system"] + (" (best static)" if r["best_static"] else "")
        if not r["finished"]:
            lines.append(f"| {name} | did not finish the run's steps | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['run_s']:.1f} | {r['vs_pearl']:.2f}x | {r['rollout_s']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['mode_changes']} / {r['ratio_changes']} | "
            f"{r['borrow_cycles']} ({r['borrowed_turns']}) | {r['borrowed_worker_s']:.1f} | "
            f"{r['elastic_worker_s']:.1f} |"
        )
    return "\n".join(lines)
