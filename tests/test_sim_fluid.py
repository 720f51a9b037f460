"""The fluid bound (sim/fluid.py): the same GPUs at perfect utilisation with free
reconfiguration, above every simulated system."""

from __future__ import annotations

import pytest

from pearl_hpc.config.traces import AvailabilityTrace
from pearl_hpc.sim.costmodel import CostModel
from pearl_hpc.sim.fluid import batch_work, elastic_gpu_s, fluid_bound
from pearl_hpc.sim.run import DEFAULT_WORKLOAD, SimRequest, simulate
from pearl_hpc.sim.workload import WorkloadConfig, WorkloadGenerator

COST = CostModel.from_names("h800", "qwen3-8b")
WORKLOAD = WorkloadConfig.load(DEFAULT_WORKLOAD)


def test_elastic_gpu_seconds_integrate_the_trace_over_the_window():
    trace = AvailabilityTrace("t", (10.0, 20.0, 40.0), (2, 6, 0))
    assert elastic_gpu_s(trace, 30.0) == 2 * 10 + 6 * 10  # nothing before 10 s
    assert elastic_gpu_s(trace, 100.0) == 2 * 10 + 6 * 20
    assert elastic_gpu_s(None, 100.0) == 0.0


def test_rewriting_the_history_costs_prefill_and_decode_is_cheapest_in_a_full_batch():
    batch = WorkloadGenerator(WORKLOAD, 0).batch(0)
    reused = batch_work(COST, batch, prefix_reuse=True)
    rewritten = batch_work(COST, batch, prefix_reuse=False)
    assert rewritten.rollout_worker_s > reused.rollout_worker_s
    assert reused.generated_tokens == sum(s.generated_tokens for s in batch)
    # decoding in a full KV batch: far cheaper per token than one sequence at a time
    one_at_a_time = reused.generated_tokens * COST.decode_iteration_s(1, 10_000)
    assert reused.rollout_worker_s < one_at_a_time / 5


def test_the_bound_is_set_by_the_gpus_until_training_is_the_limit():
    common = dict(seed=0, duration_s=7200.0, training_gpus=16, trace=None)
    few = fluid_bound(COST, WORKLOAD, reserved_rollout_gpus=2, **common)  # type: ignore[arg-type]
    many = fluid_bound(COST, WORKLOAD, reserved_rollout_gpus=512, **common)  # type: ignore[arg-type]
    assert few.limited_by == "rollout" and many.limited_by == "training"
    assert many.batches == pytest.approx(7200.0 / many.training_s_per_batch)
    assert few.tokens_per_s < many.tokens_per_s
    # without lending the training GPUs, less fits
    alone = fluid_bound(
        COST,
        WORKLOAD,
        reserved_rollout_gpus=2,
        lend_training_gpus=False,
        **common,  # type: ignore[arg-type]
    )
    assert alone.batches == pytest.approx(2 / 2 * 7200.0 / few.rollout_worker_s_per_batch)
    assert alone.tokens_per_s < few.tokens_per_s


@pytest.mark.parametrize("workload", ["swe-bench", "swe-bench-pearl-mix"])
def test_every_simulated_system_stays_below_its_fluid_bound(workload: str):
    req = SimRequest(
        systems=("roll", "rlboost+", "pearl", "pearl+"),
        segment=2,
        duration_s=1800,
        workload_path=DEFAULT_WORKLOAD.parent / f"{workload}.yaml",
    )
    doc = simulate(req)
    bound = doc["fluid_bound"]
    assert bound["tokens_per_s"] > 0 and bound["limited_by"] in ("rollout", "training")
    shares = {n: r["share_of_fluid_bound"] for n, r in doc["systems"].items()}
    assert all(0 < s < 1 for s in shares.values()), shares
    assert shares["pearl+"] > shares["pearl"] > shares["roll"], shares


def test_the_worker_seconds_breakdown_sums_to_what_the_bound_may_use():
    """Each system's worker-seconds split by where they went (sim/breakdown.py): the
    parts sum to R + W x T; a static system holds no elastic GPU and lends nothing, so
    its training workers only train or idle; PEARL's borrowing uses that idle time."""
    req = SimRequest(systems=("roll", "pearl"), segment=2, duration_s=1800)
    doc = simulate(req)
    bound = doc["fluid_bound"]
    capacity = bound["rollout_worker_s"] + 16 / 2 * 1800  # 16 training GPUs, TP2
    for name, r in doc["systems"].items():
        ws = r["worker_seconds"]
        assert ws["capacity_worker_s"] == pytest.approx(capacity, abs=0.1)
        assert sum(ws["worker_s"].values()) == pytest.approx(capacity, abs=1.0), name
        assert all(v >= -1.0 for v in ws["worker_s"].values()), (name, ws)
        assert ws["worker_s"]["fluid_work"] == pytest.approx(
            r["steps"] * bound["rollout_worker_s_per_batch"], abs=0.5
        )
    roll, pearl = (doc["systems"][n]["worker_seconds"]["worker_s"] for n in ("roll", "pearl"))
    # roll: 4 reserved GPUs, no trace, no borrowing: what segment 2 offers it never holds
    assert roll["offered_not_held"] == pytest.approx(bound["rollout_worker_s"] - 2 * 1800, abs=1)
    assert roll["training_idle"] == pytest.approx(8 * 1800 - roll["training"], abs=1)
    assert pearl["training_idle"] < roll["training_idle"]
