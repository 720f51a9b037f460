"""The local training run, PEARL against a fixed colocated configuration, side by side.

    pearl-hpc bench --local [--config configs/runs/local.yaml]

Runs the same run YAML twice on real engines:
- **pearl**: the YAML's policies (adaptive PD, gated borrowing, gated expansion);
- **colocated**: colocated always, no borrowing; the same workers and elastic trace;
- **pearl-sync**: pearl with synchronous steps (``run.max_staleness: 0``), to show what
  running step k+1's rollout during step k's training buys;
- **pearl+**: pearl with ``policy.tail_start`` and ``policy.local_prefill`` (issue 17; the
  simulator's pearl+): step k+2's rollout starts in step k+1's tail, on the weights of
  step k, once fewer trajectories are left than the serving workers can keep busy; in
  disaggregated mode a turn goes whole to the decode worker holding its prefix when
  ``prefill_locally`` says that beats the KV transfer (the table counts how many did);
- **pearl+s2** (only when named): pearl+ with ``run.max_staleness: 2``, rollouts up to
  two versions ahead of the trainer (the per-step lines carry each batch's staleness and
  its off-policy mismatch).

``--variants`` picks which (``pearl`` first), ``--steps`` overrides the YAML's steps.
Then it prints:
- per-rollout and aggregate tokens/s (generated tokens over the time from the first
  rollout's start to the last one's end: the one to compare overlapping batches by), the
  share of routed worker time with nothing in flight, overall and in the batch tails,
  and the ratios;
- the reconfiguration latencies PEARL measured, next to what this run measured. These
  are read from the pearl run's ``events.jsonl``:
  - inter-scale preparation: a new worker process started, up to weights caught up;
  - finalisation: last ready of a group up to its admission;
  - intra-scale activation and deactivation of the overlap worker;
  - mode switch: the engine restarted in its new role;
- the controller's predicted rollout time of each step next to the measured one.

On 2 CPU cores every engine shares the same cores. More workers add no compute, and
disaggregation costs more than it gains (``bench --engines``). The ratio therefore
measures the mechanisms' overhead on this machine, not PEARL's GPU-scale gain.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pearl_hpc.backends.world import run_to_summary
from pearl_hpc.bench import record
from pearl_hpc.config.run import RunConfig
from pearl_hpc.core.policies import BorrowingName, PDPolicyName
from pearl_hpc.errors import PearlError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.rundir import RunDir, read_jsonl

# PEARL.md, "Reconfiguration latency" (Qwen3-8B / Qwen3-30B-A3B on H800), seconds
PEARL_LATENCIES_S = {
    "inter-scale preparation": (56.29, 67.06),
    "inter-scale finalisation": (11.05, 17.89),
    "intra-scale activation": (6.26, 6.09),
    "intra-scale deactivation": (3.18, 4.38),
}


def measured_latencies(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Reconfiguration latencies of one run, from its events (seconds)."""
    out: dict[str, list[float]] = {
        "inter-scale preparation": [],
        "inter-scale finalisation": [],
        "intra-scale activation": [],
        "intra-scale activation, engine's first start (compiles)": [],
        "intra-scale deactivation": [],
        "mode switch (role change)": [],
        "world start (launch -> every hello)": [],
        "elastic rank: go -> proven hellos (joined)": [],
        "weight group rebuild (new members)": [],
        "weight broadcast, per engine": [],
    }
    ready_at: dict[int, float] = {}
    for ev in events:
        kind = ev["kind"]
        if kind == "joined":
            out["elastic rank: go -> proven hellos (joined)"].append(ev["s"])
        if kind == "ready":
            ready_at[ev["slot"]] = ev["t_s"]
            key = "intra-scale activation" if ev["reactivate"] else "inter-scale preparation"
            if ev["reactivate"] and ev.get("first"):
                key = "intra-scale activation, engine's first start (compiles)"
            out[key].append(ev["s"])
        elif kind == "admit":
            group = [ready_at[s] for s in ev["slots"] if s in ready_at]
            if group:
                out["inter-scale finalisation"].append(max(0.0, ev["t_s"] - max(group)))
        elif kind == "released" and ev.get("overlap"):
            out["intra-scale deactivation"].append(ev["s"])
        elif kind == "rerole":
            out["mode switch (role change)"].append(ev["s"])
        elif kind == "world":
            out["world start (launch -> every hello)"].append(ev["start_s"])
        elif kind == "publish" and ev["members"]:
            if ev["form_s"]:
                out["weight group rebuild (new members)"].append(ev["form_s"])
            out["weight broadcast, per engine"].append(ev["s"] / ev["members"])
    return out


def _colocated(cfg: RunConfig) -> RunConfig:
    policy = replace(cfg.policy, pd_policy=PDPolicyName.COLOCATED, borrowing=BorrowingName.NONE)
    return replace(cfg, name=cfg.name + "-colocated", policy=policy)


VARIANTS = ("pearl", "colocated", "pearl-sync", "pearl+")
EXTRA = ("pearl+s2",)  # run when named: pearl+ with run.max_staleness 2


def _variant(cfg: RunConfig, name: str) -> RunConfig:
    if name == "pearl":
        return cfg
    if name == "colocated":
        return _colocated(cfg)
    if name == "pearl-sync":
        return replace(cfg, name=cfg.name + "-sync", run=replace(cfg.run, max_staleness=0))
    if name in ("pearl+", "pearl+s2"):
        policy = replace(cfg.policy, tail_start=True, local_prefill=True)
        plus = replace(cfg, name=cfg.name + "-plus", policy=policy)
        if name == "pearl+":
            return plus
        return replace(plus, name=cfg.name + "-plus-s2", run=replace(cfg.run, max_staleness=2))
    known = ", ".join(VARIANTS + EXTRA)
    raise PearlError(f"bench --local: unknown variant {name!r}; use {known}")


def run(
    config: str, variants: tuple[str, ...] = VARIANTS, steps: int | None = None
) -> dict[str, Any]:
    cfg = load_run_config(config)
    if steps is not None:
        cfg = replace(cfg, run=replace(cfg.run, steps=steps))
    chosen = [_variant(cfg, name) for name in variants]  # a bad name fails before any run
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pearl-bench-local-") as tmp:
        for name, variant in zip(variants, chosen, strict=True):
            run_dir = Path(tmp) / name
            print(f"bench --local: running {name} ...", flush=True)
            summary = run_to_summary(variant, run_dir)
            metrics = read_jsonl(RunDir(run_dir).metrics)
            results[name] = {
                "summary": summary,
                "metrics": metrics,
                "latencies": measured_latencies(read_jsonl(RunDir(run_dir).events)),
            }
    return results


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "-"


def _median(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = statistics.median(xs)
    return f"{m:.2f}" if m >= 0.1 else f"{m * 1000:.1f} ms"


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """pearl against each other variant run."""
    if "pearl" not in results:
        return {}
    pearl = results["pearl"]["summary"]
    out = {}
    if "colocated" in results:
        coloc = results["colocated"]["summary"]
        out["pearl / colocated rollout tokens/s"] = pearl["tokens_per_s"] / coloc["tokens_per_s"]
    if "pearl-sync" in results:
        sync = results["pearl-sync"]["summary"]
        out["pearl / pearl-sync wall time"] = pearl["wall_s"] / sync["wall_s"]
    if "pearl+" in results:
        plus = results["pearl+"]["summary"]
        out["pearl+ / pearl aggregate tokens/s"] = (
            plus["aggregate_tokens_per_s"] / pearl["aggregate_tokens_per_s"]
        )
        out["pearl+ / pearl wall time"] = plus["wall_s"] / pearl["wall_s"]
    return out


def format_results(results: dict[str, Any]) -> str:
    lines = [
        "| system | rollout tokens/s | aggregate tokens/s | wall s | idle share | tail idle "
        "share | targets | borrow cycles: served (turns) / unserved / cancelled | mode "
        "changes (undone) | local prefills |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["summary"]
        c = s["counters"]
        targets = [t for i, t in enumerate(s["targets"]) if i == 0 or s["targets"][i - 1] != t]
        lines.append(
            f"| {name} | {s['tokens_per_s']:.0f} | {s['aggregate_tokens_per_s']:.0f} | "
            f"{s['wall_s']:.0f} | {s['idle_share']:.1%} | {s['tail_idle_share']:.1%} | "
            f"{' -> '.join(targets)} | {c['borrow_cycles']} ({c.get('borrowed_turns', 0)}) / "
            f"{c.get('borrows_unserved', 0)} / {c.get('borrows_cancelled', 0)} | "
            f"{c['mode_changes']} ({c.get('undone_switches', 0)}) | {s.get('local_prefills', 0)} |"
        )
    if "pearl" not in results:
        return "\n".join(lines)
    r = ratios(results)
    if "pearl / colocated rollout tokens/s" in r:
        lines.append(
            f"\npearl / colocated rollout tokens/s: {r['pearl / colocated rollout tokens/s']:.2f}x"
            " (2 CPU cores shared by every engine: see the module docstring)"
        )
    if "pearl / pearl-sync wall time" in r:
        lines.append(
            f"pearl wall time / pearl-sync: {r['pearl / pearl-sync wall time']:.2f}x "
            "(rollout k+1 during training k, on the same 2 cores)"
        )
    if "pearl+ / pearl aggregate tokens/s" in r:
        lines.append(
            f"pearl+ / pearl aggregate tokens/s: {r['pearl+ / pearl aggregate tokens/s']:.2f}x, "
            f"wall time {r['pearl+ / pearl wall time']:.2f}x (the next batch in this one's tail)"
        )
    lines.append("\n| reconfiguration | PEARL Qwen3-8B / 30B-A3B (s) | this run, median (n) |")
    lines.append("|---|---|---|")
    lat = results["pearl"]["latencies"]
    for key, values in lat.items():
        paper = PEARL_LATENCIES_S.get(key)
        ref = f"{paper[0]} / {paper[1]}" if paper else "-"
        lines.append(f"| {key} | {ref} | {_median(values)} ({len(values)}) |")
    lines.append("\n| step | config | predicted rollout s | measured s |")
    lines.append("|---|---|---|---|")
    for m in results["pearl"]["metrics"]:
        lines.append(
            f"| {m['step']} | {m['config']} | {m['predicted_s']:.2f} | {m['rollout_s']:.2f} |"
        )
    for name in ("pearl", "pearl+"):
        if name in results:
            lines.append(f"\n{name}: per step, rollout window, its tail, idle shares")
            lines.append("| step | rollout start-end s | tail s | idle share | tail idle share |")
            lines.append("|---|---|---|---|---|")
            for m in results[name]["metrics"]:
                lines.append(
                    f"| {m['step']} | {m['rollout_started_s']:.1f}-{m['rollout_ended_s']:.1f} | "
                    f"{m['tail_s']:.1f} | {_share(m['idle_worker_s'], m['worker_s'])} | "
                    f"{_share(m['tail_idle_worker_s'], m['tail_worker_s'])} |"
                )
    return "\n".join(lines)


def main(
    config: str,
    as_json: bool = False,
    variants: tuple[str, ...] = VARIANTS,
    steps: int | None = None,
    record_to: str = record.DEFAULT,
) -> int:
    results = run(config, variants, steps)
    args = {"config": config, "variants": list(variants), "steps": steps}
    record.append(record_to, "local", results, ratios(results), args)
    if as_json:
        print(json.dumps(results, indent=1))
    else:
        print(format_results(results))
    return 0
