"""``pearl-hpc plan``: the decision and its minimal-change plan as a dry run."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pearl_hpc.cli.common import (
    MAX_WORKERS,
    borrowable_count,
    non_negative_float,
    non_negative_int,
    resolve_profile,
    worker_count,
)
from pearl_hpc.config import load_profile
from pearl_hpc.core.decision import decide
from pearl_hpc.core.orchestrator import CapacityUnit, plan_transition
from pearl_hpc.core.policies import PolicyConfig, gate_borrowing_of, make_policies
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.table import RoleTable
from pearl_hpc.core.types import PDConfig, Role, Status, Zone, parse_spec
from pearl_hpc.errors import SpecError


# --------------------------------------------------------------------------- plan
def build_plan_table(
    current: PDConfig | None, num_overlap_workers: int
) -> tuple[RoleTable, list[int]]:
    """A table with ``current``'s dedicated workers (GPU sets ``d<i>``) and
    ``num_overlap_workers`` idle overlap workers on training GPU sets ``t<i>``."""
    table = RoleTable()
    overlap_ids: list[int] = []
    if num_overlap_workers:
        training = [f"t{i}" for i in range(num_overlap_workers)]
        table.add_worker(training, zone=Zone.OVERLAP, role=Role.TRAINING, status=Status.INACTIVE)
        for gpu in training:
            slot = table.add_worker(
                [gpu], zone=Zone.OVERLAP, role=Role.COLOCATED, status=Status.INACTIVE
            )
            overlap_ids.append(slot.slot_id)
    if current is not None:
        roles = current.roles()
        for i, role in enumerate(roles):
            table.add_worker([f"d{i}"], zone=Zone.DEDICATED, role=role, status=Status.ACTIVE)
    return table, overlap_ids


def run_plan(
    profile: WorkloadProfile,
    *,
    rollout_workers: int,
    current: PDConfig | None,
    borrowable_workers: int = 0,
    toggle_cost_s: float | None = None,
    unfinished: int | None = None,
) -> dict[str, Any]:
    """The dry run behind ``pearl-hpc plan``; returns the JSON document."""
    config = PolicyConfig()
    table, overlap_ids = build_plan_table(current, borrowable_workers)
    num_current = 0 if current is None else current.total
    toggle_s = config.toggle_cost_s if toggle_cost_s is None else toggle_cost_s

    started = time.perf_counter()
    gate = None
    units = [CapacityUnit((f"d{i}",)) for i in range(num_current, rollout_workers)]
    num_workers = rollout_workers
    if borrowable_workers:
        gate = gate_borrowing_of(
            make_policies(config),
            profile,
            num_dedicated=rollout_workers,
            num_lendable=borrowable_workers,
            unfinished=unfinished,
            toggle_cost_s=toggle_s,
        )
        if gate.allow:
            num_workers += borrowable_workers
            units += [
                CapacityUnit(table.get(i).gpu_ids, Zone.OVERLAP, None, i) for i in overlap_ids
            ]
    decision = decide(profile, num_workers, current)
    plan = plan_transition(table, decision.target, units)
    elapsed_s = time.perf_counter() - started

    target = decision.target
    return {
        "mode": target.mode.value,
        "num_prefill": target.num_prefill,
        "num_decode": target.num_decode,
        "num_colocated": target.num_colocated,
        "predicted_makespan_s": decision.predicted_makespan_s,
        "switch": decision.switch,
        "forced": decision.forced,
        "reason": decision.reason,
        "current": None if current is None else current.spec(),
        "rollout_workers": rollout_workers,
        "borrowing": None
        if gate is None
        else {
            "borrowable_workers": borrowable_workers,
            "borrowed_workers": borrowable_workers if gate.allow else 0,
            "allowed": gate.allow,
            "benefit_s": gate.benefit_s,
            "toggle_cost_s": gate.cost_s,
            "reason": gate.reason,
        },
        "candidates": [c.to_dict() for c in decision.candidates],
        "plan": plan.to_dict(),
        "decision_time_s": elapsed_s,
    }


def _print_plan(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    target = PDConfig(doc["num_prefill"], doc["num_decode"], doc["num_colocated"])
    console.print(
        f"[bold]target[/bold] {target.spec()} ({doc['mode']}), predicted makespan "
        f"{doc['predicted_makespan_s']:.1f} s, switch={doc['switch']}"
    )
    console.print(f"[bold]reason[/bold] {doc['reason']}")
    if doc["borrowing"]:
        console.print(f"[bold]borrowing[/bold] {doc['borrowing']['reason']}")
    table = Table(title="candidates")
    for col in ("config", "mode", "feasible", "makespan s", "vs target"):
        table.add_column(col, justify="right" if col in ("makespan s", "vs target") else "left")
    best = doc["predicted_makespan_s"]
    for cand in doc["candidates"]:
        cfg = PDConfig(cand["num_prefill"], cand["num_decode"], cand["num_colocated"])
        mark = "*" if cfg == target else ""
        feasible = "yes" if cand["feasible"] else f"no ({cand['infeasible_reason']})"
        table.add_row(
            f"{cfg.spec()}{mark}",
            cand["mode"],
            feasible,
            f"{cand['predicted_makespan_s']:.1f}",
            f"{100 * (cand['predicted_makespan_s'] / best - 1):+.1f}%",
        )
    console.print(table)
    plan = doc["plan"]
    adds = ", ".join(f"{a['slot_id']}:{a['role']}" for a in plan["add"]) or "-"
    changes = ", ".join(f"{c['slot_id']}->{c['role']}" for c in plan["role_changes"]) or "-"
    console.print(
        f"[bold]plan[/bold] add [{adds}]  remove {plan['remove'] or '-'}  roles [{changes}]"
    )
    console.print(f"decision + plan took {1e3 * doc['decision_time_s']:.3f} ms")


def _cmd_plan(args: argparse.Namespace) -> int:
    profile = load_profile(resolve_profile(args.profile))
    current = parse_spec(args.current) if args.current else None
    if current is not None and current.total > MAX_WORKERS:
        raise SpecError(f"--current {args.current}: at most {MAX_WORKERS} workers")
    doc = run_plan(
        profile,
        rollout_workers=args.rollout_workers,
        current=current,
        borrowable_workers=args.borrowable_workers,
        toggle_cost_s=args.toggle_cost_s,
        unfinished=args.unfinished,
    )
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_plan(doc)
    return 0


def add_parsers(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="dry run: PD decision + minimal-change plan for a workload profile",
        description="Score colocation and every P:D split for N rollout workers, apply "
        "hysteresis against --current, gate borrowing of --borrowable-workers, and print "
        "the decision and its minimal-change transition plan.",
    )
    plan.add_argument(
        "--profile",
        required=True,
        help="profile YAML, or a shipped name (e.g. qwen3-30b-a3b-h800-tp2)",
    )
    plan.add_argument(
        "--rollout-workers",
        type=worker_count,
        required=True,
        help="dedicated rollout workers available now (N)",
    )
    plan.add_argument("--current", help="current configuration, e.g. 8C or 3P5D")
    plan.add_argument(
        "--borrowable-workers",
        type=borrowable_count,
        default=0,
        help="idle training-GPU workers that may be borrowed (M)",
    )
    plan.add_argument(
        "--toggle-cost-s",
        type=non_negative_float,
        default=None,
        help="T_toggle for the borrowing gate (default 9.44 s)",
    )
    plan.add_argument(
        "--unfinished",
        type=non_negative_int,
        default=None,
        help="unfinished trajectories R for the borrowing gate (default: B)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_cmd_plan)
