"""Cost-aware policies (PEARL.md section 6): borrowing gate, toggle-cost estimate,
expansion gate, fixed PD policies and their configuration."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pearl_hpc.core import predictor
from pearl_hpc.core.decision import decide
from pearl_hpc.core.policies import (
    AdaptivePD,
    AlwaysExpand,
    BorrowingName,
    BorrowInputs,
    ExpansionInputs,
    ExpansionName,
    FixedColocatedPD,
    FixedRatioPD,
    GatedBorrowing,
    GatedExpansion,
    NoBorrowing,
    PDPolicyName,
    PolicyConfig,
    ToggleCostEstimator,
    UngatedBorrowing,
    gate_borrowing_of,
    gate_expansion_of,
    make_policies,
)
from pearl_hpc.core.types import PDConfig
from pearl_hpc.errors import ConfigError
from tests.factories import make_profile


# ------------------------------------------------------------------------ borrowing
def borrow(r=32, b=64, t_ded=100.0, t_full=80.0, toggle=9.44) -> BorrowInputs:
    return BorrowInputs(r, b, t_ded, t_full, toggle)


def test_gated_borrows_when_benefit_beats_toggle_cost():
    # (R/B)(T_ded - T_full) = (32/64)(100 - 80) = 0.5 * 20 = 10 > 9.44
    g = GatedBorrowing().allow(borrow(toggle=9.44))
    assert g.allow is True
    assert g.benefit_s == pytest.approx(10.0)
    assert g.cost_s == 9.44
    assert g.reason.startswith("borrow")


def test_gated_tie_does_not_borrow():
    # benefit exactly 10.0 (0.5 * 20, exact in binary) == T_toggle 10.0 -> reject
    g = GatedBorrowing().allow(borrow(toggle=10.0))
    assert g.benefit_s == 10.0
    assert g.allow is False
    assert "do not borrow" in g.reason


def test_gated_below_does_not_borrow():
    # few unfinished trajectories: (4/64)*20 = 1.25 < 9.44
    g = GatedBorrowing().allow(borrow(r=4))
    assert g.benefit_s == pytest.approx(1.25)
    assert g.allow is False


def test_gated_no_gain_no_borrow_even_for_free_toggle():
    # T_full == T_ded: benefit 0, toggle 0 -> 0 > 0 is false
    assert GatedBorrowing().allow(borrow(t_full=100.0, toggle=0.0)).allow is False


def test_gated_with_no_dedicated_workers_borrows_if_work_remains():
    g = GatedBorrowing().allow(borrow(t_ded=math.inf, toggle=1e9))
    assert g.allow is True and math.isinf(g.benefit_s)
    assert GatedBorrowing().allow(borrow(r=0, t_ded=math.inf, toggle=0.0)).allow is False


def test_gated_empty_batch_does_not_borrow():
    assert GatedBorrowing().allow(borrow(b=0, toggle=0.0)).allow is False


@pytest.mark.parametrize("toggle", [0.0, 9.44, 1e9])
def test_no_borrowing_never_and_ungated_always(toggle):
    for inputs in (borrow(toggle=toggle), borrow(r=0, toggle=toggle), borrow(t_full=200.0)):
        assert NoBorrowing().allow(inputs).allow is False
        assert UngatedBorrowing().allow(inputs).allow is True
        assert NoBorrowing().allow(inputs).reason
        assert UngatedBorrowing().allow(inputs).reason


# --------------------------------------------------------------- toggle-cost EMA
def test_toggle_estimator_starts_at_the_seed():
    est = ToggleCostEstimator(seed_s=10.0, alpha=0.3)
    assert est.estimate_s == 10.0


def test_toggle_estimator_ema_by_hand():
    est = ToggleCostEstimator(seed_s=10.0, alpha=0.3)
    # borrowing step: sample 6 + 3 + 2 = 11; with = 10 + 0.3*(11 - 10) = 10.3
    est.observe(borrowed=True, training_wait_s=2.0, activation_s=6.0, deactivation_s=3.0)
    assert est.with_borrow_s == pytest.approx(10.3)
    assert est.estimate_s == pytest.approx(10.3)
    # plain step: without = 0 + 0.3*(4 - 0) = 1.2; estimate 10.3 - 1.2 = 9.1
    est.observe(borrowed=False, training_wait_s=4.0)
    assert est.without_borrow_s == pytest.approx(1.2)
    assert est.estimate_s == pytest.approx(9.1)
    # plain step: without = 1.2 + 0.3*(2 - 1.2) = 1.44; estimate 10.3 - 1.44 = 8.86
    est.observe(borrowed=False, training_wait_s=2.0)
    assert est.estimate_s == pytest.approx(8.86)
    # borrowing step: sample 1 + 1 + 2 = 4; with = 10.3 + 0.3*(4 - 10.3) = 8.41
    est.observe(borrowed=True, training_wait_s=2.0, activation_s=1.0, deactivation_s=1.0)
    assert est.with_borrow_s == pytest.approx(8.41)
    assert est.estimate_s == pytest.approx(8.41 - 1.44)


def test_toggle_estimator_never_negative():
    est = ToggleCostEstimator(seed_s=1.0, alpha=0.5)
    for _ in range(5):
        est.observe(borrowed=False, training_wait_s=100.0)
    assert est.without_borrow_s > est.with_borrow_s
    assert est.estimate_s == 0.0


def test_toggle_estimator_round_trip():
    est = ToggleCostEstimator(seed_s=10.0, alpha=0.3)
    est.observe(borrowed=True, training_wait_s=1.0, activation_s=5.0, deactivation_s=2.0)
    est.observe(borrowed=False, training_wait_s=3.0)
    again = ToggleCostEstimator(seed_s=0.0, alpha=0.9)
    again.restore(est.to_dict())
    assert again.to_dict() == est.to_dict()
    assert again.estimate_s == est.estimate_s


# ------------------------------------------------------------------------ expansion
def expand(cur=100.0, new=50.0, window=140.0, prep=20.0, fin=40.0) -> ExpansionInputs:
    return ExpansionInputs(cur, new, window, prep, fin)


def test_gated_expansion_by_hand():
    # saving = max(0, 1000 - 50) * (1 - 80/100) = 950 * 0.2 = 190 > 50 + 10 = 60
    g = GatedExpansion().allow(expand(cur=100.0, new=80.0, window=1000.0, prep=50.0, fin=10.0))
    assert g.allow is True
    assert g.benefit_s == pytest.approx(190.0)
    assert g.cost_s == pytest.approx(60.0)
    assert g.reason.startswith("admit")


def test_gated_expansion_tie_rejects():
    # saving = (140 - 20) * (1 - 50/100) = 120 * 0.5 = 60 == 20 + 40 -> reject
    g = GatedExpansion().allow(expand())
    assert g.benefit_s == 60.0 and g.cost_s == 60.0
    assert g.allow is False
    assert g.reason.startswith("reject")


def test_a_warm_join_is_admitted_when_the_capacity_outlasts_its_preparation():
    # the tie above, warm: the serving workers pay nothing, a 60 s saving admits
    warm = dataclasses.replace(expand(), warm=True)
    g = GatedExpansion().allow(warm)
    assert g.allow is True and g.cost_s == 0.0 and "warm join" in g.reason
    # ... but preparation still shortens the window it serves in: none left, no saving
    g = GatedExpansion().allow(dataclasses.replace(warm, expected_window_s=20.0))
    assert g.benefit_s == 0.0 and g.allow is False


def test_gated_expansion_short_window_rejects():
    # window shorter than preparation: saving = max(0, 10 - 20) * 0.5 = 0
    g = GatedExpansion().allow(expand(window=10.0, fin=0.0, prep=20.0))
    assert g.benefit_s == 0.0 and g.allow is False


def test_gated_expansion_slower_config_has_no_saving():
    # new makespan larger than the current one: speedup clamped to 0
    g = GatedExpansion().allow(expand(cur=100.0, new=120.0, prep=0.0, fin=0.0))
    assert g.benefit_s == 0.0 and g.allow is False


def test_gated_expansion_from_nothing_admits():
    g = GatedExpansion().allow(expand(cur=math.inf, prep=1e6, fin=1e6))
    assert g.allow is True and math.isinf(g.benefit_s)


def test_always_expand_admits_and_reports_the_same_arithmetic():
    g = AlwaysExpand().allow(expand(window=10.0))
    assert g.allow is True
    assert g.benefit_s == 0.0  # (10 - 20 -> 0) * 0.5
    assert g.cost_s == pytest.approx(60.0)
    assert AlwaysExpand().allow(expand()).benefit_s == pytest.approx(60.0)


# --------------------------------------------------------------------- PD policies
def test_fixed_colocated_targets_every_worker():
    p = make_profile()
    d = FixedColocatedPD().decide(p, 6, PDConfig(2, 4, 0))
    assert d.target == PDConfig.colocated(6)
    assert d.predicted_makespan_s == predictor.predict(p, 0, 0, 6)
    assert d.reason
    assert [c.config for c in d.candidates] == [PDConfig.colocated(6)]


def test_fixed_colocated_without_workers_is_empty():
    d = FixedColocatedPD().decide(make_profile(), 0, None)
    assert d.target == PDConfig()
    assert math.isinf(d.predicted_makespan_s)


@pytest.mark.parametrize(
    ("fraction", "n", "expected"),
    [
        (0.5, 8, PDConfig(4, 4, 0)),  # round(4.0) = 4
        (0.25, 8, PDConfig(2, 6, 0)),  # round(2.0) = 2
        (0.5, 5, PDConfig(2, 3, 0)),  # round(2.5) = 2 (ties to even)
        (0.3, 5, PDConfig(2, 3, 0)),  # round(1.5) = 2 (ties to even)
        (0.25, 2, PDConfig(1, 1, 0)),  # round(0.5) = 0 -> clamped up to 1
        (0.9, 4, PDConfig(3, 1, 0)),  # round(3.6) = 4 -> clamped down to N-1 = 3
        (0.5, 2, PDConfig(1, 1, 0)),
        (0.5, 1, PDConfig.colocated(1)),  # one worker: colocated
        (0.5, 0, PDConfig()),
    ],
)
def test_fixed_ratio_targets(fraction, n, expected):
    p = make_profile()
    d = FixedRatioPD(fraction).decide(p, n, None)
    assert d.target == expected
    if expected.total:
        assert d.predicted_makespan_s == predictor.predict(
            p, expected.num_prefill, expected.num_decode, expected.num_colocated
        )
    assert d.reason


def test_fixed_ratio_ignores_the_predictor_and_feasibility():
    # KV capacity so small that no split is feasible: the fixed policy still splits
    p = make_profile(kv_capacity_bytes_per_worker=1e9)
    assert FixedRatioPD(0.5).decide(p, 8, None).target == PDConfig(4, 4, 0)


def test_fixed_ratio_switch_flag():
    p = make_profile()
    assert FixedRatioPD(0.5).decide(p, 8, PDConfig(4, 4, 0)).switch is False
    assert FixedRatioPD(0.5).decide(p, 8, PDConfig(2, 6, 0)).switch is True


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 1.5])
def test_fixed_ratio_rejects_fractions_outside_the_open_interval(fraction):
    with pytest.raises(ValueError, match="prefill_fraction"):
        FixedRatioPD(fraction)


def test_adaptive_is_the_decision_engine():
    p = make_profile()
    for n, cur in ((8, None), (8, PDConfig(1, 7, 0)), (3, PDConfig.colocated(4))):
        got, want = AdaptivePD().decide(p, n, cur), decide(p, n, cur)
        assert (got.target, got.switch, got.forced, got.reason) == (
            want.target,
            want.switch,
            want.forced,
            want.reason,
        )
        assert got.predicted_makespan_s == want.predicted_makespan_s
        assert got.candidates == want.candidates


# -------------------------------------------------------------------- make_policies
def test_make_policies_defaults():
    pol = make_policies(PolicyConfig())
    assert isinstance(pol.pd, AdaptivePD)
    assert isinstance(pol.borrowing, GatedBorrowing)
    assert isinstance(pol.expansion, GatedExpansion)


@pytest.mark.parametrize(
    ("pd", "cls"),
    [("adaptive", AdaptivePD), ("colocated", FixedColocatedPD), ("fixed-ratio", FixedRatioPD)],
)
def test_make_policies_pd(pd, cls):
    pol = make_policies(PolicyConfig.from_dict({"pd_policy": pd, "prefill_fraction": 0.25}))
    assert type(pol.pd) is cls
    if cls is FixedRatioPD:
        assert pol.pd.prefill_fraction == 0.25


@pytest.mark.parametrize(
    ("name", "cls"),
    [("none", NoBorrowing), ("ungated", UngatedBorrowing), ("gated", GatedBorrowing)],
)
def test_make_policies_borrowing(name, cls):
    assert type(make_policies(PolicyConfig.from_dict({"borrowing": name})).borrowing) is cls


@pytest.mark.parametrize(("name", "cls"), [("always", AlwaysExpand), ("gated", GatedExpansion)])
def test_make_policies_expansion(name, cls):
    assert type(make_policies(PolicyConfig.from_dict({"expansion": name})).expansion) is cls


def test_gate_helpers_use_the_pd_policy_predictions():
    p = make_profile()
    pol = make_policies(PolicyConfig())
    g = gate_borrowing_of(pol, p, num_dedicated=4, num_lendable=4, unfinished=32, toggle_cost_s=1.0)
    t_ded = decide(p, 4).predicted_makespan_s
    t_full = decide(p, 8).predicted_makespan_s
    assert g.benefit_s == pytest.approx(32 / p.batch_size * (t_ded - t_full))
    # R defaults to the whole batch
    g = gate_borrowing_of(
        pol, p, num_dedicated=4, num_lendable=4, unfinished=None, toggle_cost_s=1.0
    )
    assert g.benefit_s == pytest.approx(t_ded - t_full)

    cfg = PolicyConfig()
    e = gate_expansion_of(pol, cfg, p, num_current=4, num_new=4, window_s=900.0)
    saving = (900.0 - cfg.preparation_s) * (1 - t_full / t_ded)
    assert e.benefit_s == pytest.approx(saving)
    assert e.cost_s == pytest.approx(cfg.preparation_s + cfg.finalisation_s)


# ---------------------------------------------------------- PolicyConfig.from_dict
def test_policy_config_from_dict_values():
    cfg = PolicyConfig.from_dict(
        {
            "pd_policy": "fixed-ratio",
            "prefill_fraction": 0.25,
            "borrowing": "none",
            "expansion": "always",
            "toggle_cost_s": 5,
            "tracker_ema_alpha": 1,
        }
    )
    assert cfg.pd_policy is PDPolicyName.FIXED_RATIO
    assert cfg.borrowing is BorrowingName.NONE
    assert cfg.expansion is ExpansionName.ALWAYS
    assert cfg.toggle_cost_s == 5.0 and isinstance(cfg.toggle_cost_s, float)
    assert PolicyConfig.from_dict({}) == PolicyConfig()


def test_policy_config_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as exc:
        PolicyConfig.from_dict({"borowing": "gated"})
    msg = str(exc.value)
    assert "borowing" in msg
    for key in ("pd_policy", "prefill_fraction", "borrowing", "expansion", "toggle_cost_s"):
        assert key in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [("pd_policy", "disaggregated"), ("borrowing", "sometimes"), ("expansion", "never")],
)
def test_policy_config_wrong_enum_value(key, value):
    with pytest.raises(ConfigError) as exc:
        PolicyConfig.from_dict({key: value})
    msg = str(exc.value)
    assert f"policy.{key}" in msg and value in msg


def test_policy_config_wrong_enum_lists_the_choices():
    with pytest.raises(ConfigError, match="none, ungated, gated"):
        PolicyConfig.from_dict({"borrowing": "maybe"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prefill_fraction", 0.0),  # gt 0
        ("prefill_fraction", 1.0),  # le 0.99
        ("toggle_cost_s", -1.0),  # ge 0
        ("toggle_ema_alpha", 0.0),  # gt 0
        ("toggle_ema_alpha", 1.5),  # le 1
        ("expected_capacity_window_s", 0),  # gt 0
        ("tracker_ema_alpha", 2),  # le 1
        ("preparation_s", float("nan")),
        ("finalisation_s", float("inf")),
    ],
)
def test_policy_config_out_of_range(key, value):
    with pytest.raises(ConfigError, match=f"policy.{key}"):
        PolicyConfig.from_dict({key: value})


def test_policy_config_rejects_a_non_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        PolicyConfig.from_dict(["adaptive"])
