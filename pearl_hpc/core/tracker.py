"""Runtime tracker: refit the workload profile from telemetry after each rollout step.

Per step it fits (PEARL.md section 4):
  - ``turns`` (S): turns of the slowest trajectory (the one with the most turns);
  - ``mean_turns`` (S-bar): finished turns per trajectory that finished one;
  - ``env_s`` (T_env): summed environment time of that trajectory;
  - ``new_tokens_per_turn`` (dL), ``gen_tokens_per_turn`` (r): means over turns;
  - ``decode_fixed_s`` (A), ``decode_per_seq_s`` (b): least squares of
    ``wall_s = A + b * num_seqs`` over decode iterations (no prefill tokens), constrained
    to A, b >= 0; needs at least two distinct batch sizes;
  - ``prefill_s_per_token`` (t_prefill): ``sum(wall_s - A - b*num_seqs) /
    sum(prefill_tokens)`` over iterations that prefill (the decode part of a colocated
    mixed iteration removed);
  - ``decode_bubble_ratio`` (theta): ``(1-f)/f`` with ``f`` the fraction of the time
    trajectories were eligible to decode that they spent inside a decode iteration,
    ``sum(num_seqs * wall_s) / sum(generate_s)``: iterations summed over all workers,
    ``generate_s`` over turns (from a turn's request to its response: queueing, prefill,
    KV transfer, decode). A trajectory in an environment step (T_env has its own term)
    or already finished is not a bubble.
Iterations with a NaN, infinite or negative wall time are left out of the fits (theta,
a sum over every iteration, is then not fitted). Each fitted value is smoothed with an
exponential moving average over steps. A value that cannot be fitted (no data, a
degenerate fit, NaN) keeps the previous estimate, which starts at the configured
profile: never zero, never NaN.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pearl_hpc.core.profile import FITTED_FIELDS, WorkloadProfile
from pearl_hpc.core.types import Role

_MIN_DECODE_FRACTION = 0.01  # caps theta at 99 when telemetry shows almost no decoding


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One finished turn of one trajectory."""

    trajectory_id: str
    turn_index: int
    new_input_tokens: int  # observation / prompt tokens added this turn
    generated_tokens: int  # response tokens generated this turn
    context_tokens: int  # tokens kept in context after the turn
    env_s: float  # environment time after this turn's response
    slot_id: int  # worker that decoded the turn
    role: Role  # its role (colocated or decode)
    generate_s: float = 0.0  # request -> response: the turn's time eligible to decode


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One engine iteration (a forward pass over a batch) on one worker."""

    slot_id: int
    role: Role
    num_seqs: int  # sequences decoding in this iteration (prefilling ones not counted)
    context_tokens: int  # total context tokens of those sequences
    prefill_tokens: int  # tokens prefilled in this iteration (0 = pure decode)
    wall_s: float
    count: float = 1.0  # identical iterations this record stands for (aggregated telemetry)


@dataclass(frozen=True)
class StepFit:
    """What one step's telemetry said; None where it could not say."""

    values: dict[str, float | None] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        return [k for k in FITTED_FIELDS if self.values.get(k) is None]


def _ok(x: float | None, *, positive: bool = False) -> bool:
    return x is not None and math.isfinite(x) and (x > 0 if positive else x >= 0)


def fit_step(
    turns: Sequence[TurnRecord],
    iterations: Sequence[IterationRecord],
    *,
    prior_decode_fixed_s: float,
    prior_decode_per_seq_s: float = 0.0,
) -> StepFit:
    """Fit one step's parameters (pure). Unfittable values are None."""
    values: dict[str, float | None] = dict.fromkeys(FITTED_FIELDS)

    if turns:
        per_traj: dict[str, list[TurnRecord]] = defaultdict(list)
        for t in turns:
            per_traj[t.trajectory_id].append(t)
        slowest = max(per_traj.values(), key=lambda ts: (len(ts), sum(t.env_s for t in ts)))
        values["turns"] = float(len(slowest))
        values["mean_turns"] = len(turns) / len(per_traj)
        values["env_s"] = float(sum(t.env_s for t in slowest))
        values["new_tokens_per_turn"] = float(np.mean([t.new_input_tokens for t in turns]))
        values["gen_tokens_per_turn"] = float(np.mean([t.generated_tokens for t in turns]))

    # An iteration without a usable wall time (NaN, inf, negative) is dropped from the
    # fits; max()/min() would otherwise turn NaN into "no busy time" or theta = 99.
    timed = [
        it
        for it in iterations
        if math.isfinite(it.wall_s) and it.wall_s >= 0 and math.isfinite(it.count) and it.count > 0
    ]
    decode = [it for it in timed if it.prefill_tokens == 0 and it.num_seqs > 0]
    a_fit, b_fit = _fit_decode(decode)
    values["decode_fixed_s"], values["decode_per_seq_s"] = a_fit, b_fit

    prefill = [it for it in timed if it.prefill_tokens > 0]
    if prefill:
        fixed = a_fit if _ok(a_fit) else prior_decode_fixed_s
        per_seq = b_fit if _ok(b_fit) else prior_decode_per_seq_s
        assert fixed is not None and per_seq is not None
        tokens = sum(it.prefill_tokens * it.count for it in prefill)
        # the decode part of a mixed (colocated) iteration is not prefill time
        busy = sum(max(0.0, it.wall_s - fixed - per_seq * it.num_seqs) * it.count for it in prefill)
        values["prefill_s_per_token"] = busy / tokens if busy > 0 else None

    # theta sums every iteration: one unusable wall time makes the sum unknowable
    complete = len(timed) == len(iterations)
    eligible_s = sum(t.generate_s for t in turns if math.isfinite(t.generate_s))
    if iterations and complete and eligible_s > 0:
        seq_seconds = sum(it.num_seqs * it.wall_s * it.count for it in iterations)
        f = min(1.0, max(_MIN_DECODE_FRACTION, seq_seconds / eligible_s))
        values["decode_bubble_ratio"] = (1.0 - f) / f

    positive = {"turns", "gen_tokens_per_turn"}
    for key, value in values.items():
        if value is not None and not _ok(value, positive=key in positive):
            values[key] = None
    return StepFit(values)


def _fit_decode(decode: Sequence[IterationRecord]) -> tuple[float | None, float | None]:
    """Non-negative least squares of ``wall = A + b * n``, each record weighted by the
    iterations it stands for (closed form in 1-D)."""
    if len(decode) < 2:
        return None, None
    n = np.array([it.num_seqs for it in decode], dtype=float)
    w = np.array([it.wall_s for it in decode], dtype=float)
    c = np.array([it.count for it in decode], dtype=float)
    if np.ptp(n) == 0:
        return None, None
    root = np.sqrt(c)
    design = np.stack([root, root * n], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, root * w, rcond=None)
    if b < 0:  # best non-negative fit on the boundary b = 0
        a, b = float((c * w).sum() / c.sum()), 0.0
    if a < 0:  # boundary A = 0
        a, b = 0.0, float((c * w * n).sum() / (c * n * n).sum())
    if not (math.isfinite(a) and math.isfinite(b)) or a + b <= 0:
        return None, None
    return float(a), float(b)


class RuntimeTracker:
    """Keeps the smoothed profile; starts at (and falls back to) the configured one."""

    def __init__(self, base: WorkloadProfile, *, ema_alpha: float = 0.5) -> None:
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        self.base = base
        self.ema_alpha = ema_alpha
        self.profile = base
        self.steps_observed = 0
        self.last_fit: StepFit | None = None

    def observe_step(
        self,
        turns: Sequence[TurnRecord],
        iterations: Sequence[IterationRecord],
        *,
        batch_size: int | None = None,
    ) -> StepFit:
        fit = fit_step(
            turns,
            iterations,
            prior_decode_fixed_s=self.profile.decode_fixed_s,
            prior_decode_per_seq_s=self.profile.decode_per_seq_s,
        )
        alpha = self.ema_alpha
        changes: dict[str, Any] = {}
        for key, value in fit.values.items():
            if value is None:
                continue
            old = getattr(self.profile, key)
            new = alpha * value + (1.0 - alpha) * old
            if math.isfinite(new) and new >= 0:
                changes[key] = new
        if batch_size:
            changes["batch_size"] = int(batch_size)
        self.profile = self.profile.replace(**changes)
        self.steps_observed += 1
        self.last_fit = fit
        return fit

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.to_dict(),
            "steps_observed": self.steps_observed,
            "ema_alpha": self.ema_alpha,
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.profile = WorkloadProfile.from_dict(data["profile"], where="journal.profile")
        self.steps_observed = int(data["steps_observed"])
        self.ema_alpha = float(data["ema_alpha"])
