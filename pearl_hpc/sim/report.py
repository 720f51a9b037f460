"""``--report DIR``: a markdown table, the JSON, and PNG plots of a simulation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pearl_hpc.errors import PearlError
from pearl_hpc.sim import breakdown
from pearl_hpc.sim.engine import Simulator

_STATE_COLORS = {
    ("prefill", False): "#1f77b4",
    ("decode", False): "#ff7f0e",
    ("colocated", False): "#2ca02c",
    ("prefill", True): "#aec7e8",
    ("decode", True): "#ffbb78",
    ("colocated", True): "#98df8a",
}


def markdown_table(doc: dict[str, Any]) -> str:
    has_roll = "ratios_vs_roll" in doc
    has_rlb = "ratios_vs_rlboost+" in doc
    head = (
        "| system | tokens/s | aggregate tokens/s | of fluid bound | idle share | steps | "
        "rollout tokens | trained tokens |"
    )
    rule = "|---|---|---|---|---|---|---|---|"
    if has_roll:
        head, rule = head + " vs roll |", rule + "---|"
    if has_rlb:
        head, rule = head + " vs rlboost+ |", rule + "---|"
    lines = [
        f"# Simulation: {doc['model']} on {doc['gpu']} TP{doc['tp']}, "
        + (
            f"segment {doc['segment']}"
            if doc.get("segment")
            else f"fixed {doc['rollout_gpus']} rollout GPUs"
            if doc.get("rollout_gpus")
            else f"trace {doc.get('trace')}"
        )
        + f", {doc['duration_s']:.0f} s, seed {doc['seed']}",
        "",
        head,
        rule,
    ]
    for name, r in doc["systems"].items():
        row = (
            f"| {name} | {r['throughput_tokens_per_s']:.0f} | {r['aggregate_tokens_per_s']:.0f} "
            f"| {r['share_of_fluid_bound']:.1%} | {r['idle_worker_share']:.1%} | {r['steps']} | "
            f"{r['rollout_tokens']} | {r['trained_tokens']} |"
        )
        if has_roll:
            row += f" {doc['ratios_vs_roll'][name]:.2f}x |"
        if has_rlb:
            row += f" {100 * (doc['ratios_vs_rlboost+'][name] - 1):+.1f}% |"
        lines.append(row)
    bound = doc["fluid_bound"]
    lines += [
        "",
        f"fluid bound: {bound['tokens_per_s']:.0f} tokens/s (the same GPUs at perfect "
        f"utilisation with free reconfiguration; limited by {bound['limited_by']}: "
        f"{bound['rollout_worker_s_per_batch']:.0f} rollout worker-s and "
        f"{bound['training_s_per_batch']:.0f} s of training per batch)",
    ]
    lines += ["", breakdown.markdown(doc["systems"])]
    if any(r["steps"] and name.startswith("pearl+") for name, r in doc["systems"].items()):
        lines += [
            "",
            "tokens/s and the ratios are PEARL's metric, the mean of per-step throughputs; "
            "pearl+'s batches overlap, so two can finish close together and make a tiny "
            "step window: compare it by aggregate tokens/s (all tokens over the time).",
        ]
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | Path, doc: dict[str, Any], sims: dict[str, Simulator]
) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PearlError("--report needs matplotlib: pip install -e '.[plots]'") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.md", out / "results.json"]
    written[0].write_text(markdown_table(doc))
    written[1].write_text(json.dumps(doc, indent=2))

    # throughput per step over time, GPU budget behind it
    fig, ax = plt.subplots(figsize=(10, 4.5))
    budget_ax = ax.twinx()
    for name, sim in sims.items():
        steps = [s for s in sim.steps if s.finished_s > 0]
        ax.step(
            [s.finished_s for s in steps],
            [s.throughput_tokens_per_s for s in steps],
            where="post",
            label=name,
        )
        if sim.budget:
            times = [t for t, _ in sim.budget] + [sim.duration_s]
            gpus = [g for _, g in sim.budget] + [sim.budget[-1][1]]
            budget_ax.step(times, gpus, where="post", color="grey", alpha=0.25, linewidth=1)
    finish_throughput_axes(ax, budget_ax, "dedicated rollout GPUs (grey)", "time (s)")
    written.append(save_figure(plt, fig, out / "throughput.png"))

    # role timeline of each system with elastic or borrowed workers
    for name, sim in sims.items():
        path = out / f"roles-{name.replace('+', 'plus')}.png"
        plot_role_timeline(plt, sim.timeline, sim.duration_s, name, path)
        written.append(path)
    return written


def finish_throughput_axes(ax: Any, budget_ax: Any, budget_label: str, xlabel: str) -> None:
    """Labels and layering of a step-throughput plot drawn over a worker-budget axis."""
    budget_ax.set_ylabel(budget_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("step throughput (tokens/s)")
    ax.set_zorder(budget_ax.get_zorder() + 1)  # the throughput line above the budget
    ax.patch.set_visible(False)
    ax.legend(loc="upper left", fontsize=8)


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_role_timeline(
    plt: Any,
    timeline: list[tuple[float, int, str, str]],
    duration_s: float,
    name: str,
    path: Path,
) -> None:
    """Bars of active workers over time from ``(t, slot, role, state)`` changes; state
    ``active`` or ``active-borrowed`` opens a bar, anything else closes it. The simulator
    and a real run (``pearl-hpc report``) draw the same figure."""
    spans: dict[int, list[tuple[float, float, str, bool]]] = {}
    open_: dict[int, tuple[float, str, bool]] = {}
    for t, slot, role, state in timeline:
        borrowed = state.endswith("-borrowed")
        base = state.removesuffix("-borrowed")
        if slot in open_:
            start, r, b = open_.pop(slot)
            spans.setdefault(slot, []).append((start, t, r, b))
        if base == "active":
            open_[slot] = (t, role, borrowed)
    for slot, (start, r, b) in open_.items():
        spans.setdefault(slot, []).append((start, duration_s, r, b))
    fig, ax = plt.subplots(figsize=(10, 0.3 * max(4, len(spans)) + 1))
    for row, slot in enumerate(sorted(spans)):
        for start, end, role, borrowed in spans[slot]:
            ax.barh(
                row,
                end - start,
                left=start,
                height=0.8,
                color=_STATE_COLORS.get((role, borrowed), "#999999"),
            )
    ax.set_yticks(range(len(spans)))
    ax.set_yticklabels([f"slot {s}" for s in sorted(spans)], fontsize=6)
    ax.set_xlabel("time (s)")
    ax.set_title(f"{name}: active workers (blue P, orange D, green C; light = borrowed)")
    save_figure(plt, fig, path)
