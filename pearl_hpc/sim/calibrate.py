"""Where the simulator lands on PEARL's motivation measurements (PEARL.md sections 1, 7).

Every figure is measured by running the simulator (nothing here feeds back into the
model): each row gives PEARL's number, ours, the tolerance we hold ourselves to and
whether we are inside it. Run: ``pearl-hpc calibrate-sim [--router sticky|shortest-queue]``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pearl_hpc.sim.costmodel import CostModel
from pearl_hpc.sim.run import SimRequest, simulate

DURATION_S = 7200.0


@dataclass(frozen=True)
class Figure:
    name: str
    paper: str
    ours: str
    tolerance: str
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "paper": self.paper,
            "ours": self.ours,
            "tolerance": self.tolerance,
            "within": self.ok,
        }


def _fixed(
    model: str,
    gpus: int,
    router: str,
    *,
    batch: int | None = None,
    training_gpus: int = 16,
    sweep: bool = False,
) -> dict[str, Any]:
    req = SimRequest(
        model=model,
        segment=None,
        rollout_gpus=gpus,
        duration_s=DURATION_S,
        systems=["pd-only"] if sweep else ["static-coloc"],
        sweep_static=sweep,
        router=router,
        batch_size=batch,
        training_gpus=training_gpus,
    )
    return simulate(req)


def _rollout_s(doc: dict[str, Any], system: str = "static-coloc") -> float:
    steps = doc["systems"][system]["per_step"]
    # a batch's rollout: from its release to its last trajectory (the first, cold one skipped)
    return statistics.fmean(s["rollout_s"] for s in steps[1:] or steps)


def run(router: str = "own", progress: Callable[[str], None] | None = None) -> list[Figure]:
    say = progress or (lambda _msg: None)
    figures: list[Figure] = []

    say("scaling 16 -> 24 -> 32 rollout GPUs (Qwen3-8B)")
    times = {g: _rollout_s(_fixed("qwen3-8b", g, router, training_gpus=8)) for g in (16, 24, 32)}
    cut24 = 1 - times[24] / times[16]
    cut32 = (times[24] - times[32]) / times[16]
    figures.append(
        Figure(
            "rollout time cut 16->24 GPUs (8B)",
            "10.3%",
            f"{100 * cut24:.1f}%",
            "+-5 points",
            abs(cut24 - 0.103) <= 0.05,
        )
    )
    figures.append(
        Figure(
            "further cut 24->32 GPUs, of the 16-GPU time (8B)",
            "8.9%",
            f"{100 * cut32:.1f}%",
            "+-5 points",
            abs(cut32 - 0.089) <= 0.05,
        )
    )

    say("rollout vs training step, 32 rollout + 8 training GPUs (Qwen3-8B)")
    doc = _fixed("qwen3-8b", 32, router, training_gpus=8)
    steps = doc["systems"]["static-coloc"]["per_step"]
    cost = CostModel.from_names("h800", "qwen3-8b")
    train_s = statistics.fmean(cost.training_step_s(s["trained_tokens"], 8) for s in steps)
    ratio = _rollout_s(doc) / train_s
    figures.append(
        Figure(
            "rollout / training step (8B, 8 training GPUs)",
            "4.5-5.7x",
            f"{ratio:.1f}x",
            "3.5-6.7x",
            3.5 <= ratio <= 6.7,
        )
    )
    figures.append(
        Figure(
            "training step (8B, 8 GPUs)",
            "163.8 s",
            f"{train_s:.1f} s",
            "+-50%",
            abs(train_s / 163.8 - 1) <= 0.5,
        )
    )

    say("idealised unlimited scale-out (Qwen3-8B, 1 trajectory per worker)")
    ideal = _rollout_s(_fixed("qwen3-8b", 2 * 64 * 2, router, training_gpus=8))
    figures.append(
        Figure(
            "idealised rollout (8B)",
            "216.3 s",
            f"{ideal:.1f} s",
            "+-30%",
            abs(ideal / 216.3 - 1) <= 0.3,
        )
    )

    say("decode throughput, Qwen3-30B-A3B colocated on 16 GPUs")
    cost30 = CostModel.from_names("h800", "qwen3-30b-a3b")
    per_worker = 64 // 8
    tok_s_gpu = per_worker / cost30.decode_iteration_s(per_worker, per_worker * 16384) / cost30.tp
    figures.append(
        Figure(
            "decode tokens/s/GPU (30B, 8 seqs of 16K per worker)",
            "~400",
            f"{tok_s_gpu:.0f}",
            "+-25%",
            abs(tok_s_gpu / 400 - 1) <= 0.25,
        )
    )

    say("colocated vs best disaggregated, Qwen3-30B-A3B on 16 GPUs")
    paper = {32: 0.097, 80: 0.014, 96: -0.061}
    best_ratio = {48: "4P4D", 64: "5P3D"}
    for batch in (32, 48, 64, 80, 96):
        sweep = _fixed("qwen3-30b-a3b", 16, router, batch=batch, sweep=True)["systems"]
        coloc = sweep["static-coloc"]["throughput_tokens_per_s"]
        splits = {
            n: r["throughput_tokens_per_s"]
            for n, r in sweep.items()
            if n.startswith("static-") and n != "static-coloc"
        }
        best = max(splits, key=lambda n: splits[n])
        gain = splits[best] / coloc - 1
        if batch in paper:
            same_sign = (gain > 0) == (paper[batch] > 0)
            figures.append(
                Figure(
                    f"best split vs colocated, batch {batch} (30B)",
                    f"{100 * paper[batch]:+.1f}%",
                    f"{100 * gain:+.1f}% ({best.removeprefix('static-')})",
                    "same sign",
                    same_sign,
                )
            )
        else:
            ours = best.removeprefix("static-")
            figures.append(
                Figure(
                    f"best ratio, batch {batch} (30B)",
                    best_ratio[batch],
                    f"{ours} ({100 * gain:+.1f}% vs colocated)",
                    "exact",
                    ours == best_ratio[batch],
                )
            )
    return figures
