"""The PD decision engine (PEARL.md section 4).

For ``N_k`` rollout workers: score colocation and every disaggregated split
``N_P in [1, N_k-1]`` with the predictor, drop infeasible splits, and pick the lowest
predicted makespan. Ties go to colocation, then to the smaller ``N_P``.

Hysteresis is mode-dependent. The *incumbent* is the best configuration in the current
mode reachable with **zero role changes** of the surviving workers (new workers take any
role for free; removed workers leave from any role). The engine leaves the incumbent only
if the best candidate improves the predicted makespan by more than
``mode_switch_threshold`` (colocated <-> disaggregated) or ``ratio_switch_threshold``
(a new P:D split), relative to the incumbent. When no incumbent exists — the current
topology is infeasible or impossible (e.g. no decode worker can be left) — the switch is
forced and bypasses hysteresis. ``N_k = 1`` means colocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pearl_hpc.core import predictor
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.types import Mode, PDConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    config: PDConfig
    feasible: bool
    predicted_makespan_s: float
    infeasible_reason: str = ""  # "kv" (decode KV capacity) and/or "prefill" (queueing)

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.config.mode.value,
            "num_prefill": self.config.num_prefill,
            "num_decode": self.config.num_decode,
            "num_colocated": self.config.num_colocated,
            "feasible": self.feasible,
            "predicted_makespan_s": self.predicted_makespan_s,
            "infeasible_reason": self.infeasible_reason,
        }


@dataclass(frozen=True)
class Decision:
    """A target configuration, the candidates scored for it and why it was chosen."""

    target: PDConfig
    predicted_makespan_s: float
    switch: bool  # target leaves the current mode or P:D split (not just a resize)
    forced: bool  # hysteresis bypassed: the current topology is infeasible or impossible
    reason: str
    incumbent: PDConfig | None = None
    # candidates as arrays (materialised on demand: thousands of workers are cheap)
    coloc_makespan_s: float = field(default=float("nan"), compare=False)
    _num_prefill: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.int64), compare=False
    )
    _makespan_s: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False)
    _kv_ok: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), compare=False)
    _prefill_ok: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), compare=False)

    @property
    def num_workers(self) -> int:
        return self.target.total

    @property
    def candidates(self) -> list[Candidate]:
        """Colocated first, then every disaggregated split by increasing ``N_P``."""
        out: list[Candidate] = []
        n = self.target.total
        if n >= 1 and not np.isnan(self.coloc_makespan_s):
            out.append(Candidate(PDConfig.colocated(n), True, self.coloc_makespan_s))
        for num_p, t, kv, pre in zip(
            self._num_prefill.tolist(),
            self._makespan_s.tolist(),
            self._kv_ok.tolist(),
            self._prefill_ok.tolist(),
            strict=True,
        ):
            why = ",".join(w for w, ok in (("kv", kv), ("prefill", pre)) if not ok)
            out.append(Candidate(PDConfig(num_p, n - num_p, 0), kv and pre, t, why))
        return out


def needs_switch(current: PDConfig | None, target: PDConfig) -> bool:
    """Does reaching ``target`` from ``current`` change a mode or re-role a survivor?
    (A resize that only adds or removes workers is not a switch.)"""
    if current is None or current.total == 0 or target.total == 0:
        return False
    if current.mode is not target.mode:
        return True
    if target.mode is Mode.COLOCATED:
        return False
    delta = target.total - current.total
    lo, hi = sorted((current.num_prefill, current.num_prefill + delta))
    return not lo <= target.num_prefill <= hi


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


@dataclass(frozen=True)
class _Scores:
    """Every candidate for ``n`` workers, scored once: colocation and each split N_P in
    [1, n-1] with its makespan and feasibility (numpy arrays indexed by N_P - 1)."""

    n: int
    coloc_t: float
    makespan: np.ndarray
    feasible: np.ndarray
    arrays: dict[str, Any]  # what the Decision carries for reports

    @classmethod
    def of(cls, profile: WorkloadProfile, n: int) -> _Scores:
        coloc_t = float(predictor.t_coloc(profile, n))
        num_p = np.arange(1, n, dtype=np.int64)
        num_d = n - num_p
        makespan = np.asarray(predictor.t_dis(profile, num_p, num_d), dtype=float)
        kv_ok = np.asarray(predictor.kv_feasible(profile, num_d), dtype=bool)
        pre_ok = np.asarray(predictor.prefill_feasible(profile, num_p, num_d), dtype=bool)
        arrays = {
            "coloc_makespan_s": coloc_t,
            "_num_prefill": num_p,
            "_makespan_s": makespan,
            "_kv_ok": kv_ok,
            "_prefill_ok": pre_ok,
        }
        return cls(n, coloc_t, makespan, kv_ok & pre_ok, arrays)

    @property
    def num_feasible(self) -> int:
        return int(self.feasible.sum())

    def best_disagg(self, lo: int, hi: int) -> tuple[PDConfig, float] | None:
        """Best feasible split with ``lo <= N_P <= hi`` (smallest N_P on ties)."""
        n = self.n
        lo, hi = max(lo, 1), min(hi, n - 1)
        if lo > hi:
            return None
        window = np.where(self.feasible[lo - 1 : hi], self.makespan[lo - 1 : hi], np.inf)
        i = int(np.argmin(window))
        if not np.isfinite(window[i]):
            return None
        return PDConfig(lo + i, n - lo - i, 0), float(window[i])

    def incumbent(self, current: PDConfig) -> tuple[PDConfig, float] | None:
        """The best configuration in ``current``'s mode with zero role changes for the
        survivors (new workers take any role, removed ones leave from any role)."""
        if current.mode is Mode.COLOCATED:
            return PDConfig.colocated(self.n), self.coloc_t
        delta = self.n - current.total
        if delta >= 0:
            lo, hi = current.num_prefill, current.num_prefill + delta
        else:
            lo, hi = current.num_prefill + delta, current.num_prefill
        return self.best_disagg(lo, hi)


def decide(
    profile: WorkloadProfile,
    num_workers: int,
    current: PDConfig | None = None,
    *,
    ratio_switch_threshold: float | None = None,
    mode_switch_threshold: float | None = None,
) -> Decision:
    """Choose the PD configuration for ``num_workers`` rollout workers.

    ``current`` is the configuration of the workers that survive (after forced removals);
    its total may differ from ``num_workers`` when capacity was granted or reclaimed.
    Thresholds default to the profile's.
    """
    ratio_thr = (
        profile.ratio_switch_threshold if ratio_switch_threshold is None else ratio_switch_threshold
    )
    mode_thr = (
        profile.mode_switch_threshold if mode_switch_threshold is None else mode_switch_threshold
    )
    n = int(num_workers)
    if n <= 0:
        return Decision(
            PDConfig(),
            float("inf"),
            False,
            current is not None and current.total > 0,
            "no rollout worker available",
            current,
        )

    scores = _Scores.of(profile, n)
    coloc_t, arrays = scores.coloc_t, scores.arrays

    # Unconstrained best (colocation wins ties).
    best, best_t = PDConfig.colocated(n), coloc_t
    dis = scores.best_disagg(1, n - 1)
    if dis is not None and dis[1] < coloc_t:
        best, best_t = dis
    scored = f"{n - 1} split(s), {scores.num_feasible} feasible, + colocated"

    if current is None or current.total == 0:
        reason = f"no current configuration: best of {scored} is {best} ({best_t:.1f} s)"
        return Decision(best, best_t, False, False, reason, None, **arrays)  # type: ignore[arg-type]

    incumbent = scores.incumbent(current)
    if incumbent is None:
        why = (
            "a single worker can only run colocated"
            if n == 1
            else f"no feasible {current.mode.value} split of {n} workers keeps every "
            f"surviving role of {current}"
        )
        reason = f"forced switch from {current}: {why}; best of {scored} is {best} ({best_t:.1f} s)"
        return Decision(best, best_t, True, True, reason, None, **arrays)  # type: ignore[arg-type]

    inc_cfg, inc_t = incumbent
    if best == inc_cfg:
        reason = (
            f"keep {current.mode.value} as {inc_cfg} ({inc_t:.1f} s): it is the best of {scored}"
        )
        return Decision(inc_cfg, inc_t, False, False, reason, inc_cfg, **arrays)  # type: ignore[arg-type]

    gain = (inc_t - best_t) / inc_t if inc_t > 0 else 0.0
    mode_change = best.mode is not inc_cfg.mode
    threshold, kind = (mode_thr, "mode-switch") if mode_change else (ratio_thr, "ratio-change")
    if gain > threshold:
        reason = (
            f"switch {current} -> {best}: predicted {best_t:.1f} s vs {inc_t:.1f} s for "
            f"{inc_cfg} (-{_pct(gain)}) beats the {kind} threshold {_pct(threshold)}"
        )
        return Decision(best, best_t, True, False, reason, inc_cfg, **arrays)  # type: ignore[arg-type]
    reason = (
        f"keep {inc_cfg}: best alternative {best} improves the predicted makespan by only "
        f"{_pct(gain)} ({best_t:.1f} s vs {inc_t:.1f} s), within the {kind} threshold "
        f"{_pct(threshold)}"
    )
    return Decision(inc_cfg, inc_t, False, False, reason, inc_cfg, **arrays)  # type: ignore[arg-type]
