"""The bubble-aware makespan models (PEARL.md section 3) against hand arithmetic.

Every expected number below is worked out by hand in a comment from small round
parameters, never by calling the formula under test.
"""

from __future__ import annotations

import numpy as np
import pytest

from pearl_hpc.core import predictor
from tests.factories import make_profile

# The small profile all hand calculations use:
#   B=4, S=2, dL=100, r=10, t_prefill=0.001 s/token, A=0.01 s, b=0.005 s/seq,
#   T_over=0.5 s, T_env=3 s, theta=1, K=1000 B/token, BW=1e6 B/s,
#   K_seq=1e6 B, H_max=2e6 B.
SMALL = dict(
    batch_size=4,
    turns=2,
    new_tokens_per_turn=100,
    gen_tokens_per_turn=10,
    prefill_s_per_token=0.001,
    decode_fixed_s=0.01,
    decode_per_seq_s=0.005,
    overhead_s_per_turn=0.5,
    env_s=3.0,
    decode_bubble_ratio=1.0,
    kv_bytes_per_token=1000,
    transfer_bytes_per_s=1e6,
    kv_bytes_per_trajectory=1e6,
    kv_capacity_bytes_per_worker=2e6,
)


@pytest.fixture
def p():
    return make_profile(**SMALL)


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-12)


# ------------------------------------------------------------------------- t_coloc
@pytest.mark.parametrize(
    ("n", "expected"),
    [
        # N=1: prefill (4*100/1)*0.001 = 0.4; decode 10*(0.01 + 0.005*4/1) = 10*0.03 = 0.3;
        #      per turn 0.4 + 0.3 + 0.5 = 1.2; S*1.2 = 2.4; + T_env 3 = 5.4
        (1, 5.4),
        # N=2: prefill (400/2)*0.001 = 0.2; decode 10*(0.01 + 0.005*4/2) = 10*0.02 = 0.2;
        #      per turn 0.2 + 0.2 + 0.5 = 0.9; 2*0.9 = 1.8; + 3 = 4.8
        (2, 4.8),
        # N=4: prefill (400/4)*0.001 = 0.1; decode 10*(0.01 + 0.005) = 0.15;
        #      per turn 0.1 + 0.15 + 0.5 = 0.75; 2*0.75 = 1.5; + 3 = 4.5
        (4, 4.5),
    ],
)
def test_t_coloc_by_hand(p, n, expected):
    assert float(predictor.t_coloc(p, n)) == approx(expected)


def test_t_coloc_overhead_and_env_enter_once_per_turn_and_once_overall(p):
    # Raising T_over by 1 adds S*1 = 2 s; raising T_env by 1 adds exactly 1 s.
    base = float(predictor.t_coloc(p, 2))
    assert float(predictor.t_coloc(p.replace(overhead_s_per_turn=1.5), 2)) == approx(base + 2)
    assert float(predictor.t_coloc(p.replace(env_s=4.0), 2)) == approx(base + 1)


# ------------------------------------------------------------------------ t_decode
@pytest.mark.parametrize(
    ("n_d", "expected"),
    [
        # stretch = 1 + theta = 2
        # N_D=1: iteration 0.01 + 0.005*4/(1*2) = 0.02; S*r*0.02*2 = 2*10*0.02*2 = 0.8
        (1, 0.8),
        # N_D=2: iteration 0.01 + 0.005*4/(2*2) = 0.015; 2*10*0.015*2 = 0.6
        (2, 0.6),
        # N_D=4: iteration 0.01 + 0.005*4/(4*2) = 0.0125; 2*10*0.0125*2 = 0.5
        (4, 0.5),
    ],
)
def test_t_decode_by_hand(p, n_d, expected):
    assert float(predictor.t_decode(p, n_d)) == approx(expected)


def test_t_decode_without_bubbles_is_plain_decode(p):
    # theta=0: stretch 1; N_D=2: iteration 0.01 + 0.005*4/2 = 0.02; 2*10*0.02 = 0.4
    assert float(predictor.t_decode(p.replace(decode_bubble_ratio=0.0), 2)) == approx(0.4)


def test_t_decode_bubbles_stretch_only_the_fixed_cost(p):
    # theta=3: stretch 4; N_D=1: iteration 0.01 + 0.005*4/(1*4) = 0.015;
    #          2*10*0.015*4 = 1.2  (= S*r*(A*(1+theta) + b*B/N_D) = 20*(0.04 + 0.02))
    assert float(predictor.t_decode(p.replace(decode_bubble_ratio=3.0), 1)) == approx(1.2)


# ----------------------------------------------------------------------- t_prefill
@pytest.mark.parametrize(
    ("n_p", "n_d", "expected"),
    [
        # tokens B*dL = 400; over one link 400*1000/1e6 = 0.4 s per turn
        # N_P=1, N_D=4: one link; (400/1)*0.001 = 0.4; S*(0.4 + 0.4) = 1.6
        (1, 4, 1.6),
        # N_P=2, N_D=2: two links, 0.2; (400/2)*0.001 = 0.2; 2*(0.2 + 0.2) = 0.8
        (2, 2, 0.8),
        # N_P=4, N_D=1: one link (decode's), 0.4; (400/4)*0.001 = 0.1; 2*(0.1 + 0.4) = 1.0
        (4, 1, 1.0),
        # N_P=4, N_D=4: four links, 0.1; 0.1 + 0.1 = 0.2 per turn; 2*0.2 = 0.4
        (4, 4, 0.4),
    ],
)
def test_t_prefill_by_hand(p, n_p, n_d, expected):
    assert float(predictor.t_prefill(p, n_p, n_d)) == approx(expected)


def test_t_prefill_transfer_crosses_the_narrower_pools_links(p):
    # t_prefill=0 leaves only the transfer: S * 400*1000/(links*1e6) = 0.8 / links
    q = p.replace(prefill_s_per_token=0.0)
    for n_p, n_d, links in ((1, 7, 1), (2, 7, 2), (7, 2, 2), (100, 100, 100)):
        assert float(predictor.t_prefill(q, n_p, n_d)) == approx(0.8 / links)


# --------------------------------------------------------------------------- t_dis
def test_t_dis_prefill_bound(p):
    # N_P=2, N_D=2: max(T_prefill 0.8, T_decode 0.6) + T_env 3 = 3.8
    assert float(predictor.t_dis(p, 2, 2)) == approx(3.8)
    # N_P=4, N_D=1: max(1.0, 0.8) + 3 = 4.0
    assert float(predictor.t_dis(p, 4, 1)) == approx(4.0)


def test_t_dis_decode_bound(p):
    # A=0.05: N_D=1: iteration 0.05 + 0.005*4/2 = 0.06; T_decode 2*10*0.06*2 = 2.4
    # N_P=4: T_prefill 1.0 (unchanged); max(1.0, 2.4) + 3 = 5.4
    q = p.replace(decode_fixed_s=0.05)
    assert float(predictor.t_dis(q, 4, 1)) == approx(5.4)


# --------------------------------------------------------------------- feasibility
@pytest.mark.parametrize(
    ("n_d", "expected"),
    [
        # B*K_seq = 4*1e6 = 4e6 bytes
        (1, False),  # 1*2e6 = 2e6 < 4e6
        (2, True),  # 2*2e6 = 4e6: equal holds (<=)
        (3, True),  # 6e6
    ],
)
def test_kv_feasible_by_hand(p, n_d, expected):
    assert bool(predictor.kv_feasible(p, n_d)) is expected


@pytest.mark.parametrize(
    ("n_p", "n_d", "expected"),
    [
        # t_prefill 0.01 (100 tokens/s): tokens B*S*dL = 4*2*100 = 800; busy = 8 / N_P
        # span = T_decode(N_D) + T_env: N_D=1 -> 0.8 + 3 = 3.8; N_D=2 -> 0.6 + 3 = 3.6
        (1, 1, False),  # busy 8 > 3.8
        (2, 1, False),  # busy 4 > 3.8
        (2, 2, False),  # busy 4 > 3.6
        (3, 2, True),  # busy 800/300 = 2.67 <= 3.6
        (3, 1, True),  # 2.67 <= 3.8
    ],
)
def test_prefill_feasible_by_hand(p, n_p, n_d, expected):
    q = p.replace(prefill_s_per_token=0.01)  # T_decode does not depend on it
    assert bool(predictor.prefill_feasible(q, n_p, n_d)) is expected


def test_prefill_feasible_boundary_is_inclusive():
    # Exactly representable numbers: B=4, S=2, r=2, A=0.25, b=0.25, theta=1, T_env=4.
    # N_D=2: iteration 0.25 + 0.25*4/(2*2) = 0.5; T_decode = 2*2*0.5*2 = 4; span 4 + 4 = 8.
    # tokens 4*2*100 = 800; N_P=1 at 0.01 s/token: busy 8 = span -> feasible; at 0.0101 not.
    q = make_profile(
        batch_size=4,
        turns=2,
        gen_tokens_per_turn=2,
        decode_fixed_s=0.25,
        decode_per_seq_s=0.25,
        decode_bubble_ratio=1.0,
        env_s=4.0,
        new_tokens_per_turn=100,
        prefill_s_per_token=0.01,
    )
    assert float(predictor.t_decode(q, 2)) == 4.0
    assert bool(predictor.prefill_feasible(q, 1, 2)) is True
    assert bool(predictor.prefill_feasible(q.replace(prefill_s_per_token=0.0101), 1, 2)) is False


def test_prefill_feasible_env_time_counts_toward_the_span(p):
    # N_P=2, N_D=2 was infeasible (busy 4 > 3.6); T_env=3.4 gives span 0.6 + 3.4 = 4.0 >= 4
    q = p.replace(prefill_s_per_token=0.01, env_s=3.4)
    assert bool(predictor.prefill_feasible(q, 2, 2)) is True


# ------------------------------------------------------------------------- predict
def test_predict_dispatches_on_mode(p):
    # colocated 2 workers -> t_coloc(2) = 4.8; 2P2D -> t_dis = 3.8
    assert predictor.predict(p, 0, 0, 2) == approx(4.8)
    assert predictor.predict(p, 2, 2, 0) == approx(3.8)
    assert isinstance(predictor.predict(p, 2, 2, 0), float)


# --------------------------------------------------------------- numpy elementwise
def test_array_inputs_equal_scalar_calls(p):
    n = np.arange(1, 17, dtype=np.int64)
    n_p = n
    n_d = 17 - n
    coloc = predictor.t_coloc(p, n)
    dec = predictor.t_decode(p, n_d)
    pre = predictor.t_prefill(p, n_p, n_d)
    dis = predictor.t_dis(p, n_p, n_d)
    kv = predictor.kv_feasible(p, n_d)
    pf = predictor.prefill_feasible(p, n_p, n_d)
    for arr in (coloc, dec, pre, dis, kv, pf):
        assert isinstance(arr, np.ndarray)
        assert arr.shape == (16,)
    for i, (a, d) in enumerate(zip(n_p.tolist(), n_d.tolist(), strict=True)):
        assert coloc[i] == predictor.t_coloc(p, a)
        assert dec[i] == predictor.t_decode(p, d)
        assert pre[i] == predictor.t_prefill(p, a, d)
        assert dis[i] == predictor.t_dis(p, a, d)
        assert bool(kv[i]) is bool(predictor.kv_feasible(p, d))
        assert bool(pf[i]) is bool(predictor.prefill_feasible(p, a, d))


def test_array_values_by_hand(p):
    # the hand values above, as arrays
    np.testing.assert_allclose(predictor.t_coloc(p, np.array([1, 2, 4])), [5.4, 4.8, 4.5])
    np.testing.assert_allclose(predictor.t_decode(p, np.array([1, 2, 4])), [0.8, 0.6, 0.5])
    np.testing.assert_allclose(
        predictor.t_prefill(p, np.array([1, 2, 4, 4]), np.array([4, 2, 1, 4])), [1.6, 0.8, 1.0, 0.4]
    )
    np.testing.assert_allclose(predictor.t_dis(p, np.array([2, 4]), np.array([2, 1])), [3.8, 4.0])
    assert predictor.kv_feasible(p, np.array([1, 2, 3])).tolist() == [False, True, True]
    q = p.replace(prefill_s_per_token=0.01)
    assert predictor.prefill_feasible(q, np.array([1, 3]), np.array([1, 2])).tolist() == [
        False,
        True,
    ]


def test_makespans_decrease_with_more_workers():
    # More workers never hurt any single path (formulas are 1/N plus constants).
    q = make_profile()
    n = np.arange(1, 65)
    for f in (predictor.t_coloc, predictor.t_decode, lambda q, n: predictor.t_prefill(q, n, n)):
        t = np.asarray(f(q, n))
        assert np.all(np.diff(t) <= 0)
        assert np.all(t > 0)


# ---------------------------------------------------------------------- mean turns
def test_prefill_work_counts_mean_turns_where_fitted(p):
    # S-bar = 1 (the slowest trajectory still has S = 2): the prefill terms halve
    q = p.replace(mean_turns=1.0)
    # colocated N=2: prefill 1*(400/2)*0.001 = 0.2; decode + T_over 2*(0.2 + 0.5) = 1.4;
    #                0.2 + 1.4 + 3 = 4.6 (S-bar = S gave 4.8)
    assert float(predictor.t_coloc(q, 2)) == approx(4.6)
    # N_P=2, N_D=2: 1*((400/2)*0.001 + 400*1000/(2*1e6)) = 0.2 + 0.2 = 0.4 (was 0.8)
    assert float(predictor.t_prefill(q, 2, 2)) == approx(0.4)
    # feasibility at 0.01 s/token: busy 4*1*100*0.01/2 = 2 <= span 0.6 + 3 (was 4 > 3.6)
    assert bool(predictor.prefill_feasible(q.replace(prefill_s_per_token=0.01), 2, 2)) is True
    # 0 = not fitted: S-bar = S
    assert float(predictor.t_coloc(p.replace(mean_turns=0.0), 2)) == approx(4.8)
