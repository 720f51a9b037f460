"""Cost-aware policies behind small interfaces, chosen by config (PEARL.md section 6).

- PD policy: which configuration to run on ``N_k`` workers (adaptive decision engine,
  fixed colocation, fixed P:D ratio) — the simulator's ablations swap these.
- Borrowing policy: whether to borrow idle training GPUs for rollout between updates
  (never, always, or gated by ``(R/B)(T_ded - T_full) > T_toggle``). Returning them at
  Training Begin is not a policy: it is mandatory and done by the controller.
- Expansion policy: whether to admit newly granted elastic capacity (always, or only
  when the predicted saving over the expected window exceeds preparation +
  finalisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from pearl_hpc.core import decision as decision_mod
from pearl_hpc.core import predictor
from pearl_hpc.core.decision import Decision, needs_switch
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.schema import from_mapping, spec_field
from pearl_hpc.core.types import PDConfig


# --------------------------------------------------------------------------- PD policies
class PDPolicy(Protocol):
    name: str

    def decide(
        self, profile: WorkloadProfile, num_workers: int, current: PDConfig | None
    ) -> Decision: ...


class AdaptivePD:
    """PEARL's decision engine: argmin of the predictor with mode-dependent hysteresis."""

    name = "adaptive"

    def decide(
        self, profile: WorkloadProfile, num_workers: int, current: PDConfig | None
    ) -> Decision:
        return decision_mod.decide(profile, num_workers, current)


class FixedColocatedPD:
    """Always colocated on every available worker (ROLL, RLBoost+ and ``pd``-less ablations)."""

    name = "colocated"

    def decide(
        self, profile: WorkloadProfile, num_workers: int, current: PDConfig | None
    ) -> Decision:
        n = max(0, num_workers)
        target = PDConfig.colocated(n)
        t = float(predictor.t_coloc(profile, n)) if n else math.inf
        switch = needs_switch(current, target)
        return Decision(target, t, switch, False, f"fixed colocated policy: {target}", current, t)


class FixedRatioPD:
    """Disaggregated with ``N_P = round(prefill_fraction * N_k)`` clamped to
    ``[1, N_k - 1]`` (ties of round() go to the even integer); colocated when N_k = 1."""

    name = "fixed-ratio"

    def __init__(self, prefill_fraction: float) -> None:
        if not 0 < prefill_fraction < 1:
            raise ValueError(f"prefill_fraction must be in (0, 1), got {prefill_fraction}")
        self.prefill_fraction = prefill_fraction

    def decide(
        self, profile: WorkloadProfile, num_workers: int, current: PDConfig | None
    ) -> Decision:
        n = max(0, num_workers)
        if n <= 1:
            return FixedColocatedPD().decide(profile, n, current)
        num_p = min(n - 1, max(1, round(self.prefill_fraction * n)))
        target = PDConfig(num_p, n - num_p, 0)
        t = predictor.predict(profile, num_p, n - num_p, 0)
        reason = f"fixed ratio policy ({self.prefill_fraction:.2f} prefill): {target}"
        return Decision(target, t, needs_switch(current, target), False, reason, current)


# ----------------------------------------------------------------------- borrowing
@dataclass(frozen=True, slots=True)
class BorrowInputs:
    unfinished_trajectories: int  # R
    batch_size: int  # B
    dedicated_makespan_s: float  # T_ded: predicted makespan on dedicated GPUs only
    full_makespan_s: float  # T_full: predicted makespan with all training GPUs borrowed
    toggle_cost_s: float  # T_toggle: activation + return cost (online estimate)


@dataclass(frozen=True, slots=True)
class GateDecision:
    allow: bool
    benefit_s: float
    cost_s: float
    reason: str


class BorrowingPolicy(Protocol):
    name: str

    def allow(self, inputs: BorrowInputs) -> GateDecision: ...


class NoBorrowing:
    """Never borrow training GPUs."""

    name = "none"

    def allow(self, inputs: BorrowInputs) -> GateDecision:
        return GateDecision(False, 0.0, inputs.toggle_cost_s, "borrowing disabled")


class UngatedBorrowing:
    """Borrow whenever training GPUs are idle (the ``pd+toggle`` ablation)."""

    name = "ungated"

    def allow(self, inputs: BorrowInputs) -> GateDecision:
        benefit = _borrow_benefit_s(inputs)
        return GateDecision(True, benefit, inputs.toggle_cost_s, "ungated borrowing")


class GatedBorrowing:
    """Borrow only when ``(R/B) * (T_ded - T_full) > T_toggle``; ties do not borrow."""

    name = "gated"

    def allow(self, inputs: BorrowInputs) -> GateDecision:
        benefit = _borrow_benefit_s(inputs)
        ok = benefit > inputs.toggle_cost_s
        verb = "borrow" if ok else "do not borrow"
        reason = (
            f"{verb}: (R/B)(T_ded-T_full) = ({inputs.unfinished_trajectories}/"
            f"{inputs.batch_size})({inputs.dedicated_makespan_s:.1f}-"
            f"{inputs.full_makespan_s:.1f}) = {benefit:.2f} s "
            f"{'>' if ok else '<='} T_toggle {inputs.toggle_cost_s:.2f} s"
        )
        return GateDecision(ok, benefit, inputs.toggle_cost_s, reason)


def _borrow_benefit_s(inputs: BorrowInputs) -> float:
    if inputs.batch_size <= 0:
        return 0.0
    gap = inputs.dedicated_makespan_s - inputs.full_makespan_s
    if not math.isfinite(gap):  # no dedicated worker at all: borrowing is all there is
        return math.inf if inputs.unfinished_trajectories > 0 else 0.0
    return inputs.unfinished_trajectories / inputs.batch_size * gap


class ToggleCostEstimator:
    """Online ``T_toggle``: EMAs over steps with and without borrowing.

    A borrowing step contributes ``activation_s + deactivation_s + training_wait_s``; a
    step without borrowing contributes its ``training_wait_s`` (what training waits for
    anyway, e.g. weight sync). The estimate is the difference, never below zero, and
    starts from the configured seed."""

    def __init__(self, seed_s: float, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.with_borrow_s = seed_s
        self.without_borrow_s = 0.0

    @property
    def estimate_s(self) -> float:
        return max(0.0, self.with_borrow_s - self.without_borrow_s)

    def observe(
        self,
        *,
        borrowed: bool,
        training_wait_s: float,
        activation_s: float = 0.0,
        deactivation_s: float = 0.0,
    ) -> None:
        if borrowed:
            sample = activation_s + deactivation_s + training_wait_s
            self.with_borrow_s += self.alpha * (sample - self.with_borrow_s)
        else:
            self.without_borrow_s += self.alpha * (training_wait_s - self.without_borrow_s)

    def to_dict(self) -> dict[str, float]:
        return {
            "alpha": self.alpha,
            "with_borrow_s": self.with_borrow_s,
            "without_borrow_s": self.without_borrow_s,
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.alpha = float(data["alpha"])
        self.with_borrow_s = float(data["with_borrow_s"])
        self.without_borrow_s = float(data["without_borrow_s"])


# ----------------------------------------------------------------------- expansion
@dataclass(frozen=True, slots=True)
class ExpansionInputs:
    current_makespan_s: float  # predicted makespan with the workers we have
    expanded_makespan_s: float  # ... with the newly granted capacity added
    expected_window_s: float  # how long the new capacity is expected to stay
    preparation_s: float  # background start-up (inter-scale preparation)
    finalisation_s: float  # admission pause (inter-scale finalisation)
    # the joiner prepares and catches up in its own background (policy.prewarm): the
    # serving workers pay nothing, so preparation only shortens the window it serves in
    warm: bool = False


class ExpansionPolicy(Protocol):
    name: str

    def allow(self, inputs: ExpansionInputs) -> GateDecision: ...


class AlwaysExpand:
    """Admit every grant (RLBoost+ behaviour)."""

    name = "always"

    def allow(self, inputs: ExpansionInputs) -> GateDecision:
        cost = inputs.preparation_s + inputs.finalisation_s
        return GateDecision(True, _expansion_saving_s(inputs), cost, "expansion always admitted")


class GatedExpansion:
    """Admit only when the predicted saving over the window usable after preparation,
    ``max(0, window - preparation) * (1 - T_new/T_cur)``, exceeds preparation +
    finalisation (PEARL); ties reject. A warm joiner (``inputs.warm``) costs the serving
    workers nothing: it is admitted when it saves anything, i.e. when the capacity is
    expected to outlast its preparation."""

    name = "gated"

    def allow(self, inputs: ExpansionInputs) -> GateDecision:
        saving = _expansion_saving_s(inputs)
        cost = 0.0 if inputs.warm else inputs.preparation_s + inputs.finalisation_s
        ok = saving > cost
        what = "a warm join" if inputs.warm else "preparation + finalisation"
        reason = (
            f"{'admit' if ok else 'reject'} expansion: saving {saving:.1f} s over a "
            f"{inputs.expected_window_s:.0f} s window {'>' if ok else '<='} "
            f"{what} {cost:.1f} s"
        )
        return GateDecision(ok, saving, cost, reason)


def _expansion_saving_s(inputs: ExpansionInputs) -> float:
    if not math.isfinite(inputs.current_makespan_s):
        return math.inf  # nothing runs now: any capacity helps
    if inputs.current_makespan_s <= 0:
        return 0.0
    speedup = max(0.0, 1.0 - inputs.expanded_makespan_s / inputs.current_makespan_s)
    return max(0.0, inputs.expected_window_s - inputs.preparation_s) * speedup


# -------------------------------------------------------------------------- config
class PDPolicyName(StrEnum):
    ADAPTIVE = "adaptive"
    COLOCATED = "colocated"
    FIXED_RATIO = "fixed-ratio"


class BorrowingName(StrEnum):
    NONE = "none"
    UNGATED = "ungated"
    GATED = "gated"


class ExpansionName(StrEnum):
    ALWAYS = "always"
    GATED = "gated"


@dataclass(frozen=True)
class PolicyConfig:
    """The controller's policies and their costs (``policy:`` in a controller YAML)."""

    pd_policy: PDPolicyName = spec_field(
        "adaptive | colocated | fixed-ratio", default=PDPolicyName.ADAPTIVE
    )
    prefill_fraction: float = spec_field(
        "fixed-ratio only: share of workers in prefill", default=0.5, gt=0, le=0.99
    )
    borrowing: BorrowingName = spec_field("none | ungated | gated", default=BorrowingName.GATED)
    expansion: ExpansionName = spec_field("always | gated", default=ExpansionName.GATED)
    toggle_cost_s: float = spec_field(
        "seed of T_toggle: activation + deactivation, seconds (PEARL: 6.26 + 3.18)",
        default=9.44,
        ge=0,
    )
    toggle_ema_alpha: float = spec_field("EMA weight of T_toggle samples", default=0.3, gt=0, le=1)
    preparation_s: float = spec_field(
        "inter-scale preparation of a new worker, seconds (PEARL: 56.29)", default=56.29, ge=0
    )
    finalisation_s: float = spec_field(
        "inter-scale finalisation (admission pause), seconds (PEARL: 11.05)", default=11.05, ge=0
    )
    expected_capacity_window_s: float = spec_field(
        "how long granted elastic capacity is expected to stay, seconds: the prior of the "
        "window the run then estimates from its own grants and reclaims",
        default=1800.0,
        gt=0,
    )
    tracker_ema_alpha: float = spec_field(
        "EMA weight of each step's profile fit", default=0.5, gt=0, le=1
    )
    tail_start: bool = spec_field(
        "start the next batch's trajectories while this batch's tail runs, once fewer are "
        "left than the serving workers can keep busy (tail_level), within the staleness "
        "bound (PEARL waits for the whole batch)",
        default=False,
    )
    tail_dispatch: bool = spec_field(
        "order each worker's queued turns (prefill and KV admission) by batch, oldest first "
        "(its end gates training), then by predicted remaining work, longest first "
        "(TurnsLeft x the tracker's per-turn cost), then arrival",
        default=False,
    )
    prewarm: bool = spec_field(
        "an elastic worker joins warm: it catches up to the latest weights point to point in "
        "its own background before admission, so finalisation delays that worker only "
        "instead of pausing every worker's admission (PEARL's atomic finalisation, which the "
        "simulator otherwise models; pearl-hpc run's joins are always warm); the expansion "
        "gate then charges its preparation as window it does not serve, not as a cost to "
        "the serving workers",
        default=False,
    )
    local_prefill: bool = spec_field(
        "disaggregated mode: prefill a turn on the decode worker that holds its prefix when "
        "that costs less than moving its KV (prefill_locally; NVIDIA Dynamo's conditional "
        "disaggregation); decode workers then keep prefixes cached",
        default=False,
    )

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "policy") -> PolicyConfig:
        return from_mapping(cls, data, where=where)


@dataclass(frozen=True)
class Policies:
    pd: PDPolicy
    borrowing: BorrowingPolicy
    expansion: ExpansionPolicy


_BORROWING: dict[BorrowingName, type] = {
    BorrowingName.NONE: NoBorrowing,
    BorrowingName.UNGATED: UngatedBorrowing,
    BorrowingName.GATED: GatedBorrowing,
}
_EXPANSION: dict[ExpansionName, type] = {
    ExpansionName.ALWAYS: AlwaysExpand,
    ExpansionName.GATED: GatedExpansion,
}


def make_policies(config: PolicyConfig) -> Policies:
    """The policies a config names (plain strings are accepted as well as the enums)."""
    pd: PDPolicy
    pd_name = PDPolicyName(config.pd_policy)
    if pd_name is PDPolicyName.FIXED_RATIO:
        pd = FixedRatioPD(config.prefill_fraction)
    elif pd_name is PDPolicyName.COLOCATED:
        pd = FixedColocatedPD()
    else:
        pd = AdaptivePD()
    borrowing = _BORROWING[BorrowingName(config.borrowing)]()
    return Policies(pd, borrowing, _EXPANSION[ExpansionName(config.expansion)]())


# ------------------------------------------------------------------- gate inputs
def gate_borrowing_of(
    policies: Policies,
    profile: WorkloadProfile,
    *,
    num_dedicated: int,
    num_lendable: int,
    unfinished: int | None,
    toggle_cost_s: float,
) -> GateDecision:
    """Evaluate the borrowing policy: ``T_ded`` and ``T_full`` are the PD policy's
    predicted makespans on the dedicated workers alone and with every lendable overlap
    worker; ``R`` defaults to the whole batch."""
    ded_t = policies.pd.decide(profile, num_dedicated, None).predicted_makespan_s
    full_t = policies.pd.decide(profile, num_dedicated + num_lendable, None).predicted_makespan_s
    batch = profile.batch_size
    inputs = BorrowInputs(
        batch if unfinished is None else unfinished, batch, ded_t, full_t, toggle_cost_s
    )
    return policies.borrowing.allow(inputs)


def gate_expansion_of(
    policies: Policies,
    config: PolicyConfig,
    profile: WorkloadProfile,
    *,
    num_current: int,
    num_new: int,
    window_s: float,
) -> GateDecision:
    """Evaluate the expansion policy for ``num_new`` granted workers on top of
    ``num_current``, over a stay of ``window_s`` with the configured reconfiguration
    costs."""
    current_t = policies.pd.decide(profile, num_current, None).predicted_makespan_s
    expanded_t = policies.pd.decide(profile, num_current + num_new, None).predicted_makespan_s
    inputs = ExpansionInputs(
        current_t,
        expanded_t,
        window_s,
        config.preparation_s,
        config.finalisation_s,
        warm=config.prewarm,
    )
    return policies.expansion.allow(inputs)


def tail_level(profile: WorkloadProfile, num_workers: int) -> float:
    """Unfinished trajectories below which ``num_workers`` serving workers idle: a worker
    decoding ``n`` sequences runs at ``n / (A + b*n)`` tokens/s, half its bound at
    ``n = A / b`` (the weights' read equals the KV's). Below ``num_workers * A / b`` the
    batch's tail leaves part of every worker unused."""
    if profile.decode_per_seq_s <= 0:
        return float(num_workers)
    return num_workers * max(1.0, profile.decode_fixed_s / profile.decode_per_seq_s)


def prefill_locally(
    profile: WorkloadProfile, uncached_tokens: int, prompt_tokens: int, decoding: int
) -> bool:
    """Conditional disaggregation: prefilling ``uncached_tokens`` on the decode worker
    costs less than prefilling them on a prefill worker and moving the whole prompt's KV
    (``prompt * K / BW``, which only this turn waits for). The local prefill stalls this
    turn and each of the worker's ``decoding`` sequences for ``uncached * t_prefill``
    (the interference disaggregation exists to avoid)."""
    local_s = uncached_tokens * profile.prefill_s_per_token * (1 + decoding)
    transfer_s = prompt_tokens * profile.kv_bytes_per_token / profile.transfer_bytes_per_s
    return local_s <= transfer_s


class TurnsLeft:
    """Expected turns left of a trajectory that has run ``done`` turns: the mean of
    ``T - done`` over the finished trajectories with ``T > done`` (the empirical mean
    residual life); with none of them yet, ``max(1, prior_mean - done)``. Trajectories
    still running are not counted (no censoring correction): early in a run, when only
    short ones have finished, it underestimates what long ones have left."""

    def __init__(self, prior_mean: float) -> None:
        self.prior_mean = prior_mean
        self.counts: dict[int, int] = {}
        self._suffix: tuple[list[int], list[int]] | None = None  # (n, sum T) for T > done

    def observe(self, turns: int) -> None:
        self.counts[turns] = self.counts.get(turns, 0) + 1
        self._suffix = None

    def expected(self, done: int) -> float:
        if self._suffix is None:
            top = max(self.counts, default=0)
            n, total = [0] * (top + 2), [0] * (top + 2)
            for t in range(top, -1, -1):
                n[t] = n[t + 1] + self.counts.get(t + 1, 0)
                total[t] = total[t + 1] + (t + 1) * self.counts.get(t + 1, 0)
            self._suffix = (n, total)
        n, total = self._suffix
        if done < len(n) and n[done]:
            return total[done] / n[done] - done
        return max(1.0, self.prior_mean - done)


def remaining_work_s(profile: WorkloadProfile, turns_left: float) -> float:
    """Predicted seconds of engine work a trajectory still needs: its turns left times
    the tracker's per-turn cost (prefill of the turn's new tokens, decode of its
    response at the fitted per-sequence rate)."""
    per_turn = (
        profile.new_tokens_per_turn * profile.prefill_s_per_token
        + profile.gen_tokens_per_turn * (profile.decode_fixed_s + profile.decode_per_seq_s)
    )
    return turns_left * per_turn


def tail_dispatch_key(
    profile: WorkloadProfile, turns_left: TurnsLeft, step: int, turns_done: int, arrival: int
) -> tuple[int, float, int]:
    """The order of queued turns under ``tail_dispatch`` (smallest first): the older
    batch, then the longest predicted remaining work, then the earlier arrival."""
    return (step, -remaining_work_s(profile, turns_left.expected(turns_done)), arrival)
