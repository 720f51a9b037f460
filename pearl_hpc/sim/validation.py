"""Where the simulator lands on PEARL's motivation measurements (PEARL.md sections 1, 7).

Every figure is measured by running the simulator (nothing here feeds back into the
model): each row gives PEARL's number, ours, the tolerance we hold ourselves to and
whether we are inside it. The last rows check the decision engine's hysteresis against
the predictor's measured error: of the switches it would make (a predicted gain above
``mode_switch_threshold`` / ``ratio_switch_threshold`` between two static configurations),
the share whose measured makespan really is shorter. Run: ``pearl-hpc calibrate-sim
[--router sticky|shortest-queue] [--workload swe-bench-pearl-mix]``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl_hpc.core.predictor import predict
from pearl_hpc.sim.costmodel import CostModel
from pearl_hpc.sim.engine import Simulator
from pearl_hpc.sim.run import DEFAULT_WORKLOAD, SimRequest, simulate

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
    workload: str | Path,
    *,
    batch: int | None = None,
    training_gpus: int = 16,
    sweep: bool = False,
    keep: dict[str, Simulator] | None = None,
) -> dict[str, Any]:
    req = SimRequest(
        model=model,
        segment=None,
        rollout_gpus=gpus,
        duration_s=DURATION_S,
        systems=["pd-only"] if sweep else ["static-coloc"],
        sweep_static=sweep,
        router=router,
        workload_path=workload,
        batch_size=batch,
        training_gpus=training_gpus,
    )
    return simulate(req, keep=keep)


def _rollout_s(doc: dict[str, Any], system: str = "static-coloc") -> float:
    steps = doc["systems"][system]["per_step"]
    # a batch's rollout: from its release to its last trajectory (the first, cold one skipped)
    return statistics.fmean(s["rollout_s"] for s in steps[1:] or steps)


@dataclass(frozen=True)
class Difference:
    """Two static configurations' relative makespan difference, predicted and measured."""

    predicted: float
    measured: float
    change: str  # "mode" | "P:D ratio": what switching between the two changes
    threshold: float  # the predicted gain the decision engine needs for that change


Fixed = Callable[..., dict[str, Any]]  # (model, gpus, **SimRequest fields) -> document


def run(
    router: str = "own",
    workload: str | Path = DEFAULT_WORKLOAD,
    progress: Callable[[str], None] | None = None,
) -> list[Figure]:
    """Every figure, in PEARL.md's order; ``progress`` is told what runs next."""
    say = progress or (lambda _msg: None)

    def fixed(model: str, gpus: int, **kw: Any) -> dict[str, Any]:
        return _fixed(model, gpus, router, workload, **kw)

    figures: list[Figure] = []
    say("scaling 16 -> 24 -> 32 rollout GPUs (Qwen3-8B)")
    figures += _scaling(fixed)
    say("rollout vs training step, 32 rollout + 8 training GPUs (Qwen3-8B)")
    figures += _rollout_vs_training(fixed)
    say("idealised unlimited scale-out (Qwen3-8B, 1 trajectory per worker)")
    figures += _idealised(fixed)
    say("prefill's share of tokens and time, Qwen3-30B-A3B colocated on 16 GPUs")
    figures += _prefill_share(fixed)
    say("decode throughput, Qwen3-30B-A3B colocated on 16 GPUs")
    figures += _decode_rate()
    say("colocated vs best disaggregated, Qwen3-30B-A3B on 16 GPUs")
    crossover, errors = _crossover(fixed)
    return figures + crossover + _hysteresis(errors)


def _scaling(fixed: Fixed) -> list[Figure]:
    times = {g: _rollout_s(fixed("qwen3-8b", g, training_gpus=8)) for g in (16, 24, 32)}
    cut24 = 1 - times[24] / times[16]
    cut32 = (times[24] - times[32]) / times[16]
    return [
        Figure(
            "rollout time cut 16->24 GPUs (8B)",
            "10.3%",
            f"{100 * cut24:.1f}%",
            "+-5 points",
            abs(cut24 - 0.103) <= 0.05,
        ),
        Figure(
            "further cut 24->32 GPUs, of the 16-GPU time (8B)",
            "8.9%",
            f"{100 * cut32:.1f}%",
            "+-5 points",
            abs(cut32 - 0.089) <= 0.05,
        ),
    ]


def _rollout_vs_training(fixed: Fixed) -> list[Figure]:
    doc = fixed("qwen3-8b", 32, training_gpus=8)
    steps = doc["systems"]["static-coloc"]["per_step"]
    cost = CostModel.from_names("h800", "qwen3-8b")
    train_s = statistics.fmean(cost.training_step_s(s["trained_tokens"], 8) for s in steps)
    ratio = _rollout_s(doc) / train_s
    return [
        Figure(
            "rollout / training step (8B, 8 training GPUs)",
            "4.5-5.7x",
            f"{ratio:.1f}x",
            "3.5-6.7x",
            3.5 <= ratio <= 6.7,
        ),
        Figure(
            "training step (8B, 8 GPUs)",
            "163.8 s",
            f"{train_s:.1f} s",
            "+-50%",
            abs(train_s / 163.8 - 1) <= 0.5,
        ),
    ]


def _idealised(fixed: Fixed) -> list[Figure]:
    ideal = _rollout_s(fixed("qwen3-8b", 2 * 64 * 2, training_gpus=8))
    return [
        Figure(
            "idealised rollout (8B)",
            "216.3 s",
            f"{ideal:.1f} s",
            "+-30%",
            abs(ideal / 216.3 - 1) <= 0.3,
        )
    ]


def _prefill_share(fixed: Fixed) -> list[Figure]:
    """PEARL.md section 1: with colocation prefill handled 96.68% of the tokens in 26.48% of
    the time (ours: tokens prefilled over prefilled + generated; worker time in iterations
    that carry a prefill chunk over all busy worker time)."""
    coloc = fixed("qwen3-30b-a3b", 16)["systems"]["static-coloc"]
    tokens, time = coloc["prefill_token_share"], coloc["prefill_time_share"]
    return [
        Figure(
            "prefilled share of tokens, colocated (30B)",
            "96.7%",
            f"{100 * tokens:.1f}%",
            "+-5 points",
            abs(tokens - 0.9668) <= 0.05,
        ),
        Figure(
            "time in prefill iterations, colocated (30B)",
            "26.5%",
            f"{100 * time:.1f}%",
            "+-10 points",
            abs(time - 0.2648) <= 0.10,
        ),
    ]


def _decode_rate() -> list[Figure]:
    cost30 = CostModel.from_names("h800", "qwen3-30b-a3b")
    per_worker = 64 // 8
    tok_s_gpu = per_worker / cost30.decode_iteration_s(per_worker, per_worker * 16384) / cost30.tp
    return [
        Figure(
            "decode tokens/s/GPU (30B, 8 seqs of 16K per worker)",
            "~400",
            f"{tok_s_gpu:.0f}",
            "+-25%",
            abs(tok_s_gpu / 400 - 1) <= 0.25,
        )
    ]


def _crossover(fixed: Fixed) -> tuple[list[Figure], list[Difference]]:
    """The figures, and every predicted and measured makespan difference of two static
    configurations (for :func:`_hysteresis`)."""
    paper = {32: 0.097, 80: 0.014, 96: -0.061}
    best_ratio = {48: "4P4D", 64: "5P3D"}
    figures = []
    errors: list[Difference] = []
    for batch in (32, 48, 64, 80, 96):
        keep: dict[str, Simulator] = {}
        doc = fixed("qwen3-30b-a3b", 16, batch=batch, sweep=True, keep=keep)
        errors += _differences(doc, keep["pd-only"])
        sweep = doc["systems"]
        coloc = sweep["static-coloc"]["throughput_tokens_per_s"]
        splits = {
            n: r["throughput_tokens_per_s"]
            for n, r in sweep.items()
            if n.startswith("static-") and n != "static-coloc"
        }
        best = max(splits, key=lambda n: splits[n])
        gain = splits[best] / coloc - 1
        ours = best.removeprefix("static-")
        if batch in paper:
            figures.append(
                Figure(
                    f"best split vs colocated, batch {batch} (30B)",
                    f"{100 * paper[batch]:+.1f}%",
                    f"{100 * gain:+.1f}% ({ours})",
                    "same sign",
                    (gain > 0) == (paper[batch] > 0),
                )
            )
        else:
            figures.append(
                Figure(
                    f"best ratio, batch {batch} (30B)",
                    best_ratio[batch],
                    f"{ours} ({100 * gain:+.1f}% vs colocated)",
                    "exact",
                    ours == best_ratio[batch],
                )
            )
    return figures, errors


def _config(name: str, workers: int) -> tuple[int, int, int]:
    """(P, D, colocated) of a static system's name."""
    if name == "static-coloc":
        return 0, 0, workers
    p, d = name.removeprefix("static-").removesuffix("D").split("P")
    return int(p), int(d), 0


def _differences(doc: dict[str, Any], pd_only: Simulator) -> list[Difference]:
    """Predicted (by the profile pd-only's controller fitted) and measured makespan of every
    static configuration, as relative differences of each pair."""
    profile = pd_only.controller.profile
    workers = doc["rollout_gpus"] // doc["tp"]
    names = [n for n in doc["systems"] if n.startswith("static-")]
    predicted = {n: predict(profile, *_config(n, workers)) for n in names}
    measured = {n: _rollout_s(doc, n) for n in names}
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            mode = (a == "static-coloc") != (b == "static-coloc")
            out.append(
                Difference(
                    predicted[a] / predicted[b] - 1,
                    measured[a] / measured[b] - 1,
                    "mode" if mode else "P:D ratio",
                    profile.mode_switch_threshold if mode else profile.ratio_switch_threshold,
                )
            )
    return out


def _hysteresis(differences: list[Difference]) -> list[Figure]:
    """The decision engine switches only for a predicted gain above a threshold, so what
    must hold is: a switch predicted to gain more than the threshold really gains. Over
    every pair of static configurations, the share that does (and the predictor's median
    error on the difference, for scale)."""
    figures = []
    for change in ("mode", "P:D ratio"):
        group = [d for d in differences if d.change == change]
        threshold = group[0].threshold
        errs = sorted(abs(d.predicted - d.measured) for d in group)
        switches = [d for d in group if abs(d.predicted) > threshold]
        right = sum((d.predicted > 0) == (d.measured > 0) for d in switches)
        share = right / len(switches) if switches else 1.0
        figures.append(
            Figure(
                f"{change} switches predicted to gain > {100 * threshold:.0f}% that gain (30B)",
                "-",
                f"{right}/{len(switches)} (median error {100 * statistics.median(errs):.1f} "
                "points)",
                ">= 90%",
                share >= 0.9,
            )
        )
    return figures
