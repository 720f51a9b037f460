"""The shipped profiles load and land where their comments say they land."""

from __future__ import annotations

import pytest

from pearl_hpc.config import REPO_CONFIGS, load_policy, load_profile
from pearl_hpc.core.decision import decide

PROFILES = sorted((REPO_CONFIGS / "profiles").glob("*.yaml"))


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_profile_loads(path) -> None:
    profile = load_profile(path)
    assert profile.batch_size == 64


def test_shipped_policy_config_loads() -> None:
    policy = load_policy(REPO_CONFIGS / "controller.yaml")
    assert policy.borrowing.value == "gated"


def _gain_and_best(profile, batch: int) -> tuple[float, str]:
    decision = decide(profile.replace(batch_size=batch), 8)
    coloc, *splits = decision.candidates
    best = min((c for c in splits if c.feasible), key=lambda c: c.predicted_makespan_s)
    return coloc.predicted_makespan_s / best.predicted_makespan_s - 1, best.config.spec()


def test_qwen3_30b_profile_lands_as_documented() -> None:
    """Documented in the YAML: +7.5% at 32, +10.3% at 80, -1.5% at 96 (PEARL: +9.7, +1.4,
    -6.1: the sign at 96 reproduced, the fall from 32 to 80 not), best 3P5D at 48 and
    4P4D at 64 (PEARL: 4P4D, 5P3D)."""
    profile = load_profile(REPO_CONFIGS / "profiles" / "qwen3-30b-a3b-h800-tp2.yaml")
    expected = {32: 0.075, 80: 0.103, 96: -0.015}
    for batch, gain in expected.items():
        assert _gain_and_best(profile, batch)[0] == pytest.approx(gain, abs=0.005)
    assert _gain_and_best(profile, 48)[1] == "3P5D"
    assert _gain_and_best(profile, 64)[1] == "4P4D"


def test_qwen3_8b_unlimited_scale_out_rollout_matches_pearl() -> None:
    p = load_profile(REPO_CONFIGS / "profiles" / "qwen3-8b-h800-tp2.yaml")
    ideal_s = p.turns * (p.gen_tokens_per_turn * p.decode_fixed_s + p.overhead_s_per_turn) + p.env_s
    assert ideal_s == pytest.approx(216.3, rel=0.01)
