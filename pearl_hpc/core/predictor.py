"""Bubble-aware makespan models, exactly as PEARL.md section 3 writes them.

Every function works elementwise: pass ints for one configuration or numpy arrays of
worker counts to score many at once (the decision engine does the latter).

Notation: B batch, S turns, dL new tokens/turn, r generated tokens/turn, t_prefill,
A + b*n decode iteration, T_over, T_env, theta, K, BW, K_seq, H_max.

One departure from the paper's formulas: the prefill terms count the batch's prefill
work over S-bar, the mean turns of a trajectory, where the paper writes S. The decode
chain of the slowest trajectory sets the makespan (S turns), but the prefill pool, or a
colocated worker's prefill share, serves every trajectory's turns, and most
trajectories end well before the slowest. With ``mean_turns`` 0 (unfitted) S-bar = S.
"""

from __future__ import annotations

import numpy as np

from pearl_hpc.core.profile import WorkloadProfile

# Worker counts and results: a number for one configuration, an array for many.
N = float | np.ndarray


def prefill_turns(p: WorkloadProfile) -> float:
    """S-bar: the turns over which the batch's prefill work is counted."""
    return p.mean_turns if p.mean_turns > 0 else p.turns


def t_coloc(p: WorkloadProfile, num_workers: N) -> N:
    """``S-bar*(B*dL/N)*t_prefill + S*[ r*(A + b*B/N) + T_over ] + T_env``."""
    B = p.batch_size
    prefill = (B * p.new_tokens_per_turn / num_workers) * p.prefill_s_per_token
    per_turn = (
        p.gen_tokens_per_turn * (p.decode_fixed_s + p.decode_per_seq_s * B / num_workers)
        + p.overhead_s_per_turn
    )
    return prefill_turns(p) * prefill + p.turns * per_turn + p.env_s


def t_decode(p: WorkloadProfile, num_decode: N) -> N:
    """``S * r * (A + b*B/(N_D*(1+theta))) * (1+theta)``."""
    stretch = 1.0 + p.decode_bubble_ratio
    iteration = p.decode_fixed_s + p.decode_per_seq_s * p.batch_size / (num_decode * stretch)
    return p.turns * p.gen_tokens_per_turn * iteration * stretch


def t_prefill(p: WorkloadProfile, num_prefill: N, num_decode: N) -> N:
    """``S-bar * ( (B*dL/N_P)*t_prefill + B*dL*K/(min(N_P, N_D)*BW) )``.

    BW is one worker's link: each prefill worker sends its own requests' KV and each
    decode worker receives its own, in parallel, so the batch's KV crosses
    ``min(N_P, N_D)`` links at once. (PEARL.md writes ``B*dL*K/BW`` with BW the pools'
    bandwidth; with a per-worker BW that is the whole batch through one link.) The
    transfer term stays a lower bound: no contention, no latency."""
    tokens = p.batch_size * p.new_tokens_per_turn
    links = np.minimum(num_prefill, num_decode)
    transfer_s = tokens * p.kv_bytes_per_token / (links * p.transfer_bytes_per_s)
    return prefill_turns(p) * ((tokens / num_prefill) * p.prefill_s_per_token + transfer_s)


def t_dis(p: WorkloadProfile, num_prefill: N, num_decode: N) -> N:
    """``max(T_prefill, T_decode) + T_env``."""
    return np.maximum(t_prefill(p, num_prefill, num_decode), t_decode(p, num_decode)) + p.env_s


def kv_feasible(p: WorkloadProfile, num_decode: N) -> N:
    """Decode must hold the batch's KV: ``B*K_seq <= N_D*H_max``."""
    return p.batch_size * p.kv_bytes_per_trajectory <= num_decode * p.kv_capacity_bytes_per_worker


def prefill_feasible(p: WorkloadProfile, num_prefill: N, num_decode: N) -> N:
    """The prefill pool absorbs the step's ``B*S*dL`` tokens without queueing that delays
    decode: at its throughput ``N_P / t_prefill`` (the fitted t_prefill) the pool's busy
    time for ``B*S-bar*dL`` tokens must fit inside the decode path's span
    ``T_decode + T_env``. (PEARL states the constraint in words; this is our reading of
    it, documented in docs/architecture.md.)"""
    tokens = p.batch_size * prefill_turns(p) * p.new_tokens_per_turn
    busy_s = tokens * p.prefill_s_per_token / num_prefill
    return busy_s <= t_decode(p, num_decode) + p.env_s


def predict(p: WorkloadProfile, num_prefill: int, num_decode: int, num_colocated: int) -> float:
    """Predicted makespan of one configuration (colocated or disaggregated)."""
    if num_colocated:
        return float(t_coloc(p, num_colocated))
    return float(t_dis(p, num_prefill, num_decode))
