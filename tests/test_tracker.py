"""Runtime tracker (PEARL.md section 4): refit the profile from synthetic telemetry
generated from known parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pearl_hpc.core.profile import FITTED_FIELDS
from pearl_hpc.core.tracker import IterationRecord, RuntimeTracker, TurnRecord, fit_step
from pearl_hpc.core.types import Role
from tests.factories import make_profile

A_TRUE = 0.01  # s per decode iteration
B_TRUE = 0.002  # s per concurrent sequence
TP_TRUE = 1e-4  # s per prefill token


def dec(n: int, wall: float, slot: int = 0) -> IterationRecord:
    return IterationRecord(slot, Role.DECODE, n, 100 * n, 0, wall)


def pre(tokens: int, wall: float, n: int = 0, slot: int = 0) -> IterationRecord:
    """A prefill iteration; ``n`` decoding sequences ride along (colocated, mixed)."""
    return IterationRecord(
        slot, Role.PREFILL if n == 0 else Role.COLOCATED, n, tokens, tokens, wall
    )


def turn(
    traj: str,
    i: int,
    env: float = 0.0,
    new: int = 100,
    gen: int = 50,
    slot: int = 0,
    generate_s: float = 0.0,
) -> TurnRecord:
    return TurnRecord(traj, i, new, gen, (i + 1) * (new + gen), env, slot, Role.DECODE, generate_s)


def synthetic_iterations(noise: float = 0.0, seed: int = 0) -> list[IterationRecord]:
    """Decode iterations wall = A + b*n for n in 1..16 (4 each) and pure prefill
    iterations wall = A + t_prefill*tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for n in range(1, 17):
        for _ in range(4):
            out.append(dec(n, A_TRUE + B_TRUE * n + noise * rng.standard_normal()))
    for tokens in (256, 512, 1024, 2048) * 4:
        out.append(pre(tokens, A_TRUE + TP_TRUE * tokens + noise * rng.standard_normal()))
    return out


def fit(turns=(), iterations=(), *, prior_a=0.008):
    return fit_step(list(turns), list(iterations), prior_decode_fixed_s=prior_a).values


def eligible(*seconds: float) -> list[TurnRecord]:
    """Turns whose requests waited ``seconds`` for their responses (one trajectory each)."""
    return [turn(f"t{k}", 0, generate_s=s) for k, s in enumerate(seconds)]


# ----------------------------------------------------------------- least squares
def test_exact_telemetry_recovers_a_b_and_prefill_cost():
    v = fit(iterations=synthetic_iterations())
    assert v["decode_fixed_s"] == pytest.approx(A_TRUE, rel=1e-9)
    assert v["decode_per_seq_s"] == pytest.approx(B_TRUE, rel=1e-9)
    assert v["prefill_s_per_token"] == pytest.approx(TP_TRUE, rel=1e-9)


def test_mixed_colocated_iterations_leave_decode_cost_out_of_t_prefill():
    its = [it for it in synthetic_iterations() if it.prefill_tokens == 0]
    its += [pre(t, A_TRUE + B_TRUE * n + TP_TRUE * t, n=n) for t in (512, 2048) for n in (2, 9)]
    assert fit(iterations=its)["prefill_s_per_token"] == pytest.approx(TP_TRUE, rel=1e-9)


def test_aggregated_records_weigh_as_many_iterations():
    its = synthetic_iterations()
    heavy = [IterationRecord(0, Role.DECODE, 4, 400, 0, A_TRUE + B_TRUE * 4 + 0.01, count=1000.0)]
    v_plain = fit(iterations=its)
    v_heavy = fit(iterations=its + heavy)
    # a record standing for 1000 iterations pulls the fit towards its point
    predicted_at_4 = v_heavy["decode_fixed_s"] + 4 * v_heavy["decode_per_seq_s"]
    assert predicted_at_4 > v_plain["decode_fixed_s"] + 4 * v_plain["decode_per_seq_s"] + 0.005


def test_noisy_telemetry_is_the_least_squares_fit():
    its = synthetic_iterations(noise=2e-4, seed=7)
    v = fit(iterations=its)
    decode = [it for it in its if it.prefill_tokens == 0]
    n = np.array([it.num_seqs for it in decode], dtype=float)
    w = np.array([it.wall_s for it in decode])
    slope, intercept = np.polyfit(n, w, 1)
    assert v["decode_fixed_s"] == pytest.approx(intercept, rel=1e-9)
    assert v["decode_per_seq_s"] == pytest.approx(slope, rel=1e-9)
    # close to the truth
    assert v["decode_fixed_s"] == pytest.approx(A_TRUE, rel=0.05)
    assert v["decode_per_seq_s"] == pytest.approx(B_TRUE, rel=0.02)
    assert v["prefill_s_per_token"] == pytest.approx(TP_TRUE, rel=0.02)
    # t_prefill is sum(wall - A_fit) / sum(tokens) over prefill iterations
    prefill = [it for it in its if it.prefill_tokens > 0]
    busy = sum(it.wall_s - v["decode_fixed_s"] for it in prefill)
    assert v["prefill_s_per_token"] == pytest.approx(
        busy / sum(it.prefill_tokens for it in prefill), rel=1e-12
    )


def test_two_points_by_hand():
    # (n=2, 0.014), (n=6, 0.022): slope (0.022-0.014)/4 = 0.002; A = 0.014 - 2*0.002 = 0.01
    v = fit(iterations=[dec(2, 0.014), dec(6, 0.022)])
    assert v["decode_fixed_s"] == pytest.approx(0.01)
    assert v["decode_per_seq_s"] == pytest.approx(0.002)


def test_negative_slope_fits_b_zero_and_mean_a():
    # walls fall with batch size: best non-negative fit is b = 0, A = mean = 0.02
    v = fit(iterations=[dec(1, 0.03), dec(2, 0.02), dec(3, 0.01)])
    assert v["decode_per_seq_s"] == 0.0
    assert v["decode_fixed_s"] == pytest.approx(0.02)


def test_negative_intercept_fits_a_zero():
    # (1, 0.01), (2, 0.03), (3, 0.05): unconstrained A = -0.01, b = 0.02.
    # Boundary A = 0: b = sum(w*n)/sum(n*n) = (0.01 + 0.06 + 0.15)/(1 + 4 + 9) = 0.22/14
    v = fit(iterations=[dec(1, 0.01), dec(2, 0.03), dec(3, 0.05)])
    assert v["decode_fixed_s"] == 0.0
    assert v["decode_per_seq_s"] == pytest.approx(0.22 / 14)


def test_prefill_uses_the_prior_a_when_decode_cannot_be_fitted():
    # no decode iterations; prior A = 0.008: (0.108 - 0.008 + 0.208 - 0.008) / (1000 + 2000)
    #   = 0.3 / 3000 = 1e-4
    v = fit(iterations=[pre(1000, 0.108), pre(2000, 0.208)], prior_a=0.008)
    assert v["decode_fixed_s"] is None and v["decode_per_seq_s"] is None
    assert v["prefill_s_per_token"] == pytest.approx(1e-4)


# ---------------------------------------------------------------- turns and env
def test_turns_and_env_come_from_the_slowest_trajectory():
    turns = (
        # a: 3 turns, env 1 + 2 + 3 = 6 s (more env time but fewer turns)
        [turn("a", i, env=float(i + 1)) for i in range(3)]
        # b: 5 turns, env 0.5 each = 2.5 s -> the slowest trajectory
        + [turn("b", i, env=0.5) for i in range(5)]
        # c: 2 turns
        + [turn("c", i, env=10.0) for i in range(2)]
    )
    v = fit(turns)
    assert v["turns"] == 5.0
    assert v["env_s"] == pytest.approx(2.5)


def test_equal_turn_counts_break_ties_by_env_time():
    turns = [turn("a", i, env=0.5) for i in range(4)] + [turn("b", i, env=1.0) for i in range(4)]
    v = fit(turns)
    assert v["turns"] == 4.0
    assert v["env_s"] == pytest.approx(4.0)  # b: 4 * 1.0


def test_token_means_are_over_all_turns():
    # new tokens 100, 200, 600 -> mean 300; generated 10, 20, 60 -> mean 30
    turns = [
        turn("a", 0, new=100, gen=10),
        turn("a", 1, new=200, gen=20),
        turn("b", 0, new=600, gen=60),
    ]
    v = fit(turns)
    assert v["new_tokens_per_turn"] == pytest.approx(300.0)
    assert v["gen_tokens_per_turn"] == pytest.approx(30.0)


# ------------------------------------------------------------------------ theta
def test_theta_from_the_decode_active_fraction():
    # sum(num_seqs * wall) = 2*5 + 4*2.5 = 20 seq-seconds; four turns waited 10 s each
    # for their responses: f = 20 / 40 = 0.5; theta = (1 - 0.5)/0.5 = 1
    v = fit(eligible(10, 10, 10, 10), [dec(2, 5.0), dec(4, 2.5)])
    assert v["decode_bubble_ratio"] == pytest.approx(1.0)


def test_theta_quarter_active():
    # seq-seconds 8 * 2.5 = 20 over 8 turns * 10 s eligible = 80 -> f = 0.25; theta = 3
    v = fit(eligible(*[10] * 8), [dec(8, 2.5)])
    assert v["decode_bubble_ratio"] == pytest.approx(3.0)


def test_theta_leaves_environment_time_and_finished_trajectories_out():
    # the same 20 seq-seconds over 40 eligible seconds: long environment steps after
    # the responses (T_env's own term) and a rollout 100x longer do not count
    turns = [turn(f"t{k}", 0, env=500.0, generate_s=10.0) for k in range(4)]
    v = fit(turns, [dec(2, 5.0), dec(4, 2.5)])
    assert v["decode_bubble_ratio"] == pytest.approx(1.0)


def test_theta_is_clamped():
    # more seq-seconds than the turns were eligible -> f capped at 1 -> theta = 0
    v = fit(eligible(10, 10), [dec(8, 100.0)])
    assert v["decode_bubble_ratio"] == 0.0
    # almost nothing decoding -> f floored at 0.01 -> theta = 99
    v = fit(eligible(10, 10), [dec(1, 1e-6)])
    assert v["decode_bubble_ratio"] == pytest.approx(99.0)


def test_theta_needs_the_turns_request_times():
    its = [dec(2, 5.0), dec(4, 2.5)]
    assert fit(iterations=its)["decode_bubble_ratio"] is None  # no turns
    assert fit(eligible(0, 0), its)["decode_bubble_ratio"] is None  # not measured
    assert fit(eligible(float("nan")), its)["decode_bubble_ratio"] is None


# ----------------------------------------------------------------- missing data
def _assert_sane(profile):
    for key in FITTED_FIELDS:
        value = getattr(profile, key)
        assert math.isfinite(value), key
    assert profile.turns > 0 and profile.gen_tokens_per_turn > 0


def test_no_data_keeps_the_configured_profile():
    base = make_profile()
    tr = RuntimeTracker(base)
    f = tr.observe_step([], [])
    assert sorted(f.missing) == sorted(FITTED_FIELDS)
    assert tr.profile == base
    assert tr.steps_observed == 1
    _assert_sane(tr.profile)


def test_one_batch_size_only_keeps_a_and_b():
    base = make_profile()
    tr = RuntimeTracker(base)
    f = tr.observe_step([], [dec(4, 0.02), dec(4, 0.03), dec(4, 0.025)])
    assert f.values["decode_fixed_s"] is None and f.values["decode_per_seq_s"] is None
    assert tr.profile.decode_fixed_s == base.decode_fixed_s
    assert tr.profile.decode_per_seq_s == base.decode_per_seq_s


def test_single_decode_iteration_keeps_a_and_b():
    v = fit(iterations=[dec(4, 0.02)])
    assert v["decode_fixed_s"] is None and v["decode_per_seq_s"] is None


def test_nan_wall_times_keep_the_configured_profile():
    base = make_profile()
    nan = float("nan")
    tr = RuntimeTracker(base)
    f = tr.observe_step(eligible(100), [dec(1, nan), dec(2, nan), dec(3, nan), pre(100, nan)])
    assert f.values["decode_fixed_s"] is None
    assert f.values["decode_per_seq_s"] is None
    assert f.values["prefill_s_per_token"] is None
    assert f.values["decode_bubble_ratio"] is None  # not the 99 of "nothing decodes"
    for key in ("decode_fixed_s", "decode_per_seq_s", "prefill_s_per_token", "decode_bubble_ratio"):
        assert getattr(tr.profile, key) == getattr(base, key)
    _assert_sane(tr.profile)


def test_a_nan_record_does_not_spoil_the_rest():
    # one unusable iteration among exact ones: the fit is still exact
    nan = float("nan")
    its = [*synthetic_iterations(), dec(5, nan), pre(512, nan)]
    v = fit(iterations=its)
    assert v["decode_fixed_s"] == pytest.approx(A_TRUE, rel=1e-9)
    assert v["decode_per_seq_s"] == pytest.approx(B_TRUE, rel=1e-9)
    assert v["prefill_s_per_token"] == pytest.approx(TP_TRUE, rel=1e-9)
    # theta cannot be summed over a NaN wall time
    assert fit(eligible(100), its)["decode_bubble_ratio"] is None


def test_nan_env_time_keeps_env():
    base = make_profile()
    tr = RuntimeTracker(base)
    tr.observe_step([turn("a", 0, env=float("nan")), turn("a", 1, env=1.0)], [])
    assert tr.profile.env_s == base.env_s
    assert tr.profile.turns == pytest.approx(0.5 * 2 + 0.5 * base.turns)


def test_empty_turns_keep_turn_fields():
    base = make_profile()
    tr = RuntimeTracker(base)
    tr.observe_step([], synthetic_iterations())
    for key in ("turns", "env_s", "new_tokens_per_turn", "gen_tokens_per_turn"):
        assert getattr(tr.profile, key) == getattr(base, key), key
    # while the iteration fields did move
    assert tr.profile.decode_fixed_s == pytest.approx(0.5 * A_TRUE + 0.5 * base.decode_fixed_s)


def test_zero_generated_tokens_are_not_fitted():
    # r must stay > 0 (the profile requires it); a step of empty responses keeps it
    v = fit([turn("a", 0, gen=0), turn("a", 1, gen=0)])
    assert v["gen_tokens_per_turn"] is None
    assert v["turns"] == 2.0


# ------------------------------------------------------------------------ EMA
def test_ema_over_two_steps_by_hand():
    base = make_profile(turns=40, decode_fixed_s=0.008, env_s=120.0)
    tr = RuntimeTracker(base, ema_alpha=0.5)
    # step 1: turns 10, env 10*1 = 10, A = 0.01 (walls 0.01 + 0.002 n)
    tr.observe_step([turn("a", i, env=1.0) for i in range(10)], [dec(1, 0.012), dec(3, 0.016)])
    # turns 0.5*10 + 0.5*40 = 25; env 0.5*10 + 0.5*120 = 65; A 0.5*0.01 + 0.5*0.008 = 0.009
    assert tr.profile.turns == pytest.approx(25.0)
    assert tr.profile.env_s == pytest.approx(65.0)
    assert tr.profile.decode_fixed_s == pytest.approx(0.009)
    # step 2: turns 20, env 20*2 = 40, A = 0.02 (walls 0.02 + 0.001 n)
    tr.observe_step([turn("a", i, env=2.0) for i in range(20)], [dec(2, 0.022), dec(4, 0.024)])
    # turns 0.5*20 + 0.5*25 = 22.5; env 0.5*40 + 0.5*65 = 52.5; A 0.5*0.02 + 0.5*0.009 = 0.0145
    assert tr.profile.turns == pytest.approx(22.5)
    assert tr.profile.env_s == pytest.approx(52.5)
    assert tr.profile.decode_fixed_s == pytest.approx(0.0145)
    # b: 0.5*0.002 + 0.5*0.00025 = 0.001125; then 0.5*0.001 + 0.5*0.001125 = 0.0010625
    assert tr.profile.decode_per_seq_s == pytest.approx(0.0010625)
    assert tr.steps_observed == 2


def test_alpha_one_takes_the_latest_fit():
    tr = RuntimeTracker(make_profile(), ema_alpha=1.0)
    tr.observe_step([], synthetic_iterations())
    assert tr.profile.decode_fixed_s == pytest.approx(A_TRUE)
    assert tr.profile.decode_per_seq_s == pytest.approx(B_TRUE)
    assert tr.profile.prefill_s_per_token == pytest.approx(TP_TRUE)


def test_non_fitted_fields_stay_and_batch_size_follows_the_step():
    base = make_profile()
    tr = RuntimeTracker(base)
    tr.observe_step([turn("a", 0, generate_s=50.0)], synthetic_iterations(), batch_size=32)
    assert tr.profile.batch_size == 32
    for key in ("kv_bytes_per_token", "kv_capacity_bytes_per_worker", "overhead_s_per_turn"):
        assert getattr(tr.profile, key) == getattr(base, key)
    # theta: seq-seconds over the turn's 50 eligible seconds
    its = synthetic_iterations()
    f = sum(it.num_seqs * it.wall_s for it in its) / 50.0
    assert tr.last_fit is not None
    assert tr.last_fit.values["decode_bubble_ratio"] == pytest.approx((1 - f) / f)


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_bad_alpha_is_rejected(alpha):
    with pytest.raises(ValueError, match="ema_alpha"):
        RuntimeTracker(make_profile(), ema_alpha=alpha)


def test_round_trip_through_to_dict_and_restore():
    tr = RuntimeTracker(make_profile())
    tr.observe_step([turn("a", i, generate_s=10.0) for i in range(3)], synthetic_iterations())
    again = RuntimeTracker(make_profile(), ema_alpha=0.9)
    again.restore(tr.to_dict())
    assert again.profile == tr.profile
    assert again.steps_observed == 1
    assert again.ema_alpha == 0.5


def test_mean_turns_over_the_trajectories_with_a_finished_turn():
    # a: 3 turns (the slowest), b: 1, c: 2 -> S = 3, S-bar = 6 / 3 = 2
    turns = [turn("a", i) for i in range(3)] + [turn("b", 0)] + [turn("c", i) for i in range(2)]
    v = fit(turns)
    assert v["turns"] == 3.0 and v["mean_turns"] == pytest.approx(2.0)
