"""Decision + plan latency for 64 .. 50,000 rollout workers.

For each size N it times, in one process, ``decide()`` + ``plan_transition()`` on three
events — a cold start (no current configuration, N free units), a grow by N/8 units on
top of the best configuration, and a shrink that reclaims N/8 workers — with the shipped
Qwen3-30B-A3B profile at 8 trajectories per worker. Baseline side by side: the same
decision scored with a plain per-candidate Python loop over the scalar predictor.

Run: ``pearl-hpc bench`` (or ``python -m pearl_hpc.bench.decision_speed``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from pearl_hpc.bench import record
from pearl_hpc.config import REPO_CONFIGS, load_profile
from pearl_hpc.core import predictor
from pearl_hpc.core.decision import decide
from pearl_hpc.core.orchestrator import CapacityUnit, plan_transition
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.table import RoleTable
from pearl_hpc.core.types import PDConfig, Status, Zone

SIZES = (64, 256, 1024, 4096, 50_000)


def _table(config: PDConfig) -> RoleTable:
    table = RoleTable()
    roles = config.roles()
    for i, role in enumerate(roles):
        table.add_worker((f"g{i}a", f"g{i}b"), zone=Zone.DEDICATED, role=role, status=Status.ACTIVE)
    return table


def _units(start: int, count: int) -> list[CapacityUnit]:
    return [CapacityUnit((f"g{i}a", f"g{i}b")) for i in range(start, start + count)]


def scalar_best(profile: WorkloadProfile, n: int) -> tuple[PDConfig, float]:
    """Baseline: argmin by a Python loop over scalar predictor calls."""
    best, best_t = PDConfig.colocated(n), predictor.predict(profile, 0, 0, n)
    for num_p in range(1, n):
        num_d = n - num_p
        if not (
            predictor.kv_feasible(profile, num_d)
            and predictor.prefill_feasible(profile, num_p, num_d)
        ):
            continue
        t = predictor.predict(profile, num_p, num_d, 0)
        if t < best_t:
            best, best_t = PDConfig(num_p, num_d, 0), t
    return best, best_t


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples), samples[int(0.95 * (len(samples) - 1))]


def _events(profile: WorkloadProfile, n: int) -> dict[str, Callable[[], Any]]:
    step = max(1, n // 8)
    best = decide(profile, n).target
    empty, current = RoleTable(), _table(best)
    reclaimed = [s.slot_id for s in current.in_service()[:step]]
    cold, grown = _units(0, n), _units(n, step)  # the controller holds its units already
    return {
        "cold": lambda: plan_transition(empty, decide(profile, n).target, cold),
        "grow": lambda: plan_transition(current, decide(profile, n + step, best).target, grown),
        "shrink": lambda: plan_transition(
            current, decide(profile, n - step, best).target, (), reclaimed
        ),
    }


def run(sizes: Sequence[int] = SIZES, repeats: int = 30) -> list[dict[str, Any]]:
    base = load_profile(REPO_CONFIGS / "profiles" / "qwen3-30b-a3b-h800-tp2.yaml")
    rows = []
    for n in sizes:
        profile = base.replace(batch_size=8 * n)
        for name, fn in _events(profile, n).items():
            fn()  # warm-up
            median_s, p95_s = _time(fn, repeats)
            rows.append(
                {"workers": n, "event": name, "median_ms": 1e3 * median_s, "p95_ms": 1e3 * p95_s}
            )
        base_median_s, _ = _time(lambda: scalar_best(profile, n), max(3, repeats // 5))  # noqa: B023
        vec_median_s, _ = _time(lambda: decide(profile, n), repeats)  # noqa: B023
        rows.append(
            {
                "workers": n,
                "event": "decide-only",
                "median_ms": 1e3 * vec_median_s,
                "baseline_loop_ms": 1e3 * base_median_s,
                "speedup": base_median_s / vec_median_s,
            }
        )
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each event's time at the largest size over its time at the smallest (linear in
    the workers: their ratio), and the vectorised decision's speed-up there."""
    sizes = sorted({r["workers"] for r in rows})
    out: dict[str, float] = {}
    by = {(r["workers"], r["event"]): r for r in rows}
    lo, hi = sizes[0], sizes[-1]
    for event in ("cold", "grow", "shrink", "decide-only"):
        if lo != hi and (lo, event) in by and (hi, event) in by:
            ratio = by[hi, event]["median_ms"] / by[lo, event]["median_ms"]
            out[f"{event} {hi} / {lo} workers"] = ratio
    if (hi, "decide-only") in by:
        out[f"decide speed-up over the scalar loop at {hi}"] = by[hi, "decide-only"]["speedup"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--sizes", default=",".join(map(str, SIZES)), help="workers, comma-separated"
    )
    record.add_argument(parser)
    args = parser.parse_args(argv)
    rows = run([int(n) for n in args.sizes.split(",")], repeats=args.repeats)
    record.append(args.record, "decision", rows, ratios(rows), vars(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="decision + plan latency (ms)")
    for col in ("workers", "event", "median", "p95", "scalar-loop baseline", "speedup"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["workers"]),
            row["event"],
            f"{row['median_ms']:.3f}",
            f"{row['p95_ms']:.3f}" if "p95_ms" in row else "",
            f"{row['baseline_loop_ms']:.3f}" if "baseline_loop_ms" in row else "",
            f"{row['speedup']:.1f}x" if "speedup" in row else "",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
