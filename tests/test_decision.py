"""The PD decision engine (PEARL.md section 4): argmin over feasible configurations,
mode-dependent hysteresis, the zero-role-change incumbent and forced switches."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearl_hpc.core import predictor
from pearl_hpc.core.decision import decide
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.core.types import Mode, PDConfig
from tests.factories import make_profile

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- strategies
def _pos(lo: float, hi: float, *, zero: bool = False) -> st.SearchStrategy[float]:
    s = st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    return st.one_of(st.just(0.0), s) if zero else s


profiles = st.builds(
    make_profile,
    batch_size=st.integers(1, 256),
    turns=st.integers(1, 100).map(float),
    new_tokens_per_turn=_pos(1, 4000, zero=True),
    gen_tokens_per_turn=_pos(1, 1000),
    prefill_s_per_token=_pos(1e-7, 1e-4, zero=True),
    decode_fixed_s=_pos(1e-4, 0.05, zero=True),
    decode_per_seq_s=_pos(1e-6, 1e-3, zero=True),
    overhead_s_per_turn=_pos(1e-3, 5, zero=True),
    env_s=_pos(1e-3, 1000, zero=True),
    decode_bubble_ratio=_pos(1e-3, 10, zero=True),
    kv_bytes_per_token=_pos(1e3, 1e6),
    transfer_bytes_per_s=_pos(1e8, 1e11),
    kv_bytes_per_trajectory=_pos(1e6, 1e10),
    kv_capacity_bytes_per_worker=_pos(1e8, 1e11),
)


# ------------------------------------------------------------- a reference engine
def _scored(p: WorkloadProfile, n: int) -> list[tuple[PDConfig, float, bool]]:
    """Colocated, then every split by increasing N_P, scored with scalar predictor calls."""
    out = [(PDConfig.colocated(n), predictor.predict(p, 0, 0, n), True)]
    for n_p in range(1, n):
        n_d = n - n_p
        ok = bool(predictor.kv_feasible(p, n_d)) and bool(predictor.prefill_feasible(p, n_p, n_d))
        out.append((PDConfig(n_p, n_d, 0), predictor.predict(p, n_p, n_d, 0), ok))
    return out


def _argmin(cands: list[tuple[PDConfig, float, bool]]) -> tuple[PDConfig, float] | None:
    """Lowest makespan among feasible ones; on ties the earliest in the list wins
    (colocated first, then smaller N_P)."""
    best: tuple[PDConfig, float] | None = None
    for cfg, t, ok in cands:
        if ok and (best is None or t < best[1]):
            best = (cfg, t)
    return best


def _zero_role_change(current: PDConfig, target: PDConfig) -> bool:
    """Survivors keep their roles: when growing every current worker stays, so each role
    count may only grow; when shrinking workers leave from any role, so counts only shrink."""
    if target.mode is not current.mode:
        return False
    if target.mode is Mode.COLOCATED:
        return True
    if target.total >= current.total:
        return target.num_prefill >= current.num_prefill and target.num_decode >= current.num_decode
    return target.num_prefill <= current.num_prefill and target.num_decode <= current.num_decode


def _reference(
    p: WorkloadProfile, n: int, current: PDConfig | None, ratio_thr: float, mode_thr: float
) -> tuple[PDConfig, bool, bool]:
    """(target, switch, forced) by brute force over explicit configurations."""
    cands = _scored(p, n)
    best = _argmin(cands)
    assert best is not None  # colocation is always feasible
    if current is None:
        return best[0], False, False
    incumbent = _argmin([c for c in cands if _zero_role_change(current, c[0])])
    if incumbent is None:
        return best[0], True, True
    if incumbent[0] == best[0]:
        return incumbent[0], False, False
    gain = (incumbent[1] - best[1]) / incumbent[1] if incumbent[1] > 0 else 0.0
    thr = mode_thr if best[0].mode is not incumbent[0].mode else ratio_thr
    if gain > thr:
        return best[0], True, False
    return incumbent[0], False, False


@st.composite
def currents(draw: st.DrawFn) -> PDConfig:
    total = draw(st.integers(1, 64))
    if total == 1 or draw(st.booleans()):
        return PDConfig.colocated(total)
    n_p = draw(st.integers(1, total - 1))
    return PDConfig(n_p, total - n_p, 0)


# ----------------------------------------------------------- no current: the argmin
@SETTINGS
@given(p=profiles, n=st.integers(1, 64))
def test_without_current_target_is_argmin_over_feasible_set(p, n):
    d = decide(p, n)
    cands = _scored(p, n)
    best = _argmin(cands)
    assert best is not None
    assert d.target == best[0]
    assert d.predicted_makespan_s == best[1]
    assert d.target.total == n
    assert (d.switch, d.forced, d.incumbent) == (False, False, None)
    assert d.reason.strip()

    got = d.candidates
    assert len(got) == n  # colocated + (n-1) splits
    assert got[0].config == PDConfig.colocated(n) and got[0].feasible
    for c, (cfg, t, ok) in zip(got, cands, strict=True):
        assert c.config == cfg
        assert c.predicted_makespan_s == t
        assert c.feasible is ok
    for c in got[1:]:
        n_p, n_d = c.config.num_prefill, c.config.num_decode
        kv = bool(predictor.kv_feasible(p, n_d))
        pf = bool(predictor.prefill_feasible(p, n_p, n_d))
        assert c.feasible is (kv and pf)
        assert ("kv" in c.infeasible_reason) is (not kv)
        assert ("prefill" in c.infeasible_reason) is (not pf)
    # nothing feasible beats the target
    assert all(c.predicted_makespan_s >= d.predicted_makespan_s for c in got if c.feasible)


def test_ties_go_to_colocated():
    # No work besides the environment: every configuration predicts exactly T_env.
    p = make_profile(
        new_tokens_per_turn=0,
        decode_fixed_s=0,
        decode_per_seq_s=0,
        overhead_s_per_turn=0,
        prefill_s_per_token=0,
        env_s=50.0,
        kv_capacity_bytes_per_worker=1e15,
    )
    d = decide(p, 6)
    assert all(c.predicted_makespan_s == 50.0 for c in d.candidates)
    assert all(c.feasible for c in d.candidates)
    assert d.target == PDConfig.colocated(6)


def test_ties_between_splits_go_to_smaller_prefill_count():
    # Colocation is expensive (T_over); disaggregated makespans are all T_env because the
    # only remaining cost, KV transfer, is zero work: K tiny, BW huge, no prefill/decode
    # time at all -> every split ties.
    p = make_profile(
        new_tokens_per_turn=0,
        decode_fixed_s=0,
        decode_per_seq_s=0,
        prefill_s_per_token=0,
        overhead_s_per_turn=5.0,
        env_s=10.0,
        kv_capacity_bytes_per_worker=1e15,
    )
    d = decide(p, 5)
    splits = d.candidates[1:]
    assert {c.predicted_makespan_s for c in splits} == {10.0}
    assert d.candidates[0].predicted_makespan_s > 10.0
    assert d.target == PDConfig(1, 4, 0)


def test_single_worker_is_colocated():
    d = decide(make_profile(), 1)
    assert d.target == PDConfig.colocated(1)
    assert len(d.candidates) == 1
    assert d.predicted_makespan_s == predictor.predict(make_profile(), 0, 0, 1)


@pytest.mark.parametrize("current", [None, PDConfig.colocated(4), PDConfig(1, 3, 0)])
def test_zero_workers_give_an_empty_target(current):
    d = decide(make_profile(), 0, current)
    assert d.target == PDConfig()
    assert d.target.total == 0
    assert d.candidates == []
    assert math.isinf(d.predicted_makespan_s)
    assert d.reason.strip()
    assert d.forced is (current is not None)


def test_infeasible_splits_are_dropped_even_when_faster():
    # Colocation made very slow; KV needs N_D >= 3 (64*1.6e9 = 102.4e9 > 2*40e9, <= 3*40e9)
    p = make_profile(overhead_s_per_turn=100.0, kv_capacity_bytes_per_worker=40e9)
    d = decide(p, 4)
    by_np = {c.config.num_prefill: c for c in d.candidates[1:]}
    assert [by_np[k].feasible for k in (1, 2, 3)] == [True, False, False]
    assert by_np[2].infeasible_reason == "kv"
    assert d.target == PDConfig(1, 3, 0)


# ------------------------------------------------------------ reference agreement
@SETTINGS
@given(
    p=profiles,
    n=st.integers(0, 64),
    current=st.one_of(st.none(), currents()),
    ratio_thr=st.sampled_from([0.0, 0.01, 0.05, 0.2, 1.0]),
    mode_thr=st.sampled_from([0.0, 0.02, 0.1, 0.3, 1.0]),
)
def test_decide_matches_brute_force_reference(p, n, current, ratio_thr, mode_thr):
    d = decide(p, n, current, ratio_switch_threshold=ratio_thr, mode_switch_threshold=mode_thr)
    assert d.reason.strip()
    if n == 0:
        assert d.target == PDConfig()
        return
    target, switch, forced = _reference(p, n, current, ratio_thr, mode_thr)
    assert d.target == target, d.reason
    assert (d.switch, d.forced) == (switch, forced), d.reason
    assert d.predicted_makespan_s == predictor.predict(
        p, target.num_prefill, target.num_decode, target.num_colocated
    )


@SETTINGS
@given(p=profiles, n=st.integers(1, 64), current=currents())
def test_maximal_thresholds_keep_the_zero_role_change_incumbent(p, n, current):
    # A relative gain can never exceed 1, so only a forced switch leaves the incumbent.
    d = decide(p, n, current, ratio_switch_threshold=1.0, mode_switch_threshold=1.0)
    if d.forced:
        assert current.mode is Mode.DISAGGREGATED
        assert d.incumbent is None
        assert not any(c.feasible and _zero_role_change(current, c.config) for c in d.candidates)
    else:
        assert _zero_role_change(current, d.target)
        assert d.switch is False
        assert d.incumbent == d.target
        # ... and it is the best role-preserving configuration (smaller N_P on ties)
        keep = [
            (c.config, c.predicted_makespan_s, c.feasible)
            for c in d.candidates
            if _zero_role_change(current, c.config)
        ]
        assert d.target == _argmin(keep)[0]


@SETTINGS
@given(p=profiles, n=st.integers(1, 64), current=currents())
def test_zero_thresholds_reach_the_optimum(p, n, current):
    d = decide(p, n, current, ratio_switch_threshold=0.0, mode_switch_threshold=0.0)
    best = min(c.predicted_makespan_s for c in d.candidates if c.feasible)
    assert d.predicted_makespan_s == best


def test_thresholds_default_to_the_profile():
    p = _ratio_case(0.07)  # a 7% ratio gain
    cur = PDConfig(7, 1, 0)
    assert decide(p.replace(ratio_switch_threshold=0.05), 8, cur).switch is True
    assert decide(p.replace(ratio_switch_threshold=0.08), 8, cur).switch is False
    # an explicit argument overrides the profile
    assert decide(p, 8, cur, ratio_switch_threshold=0.08).switch is False


# ---------------------------------------------------------------------- hysteresis
# All splits feasible (huge KV memory and prefill throughput); T_env, which adds the
# same constant to every configuration, tunes the relative gain to an exact value.
ROOMY = dict(kv_capacity_bytes_per_worker=1e15)


def _with_gain(p: WorkloadProfile, inc: PDConfig, best: PDConfig, gain: float) -> WorkloadProfile:
    """Set T_env so that (T_inc - T_best) / T_inc == gain."""
    q = p.replace(env_s=0.0)
    t_inc = predictor.predict(q, inc.num_prefill, inc.num_decode, inc.num_colocated)
    t_best = predictor.predict(q, best.num_prefill, best.num_decode, best.num_colocated)
    env = (t_inc - t_best) / gain - t_inc
    assert env >= 0, "the chosen gain needs a negative environment time"
    return q.replace(env_s=env)


def _ratio_case(gain: float) -> WorkloadProfile:
    # Heavy colocation overhead; on 8 workers 1P7D is the best split and 7P1D the worst
    # (decode-bound: T_decode(7) = 109.7 s vs T_decode(1) = 192 s without T_env).
    p = make_profile(overhead_s_per_turn=5.0, **ROOMY)
    return _with_gain(p, PDConfig(7, 1, 0), PDConfig(1, 7, 0), gain)


def test_ratio_change_within_threshold_stays():
    p = _ratio_case(0.03)  # 3% < ratio threshold 5%
    d = decide(p, 8, PDConfig(7, 1, 0))
    assert decide(p, 8).target == PDConfig(1, 7, 0)  # the unconstrained best
    assert d.target == PDConfig(7, 1, 0)
    assert (d.switch, d.forced) == (False, False)
    assert d.incumbent == PDConfig(7, 1, 0)
    assert "ratio-change" in d.reason and "keep" in d.reason


def test_ratio_change_beyond_threshold_switches():
    p = _ratio_case(0.07)  # 7% > ratio threshold 5% (but < mode threshold 10%)
    d = decide(p, 8, PDConfig(7, 1, 0))
    assert d.target == PDConfig(1, 7, 0)
    assert (d.switch, d.forced) == (True, False)
    assert d.incumbent == PDConfig(7, 1, 0)
    assert "switch" in d.reason and "ratio-change" in d.reason


def test_mode_switch_to_disaggregated_needs_the_mode_threshold():
    # Colocation slow (T_over 5 s/turn): 1P7D beats 8C.
    base = make_profile(overhead_s_per_turn=5.0, **ROOMY)
    cur = PDConfig.colocated(8)
    p = _with_gain(base, cur, PDConfig(1, 7, 0), 0.07)  # 7%: ratio would, mode must not
    d = decide(p, 8, cur)
    assert decide(p, 8).target == PDConfig(1, 7, 0)
    assert d.target == cur
    assert (d.switch, d.forced) == (False, False)
    assert "mode-switch" in d.reason

    p = _with_gain(base, cur, PDConfig(1, 7, 0), 0.12)  # 12% > 10%
    d = decide(p, 8, cur)
    assert d.target == PDConfig(1, 7, 0)
    assert (d.switch, d.forced) == (True, False)
    assert "mode-switch" in d.reason


def test_mode_switch_to_colocated_needs_the_mode_threshold():
    # Default costs: 8C (64.3 s) beats the best split 1P7D (109.7 s) without T_env.
    base = make_profile(**ROOMY)
    cur = PDConfig(1, 7, 0)
    p = _with_gain(base, cur, PDConfig.colocated(8), 0.07)
    d = decide(p, 8, cur)
    assert decide(p, 8).target == PDConfig.colocated(8)
    assert d.target == cur
    assert (d.switch, d.forced) == (False, False)

    p = _with_gain(base, cur, PDConfig.colocated(8), 0.12)
    d = decide(p, 8, cur)
    assert d.target == PDConfig.colocated(8)
    assert (d.switch, d.forced) == (True, False)


def test_gain_equal_to_threshold_does_not_switch():
    p = _ratio_case(0.07)
    cur = PDConfig(7, 1, 0)
    t_inc = predictor.predict(p, 7, 1, 0)
    t_best = predictor.predict(p, 1, 7, 0)
    gain = (t_inc - t_best) / t_inc  # the engine's own arithmetic
    assert decide(p, 8, cur, ratio_switch_threshold=gain).target == cur
    assert decide(p, 8, cur, ratio_switch_threshold=math.nextafter(gain, 0)).target == PDConfig(
        1, 7, 0
    )


def test_keeping_the_best_is_not_a_switch():
    p = _ratio_case(0.07)
    d = decide(p, 8, PDConfig(1, 7, 0))
    assert d.target == PDConfig(1, 7, 0)
    assert (d.switch, d.forced) == (False, False)
    assert d.reason.strip()


# ----------------------------------------------------------------- forced switches
def test_forced_when_current_split_becomes_infeasible_bypasses_hysteresis():
    # KV needs N_D >= 2 (64*1.6e9 = 102.4e9 > 1*60e9, <= 2*60e9). Current 3P1D on the
    # same 4 workers has no zero-role-change alternative, and it is infeasible.
    p = make_profile(kv_capacity_bytes_per_worker=60e9)
    cur = PDConfig(3, 1, 0)
    d = decide(p, 4, cur, ratio_switch_threshold=1.0, mode_switch_threshold=1.0)
    assert d.forced is True and d.switch is True
    assert d.incumbent is None
    assert d.target == decide(p, 4).target
    assert d.target != cur
    assert "forced" in d.reason


def test_forced_shrink_where_kv_fails_for_every_remaining_split():
    # 2P6D shrinks to 4 workers: zero-role-change splits have N_P in [1, 2] -> N_D in {3, 2}.
    # KV needs N_D >= 4 (64*1.6e9 = 102.4e9 > 3*30e9, <= 4*30e9): none is feasible.
    # Colocation beats nothing by much -- make it only a hair better than the split it
    # replaces -- yet the switch is forced.
    p = make_profile(kv_capacity_bytes_per_worker=30e9, env_s=1e9)
    cur = PDConfig(2, 6, 0)
    d = decide(p, 4, cur)
    assert all(not c.feasible for c in d.candidates[1:])
    assert d.target == PDConfig.colocated(4)
    assert d.forced is True and d.switch is True
    # the gain over the old split on these workers is tiny (< 1e-6), far below thresholds
    t_old = predictor.predict(p, 2, 2, 0)
    assert (t_old - d.predicted_makespan_s) / t_old < 1e-6
    assert "forced" in d.reason


def test_forced_when_a_single_worker_remains_of_a_disaggregated_pool():
    d = decide(make_profile(), 1, PDConfig(1, 1, 0))
    assert d.target == PDConfig.colocated(1)
    assert d.forced is True and d.switch is True
    assert "single worker" in d.reason


def test_colocated_current_is_never_forced():
    p = make_profile(kv_capacity_bytes_per_worker=1e9)  # no split is KV-feasible
    for n in (1, 3, 9):
        d = decide(p, n, PDConfig.colocated(5))
        assert d.forced is False
        assert d.target == PDConfig.colocated(n)


# ---------------------------------------------------------- grow / shrink incumbents
def test_grow_incumbent_assigns_new_workers_any_role():
    # 2P2D grows to 6: the survivors keep 2P and 2D; the 2 new workers go anywhere,
    # so the incumbent is the best of 2P4D, 3P3D, 4P2D; thresholds at 1 keep it.
    p = make_profile(overhead_s_per_turn=5.0, **ROOMY)
    d = decide(p, 6, PDConfig(2, 2, 0), ratio_switch_threshold=1.0, mode_switch_threshold=1.0)
    options = {k: predictor.predict(p, k, 6 - k, 0) for k in (2, 3, 4)}
    want = min(options, key=lambda k: (options[k], k))
    assert d.incumbent == PDConfig(want, 6 - want, 0) == d.target
    assert d.switch is False
    # decode-bound here, so the new workers decode
    assert d.target == PDConfig(2, 4, 0)

    # Prefill ten times dearer: 3P3D (248 s) beats 2P4D (276.6 s) and 4P2D (264 s),
    # so one new worker prefills and one decodes.
    q = p.replace(prefill_s_per_token=2e-4)
    d = decide(q, 6, PDConfig(2, 2, 0), ratio_switch_threshold=1.0, mode_switch_threshold=1.0)
    assert d.target == d.incumbent == PDConfig(3, 3, 0)
    assert d.switch is False


def test_shrink_incumbent_removes_workers_from_any_role():
    # 3P5D shrinks to 5: 3 workers leave from any role and the rest keep theirs, so
    # N_P <= 3 and N_D <= 5: 1P4D, 2P3D, 3P2D. Decode-bound, so 1P4D is the incumbent.
    p = make_profile(overhead_s_per_turn=5.0, **ROOMY)
    d = decide(p, 5, PDConfig(3, 5, 0), ratio_switch_threshold=1.0, mode_switch_threshold=1.0)
    assert d.target == PDConfig(1, 4, 0)
    assert d.switch is False and d.forced is False

    # 6P2D shrinks to 5: N_D <= 2 and N_P <= 6 -> only 3P2D, 4P1D are role-preserving.
    d = decide(p, 5, PDConfig(6, 2, 0), ratio_switch_threshold=1.0, mode_switch_threshold=1.0)
    assert d.target == PDConfig(3, 2, 0)  # decode-bound: the one with more decoders
    assert d.incumbent == PDConfig(3, 2, 0)
    assert d.switch is False


def test_growing_colocated_stays_colocated_without_a_mode_gain():
    p = make_profile(**ROOMY)
    d = decide(p, 12, PDConfig.colocated(8))
    assert d.target == PDConfig.colocated(12)
    assert d.switch is False


def test_every_decision_has_a_readable_reason():
    p = _ratio_case(0.07)
    cases = [
        (8, None),
        (8, PDConfig(7, 1, 0)),
        (8, PDConfig(1, 7, 0)),
        (8, PDConfig.colocated(8)),
        (1, PDConfig(1, 1, 0)),
        (0, None),
        (0, PDConfig(1, 1, 0)),
    ]
    for n, cur in cases:
        d = decide(p, n, cur)
        assert isinstance(d.reason, str)
        assert len(d.reason.split()) >= 3, d.reason
        assert "nan" not in d.reason.lower()
