"""The discrete-event simulator (pearl_hpc.sim.engine) driving the production controller:
determinism, the guarantees it checks (census, returns before training, one owner per
GPU), and that elastic and borrowing runs really exercise grants, reclaims and loans."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from pearl_hpc.core.controller import WorkerReleased
from pearl_hpc.core.policies import BorrowingName, ExpansionName, PDPolicyName, PolicyConfig
from pearl_hpc.core.types import Role, Status, Zone
from pearl_hpc.sim import run as run_module
from pearl_hpc.sim.costmodel import CHUNK_TOKENS, CostModel, SimConfigError
from pearl_hpc.sim.engine import Simulator
from pearl_hpc.sim.entities import Request, SimInvariantError, SimWorker, Traj
from pearl_hpc.sim.run import DEFAULT_WORKLOAD, SimRequest, initial_profile, simulate
from pearl_hpc.sim.systems import make_setup
from pearl_hpc.sim.workload import WorkloadConfig

DURATION_S = 1800.0
# A borrowed worker must be back within its deactivation time (3.18 s for Qwen3-8B); a
# training step waiting far longer than the reclaim grace means a lost return.
STALL_S = 60.0


def build(
    system: str,
    *,
    segment: int | None = 2,
    duration_s: float = DURATION_S,
    seed: int = 0,
    rollout_gpus: int | None = None,
    batch_size: int | None = None,
    sim_cls: type[Simulator] = Simulator,
    model: str = "qwen3-8b",
    workload_path: Path = DEFAULT_WORKLOAD,
) -> Simulator:
    """A Simulator built the way :func:`pearl_hpc.sim.run.simulate` builds it."""
    req = SimRequest(
        model=model,
        workload_path=workload_path,
        systems=(system,),
        segment=segment,
        duration_s=duration_s,
        seed=seed,
        rollout_gpus=rollout_gpus,
        batch_size=batch_size,
    )
    cost = CostModel.from_names(req.gpu, req.model, req.tp)
    workload = WorkloadConfig.load(req.workload_path)
    if batch_size is not None:
        workload = dataclasses.replace(workload, batch_size=batch_size)
    trace, duration = req.resolve_trace()
    setup = make_setup(
        system,
        base=PolicyConfig(),
        trace=trace,
        segment=segment,
        rollout_gpus=rollout_gpus,
        training_gpus=req.training_gpus,
        tp=req.tp,
    )
    return sim_cls(
        setup, cost, workload, initial_profile(cost, workload), seed=seed, duration_s=duration
    )


class AuditedSimulator(Simulator):
    """Checks, after every event, what the engine itself only checks at the end or at
    training start: the census, one owner per GPU among live workers (and agreement with
    the controller's table), KV accounting, and no borrowed worker while training runs;
    and at every routing decision, that the engine's candidate heap names the worker a
    scan of every active worker would (the router's least-loaded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.training_executing: int | None = None
        self.training_starts: list[tuple[int, float]] = []
        self.finished_ids: set[str] = set()
        self.audits = 0
        self.routed_checks = 0

    def at(self, time_s: float, prio: int, fn: Callable[..., None], *args: Any) -> None:
        super().at(time_s, prio, self._audited, fn, args)

    def _least(self, role: Role) -> tuple[int, int, int]:
        got = super()._least(role)
        assert got == min(w.candidate for w in self._active(role).values()), (role, got)
        self.routed_checks += 1
        return got

    def _audited(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        fn(*args)
        self.audit()

    def start_training(self, step: int) -> None:
        super().start_training(step)
        assert self.training_executing is None, "two training steps at once"
        self.training_executing = step
        self.training_starts.append((step, self.now))

    def _training_done(self, step: int) -> None:
        assert self.training_executing == step
        self.training_executing = None
        super()._training_done(step)
        # the new weights emptied every prefix cache (running requests keep their KV)
        assert all(not w.cache and w.cached_tokens == 0 for w in self.workers.values())

    def _turn_done(self, req: Any, w: Any) -> None:
        traj = req.traj
        last = traj.turn + 1 >= len(traj.spec.turns)
        super()._turn_done(req, w)
        if last:
            tid = traj.spec.trajectory_id
            assert tid not in self.finished_ids, f"{tid} finished twice"
            self.finished_ids.add(tid)

    def audit(self) -> None:
        self.audits += 1
        self.check_census()
        assert len(self.finished_ids) == self.trajs_finished
        table = self.controller.table
        owner: dict[str, int] = {}
        for slot_id, w in self.workers.items():
            assert w.slot_id == slot_id
            assert slot_id in table, f"live worker {slot_id} is not in the role table"
            slot = table.get(slot_id)
            assert slot.zone is w.zone
            for gpu in slot.gpu_ids:
                assert gpu not in owner, f"GPU {gpu} used by workers {owner[gpu]} and {slot_id}"
                owner[gpu] = slot_id
            # KV: what running requests hold (colocated decoding grows as it generates);
            # the prefix cache fits beside it
            decoding = sum(entry[2].kv_tokens for entry in w.decode)
            if w.grows:
                decoding += sum(w.vt - entry[2].started_vt for entry in w.decode)
            held = decoding + sum(r.kv_tokens for r in w.prefill)
            assert w.kv_used == pytest.approx(held, abs=1e-6 * (1 + held)), (
                slot_id,
                w.kv_used,
                held,
            )
            # decode reads each sequence's prompt and, on average, half its response
            read = sum(e[2].prompt_tokens + e[2].gen_left / 2 for e in w.decode)
            assert w.decode_ctx == pytest.approx(read, abs=1e-6 * (1 + read))
            assert w.kv_used <= w.kv_capacity + 1 or len(w.decode) + len(w.prefill) == 1
            assert w.cached_tokens == sum(w.cache.values())
            assert w.cached_tokens == 0 or w.kv_used + w.cached_tokens <= w.kv_capacity + 1
            if w.state != "active":
                assert not w.decode and not w.prefill and not w.waiting, (slot_id, w.state)
            if w.role is Role.PREFILL:
                assert not w.decode
            if w.role is Role.DECODE:  # prefills only a turn whose prefix it holds
                assert not w.prefill or self.setup.policy.local_prefill
                # preallocated: the prompt and at least the whole response
                assert all(e[2].kv_tokens >= e[2].prompt_tokens + e[2].gen_left for e in w.decode)
        if self.training_executing is not None:
            borrowed = [s for s, w in self.workers.items() if w.zone is Zone.OVERLAP]
            assert not borrowed, f"training runs while overlap workers {borrowed} hold GPUs"
            assert all(s.status is Status.INACTIVE for s in table.overlap_workers())
        assert all(left >= 0 for left in self._left.values())


def finished_steps(sim: Simulator) -> list[Any]:
    return [s for s in sim.steps if s.finished_s > 0]


def training_stalled(sim: Simulator) -> bool:
    """A training step has waited for borrowed GPUs longer than any return can take."""
    ctl = sim.controller
    return (
        ctl.training_state == "waiting"
        and ctl.training_wait_started_s is not None
        and sim.now - ctl.training_wait_started_s > STALL_S
    )


# --------------------------------------------------------------------------- (a)
def test_same_seed_identical_document() -> None:
    req = SimRequest(systems=("pearl",), segment=1, duration_s=DURATION_S, seed=3)
    first, second = simulate(req), simulate(req)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    other = simulate(dataclasses.replace(req, seed=4))
    assert other["systems"] != first["systems"]


def test_same_seed_identical_simulator_state() -> None:
    a = build("pearl", segment=1).run()
    b = build("pearl", segment=1).run()
    assert a.timeline == b.timeline
    assert a.budget == b.budget
    assert a.events == b.events
    assert [r.cause for r in a.controller.history] == [r.cause for r in b.controller.history]
    assert [dataclasses.asdict(s) for s in a.steps] == [dataclasses.asdict(s) for s in b.steps]


# --------------------------------------------------------------------------- (b), (c)
@pytest.mark.parametrize("segment", [1, 2, 3])
@pytest.mark.parametrize("system", ["roll", "rlboost+", "pd+toggle", "pearl", "pearl+"])
def test_invariants_every_event(system: str, segment: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # run through simulate() so the summary is checked too, with the audited engine
    monkeypatch.setattr(run_module, "Simulator", AuditedSimulator)
    keep: dict[str, Simulator] = {}
    doc = simulate(SimRequest(systems=(system,), segment=segment, duration_s=DURATION_S), keep=keep)
    sim = keep[system]
    assert isinstance(sim, AuditedSimulator)
    assert sim.controller.check  # the role table is checked after every controller event
    assert sim.audits == sim.events > 1000
    assert sim.routed_checks > 100  # every routing decision was checked against a scan
    sim.check_census()
    steps = finished_steps(sim)
    # 30 minutes hold two batches on 4 GPUs even with rlboost+'s shortest-queue router
    # (every moved turn re-prefills its context)
    assert len(steps) >= 2
    in_flight = (
        len(sim.pending)
        + sum(len(w.decode) + len(w.prefill) + len(w.waiting) for w in sim.workers.values())
        + sim._in_transit
    )
    assert sim.trajs_started == sim.trajs_finished + in_flight
    assert sim.trajs_started == len(sim.steps) * sim.workload.batch_size
    assert sim.trajs_finished >= len(steps) * sim.workload.batch_size
    # every finished step was trained or is in training / queued for it
    assert sim.training_starts, "no training step ever started"
    assert [s for s, _ in sim.training_starts] == list(range(len(sim.training_starts)))
    assert sim._trained_step >= len(steps) - 3
    assert not training_stalled(sim)
    for rec in steps:
        assert math.isfinite(rec.training_return_s)
        assert 0.0 <= rec.training_return_s <= STALL_S
        assert rec.duration_s > 0
        assert rec.generated_tokens > 0 and rec.trained_tokens > rec.generated_tokens
    # the summary agrees with the simulator
    result = doc["systems"][system]
    assert result["trajectories_started"] == sim.trajs_started
    assert result["trajectories_finished"] == sim.trajs_finished
    assert result["steps"] == len(steps)
    assert result["events"] == sim.events
    for entry in result["per_step"]:
        assert math.isfinite(entry["training_return_wait_s"])
        assert 0.0 <= entry["training_return_wait_s"] <= STALL_S


def test_borrowed_returns_take_the_deactivation_time() -> None:
    sim = build("pearl", segment=2, sim_cls=AuditedSimulator).run()
    waits = [s.training_return_s for s in finished_steps(sim) if s.borrowed_workers]
    assert waits
    deactivation = sim.cost.reconfig_s("deactivation")
    assert all(w == pytest.approx(deactivation) for w in waits)
    # roll never lends its training GPUs: training starts at once
    roll = build("roll", segment=2).run()
    assert all(s.training_return_s == 0.0 for s in finished_steps(roll))


# ---------------------------------------------------------------- negative tests
class LyingSimulator(Simulator):
    """Reports borrowed workers released at once but keeps them running."""

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        lying = [s for s in slot_ids if s in self.workers and self.workers[s].zone is Zone.OVERLAP]
        super().stop_workers([s for s in slot_ids if s not in lying], deadline_s)
        for slot_id in lying:
            self.at(self.now, 1, self.controller.handle, WorkerReleased(slot_id))


class DeafSimulator(Simulator):
    """Ignores every request to stop a borrowed worker."""

    def stop_workers(self, slot_ids: Sequence[int], deadline_s: float | None) -> None:
        super().stop_workers(
            [s for s in slot_ids if s in self.workers and self.workers[s].zone is not Zone.OVERLAP],
            deadline_s,
        )


def test_training_over_live_borrowed_worker_is_detected() -> None:
    sim = build("pearl", segment=2, sim_cls=LyingSimulator)
    with pytest.raises(SimInvariantError, match=r"training step 0 starts while overlap workers"):
        sim.run()


def test_borrowed_worker_never_returned_is_caught_by_the_return_watchdog() -> None:
    # A borrowed worker that never comes back leaves training waiting; the engine's
    # watchdog refuses to go on once the return is RETURN_DEADLINE_S late.
    with pytest.raises(SimInvariantError, match="still waits for borrowed GPUs"):
        build("pearl", segment=2, sim_cls=DeafSimulator).run()
    # a correct run of the same setup neither stalls nor stops
    clean = build("pearl", segment=2).run()
    assert not training_stalled(clean)
    assert len(finished_steps(clean)) > 1 + clean.workload.staleness


def test_census_detects_a_lost_trajectory() -> None:
    sim = build("roll", segment=2, duration_s=300).run()
    sim.check_census()
    sim.trajs_started += 1
    with pytest.raises(SimInvariantError, match="trajectories started but"):
        sim.check_census()


def test_finishing_twice_is_detected() -> None:
    class Twice(Simulator):
        def _turn_done(self, req: Any, w: Any) -> None:
            traj = req.traj
            last = traj.turn + 1 >= len(traj.spec.turns)
            super()._turn_done(req, w)
            if last:  # replay the last turn
                traj.turn -= 1
                traj.context -= traj.spec.turns[traj.turn].new_tokens
                traj.context -= traj.spec.turns[traj.turn].kept_tokens
                super()._turn_done(req, w)

    with pytest.raises(SimInvariantError, match="finished twice"):
        build("roll", segment=2, sim_cls=Twice).run()


# --------------------------------------------------------------------------- (d)
def test_elastic_run_exercises_grants_and_reclaims(monkeypatch: pytest.MonkeyPatch) -> None:
    # segment 2 has no preemptible GPU for its first 2569 s: simulate past that
    monkeypatch.setattr(run_module, "Simulator", AuditedSimulator)
    keep: dict[str, Simulator] = {}
    doc = simulate(SimRequest(systems=("rlboost+",), segment=2, duration_s=3600), keep=keep)
    sim = keep["rlboost+"]
    result = doc["systems"]["rlboost+"]
    assert result["interrupted_turns"] > 0 or result["reconfigurations"] > 2
    assert result["interrupted_turns"] == sim.interrupted_turns > 0
    assert result["reconfigurations"] == len(sim.controller.history) > 2
    causes = [r.cause for r in sim.controller.history]
    assert any(c.startswith("capacity granted") for c in causes)
    assert any(c.startswith("capacity reclaimed") for c in causes)
    assert sim.released  # reclaimed sources were handed back
    assert max(g for _, g in sim.budget) > 4
    assert {s.dedicated_gpus for s in finished_steps(sim)} != {4}
    # nothing borrowed without overlap workers
    assert all(s.borrowed_workers == 0 for s in finished_steps(sim))
    # in the first 1800 s of segment 2 there is nothing to grant: rlboost+ == roll
    early = build("rlboost+", segment=2).run()
    assert early.interrupted_turns == 0
    assert len(early.controller.history) == 1


def test_pearl_borrows_and_roll_never_does() -> None:
    doc = simulate(
        SimRequest(systems=("roll", "pearl"), segment=2, duration_s=DURATION_S), keep=(keep := {})
    )
    pearl = doc["systems"]["pearl"]["per_step"]
    roll = doc["systems"]["roll"]["per_step"]
    assert any(s["borrowed_workers"] > 0 for s in pearl)
    assert all(s["borrowed_workers"] == 0 for s in roll)
    assert all(not state.endswith("-borrowed") for _, _, _, state in keep["roll"].timeline)
    assert any(state == "active-borrowed" for _, _, _, state in keep["pearl"].timeline)
    assert not keep["roll"].controller.table.overlap_workers()
    # roll is four fixed GPUs: two colocated workers, never reconfigured
    assert {(s["num_colocated"], s["num_prefill"], s["num_decode"]) for s in roll} == {(2, 0, 0)}
    assert {s["dedicated_rollout_gpus"] for s in roll} == {4}
    assert doc["systems"]["roll"]["reconfigurations"] == 1
    assert doc["systems"]["roll"]["interrupted_turns"] == 0


# --------------------------------------------------------------------------- (e)
def test_fixed_resources_sweep_static() -> None:
    req = SimRequest(
        systems=("roll",),
        segment=None,
        rollout_gpus=8,
        duration_s=DURATION_S,
        batch_size=16,
        sweep_static=True,
    )
    doc = simulate(req)
    names = list(doc["systems"])  # the systems asked for, then pd-only and the sweep
    assert names == ["roll", "pd-only", "static-coloc", "static-1P3D", "static-2P2D", "static-3P1D"]
    assert doc["rollout_gpus"] == 8 and doc["segment"] is None and doc["trace"] is None
    for name, result in doc["systems"].items():
        assert result["throughput_tokens_per_s"] > 0, name
        assert result["steps"] >= 1
        assert result["interrupted_turns"] == 0  # nothing elastic, nothing borrowed
        for entry in result["per_step"]:
            assert entry["borrowed_workers"] == 0
            assert entry["dedicated_rollout_gpus"] == 8
            if name == "static-coloc":
                assert entry["mode"] == "colocated"
                assert (entry["num_colocated"], entry["num_prefill"]) == (4, 0)
            elif name.startswith("static-"):
                p, d = int(name[7]), int(name[9])
                assert entry["mode"] == "disaggregated"
                assert (entry["num_prefill"], entry["num_decode"]) == (p, d)
                assert entry["num_colocated"] == 0
            else:
                assert entry["num_colocated"] + entry["num_prefill"] + entry["num_decode"] == 4
    ratios = doc["ratios_vs_static-coloc"]
    assert ratios["static-coloc"] == 1.0
    assert set(ratios) == set(names)
    assert doc["ratios_vs_roll"]["roll"] == 1


def test_disaggregated_run_holds_invariants() -> None:
    sim = build(
        "static-1P3D", segment=None, rollout_gpus=8, batch_size=16, sim_cls=AuditedSimulator
    ).run()
    assert len(finished_steps(sim)) >= 3
    assert sim.prefilled_tokens > 0


@pytest.mark.parametrize(
    "req,match",
    [
        (SimRequest(sweep_static=True), "--sweep-static needs fixed resources"),
        (SimRequest(segment=2, duration_s=9000), "longer than segment 2"),
        (SimRequest(systems=("roll", "nope")), "unknown system 'nope'"),
        (SimRequest(router="random"), "--router"),
        (SimRequest(systems=("static-2P3D",), rollout_gpus=8), "needs 4 workers"),
        (SimRequest(gpu="v100"), "unknown GPU"),
    ],
)
def test_bad_requests(req: SimRequest, match: str) -> None:
    with pytest.raises(SimConfigError, match=match):
        simulate(dataclasses.replace(req, duration_s=req.duration_s or 60.0))


def test_unknown_system_fails_before_anything_runs() -> None:
    ticks: list[str] = []
    req = SimRequest(systems=("roll", "pearl", "bogus"), segment=2, duration_s=DURATION_S)
    with pytest.raises(SimConfigError, match="unknown system 'bogus'"):
        simulate(req, progress=lambda name, t, total: ticks.append(name))
    assert ticks == []


def test_fixed_resources_apply_to_every_system() -> None:
    doc = simulate(
        SimRequest(
            systems=("roll", "roll-large", "rlboost+", "pearl"),
            segment=None,
            rollout_gpus=6,
            duration_s=DURATION_S,
            batch_size=16,
        )
    )
    for name, result in doc["systems"].items():
        assert {s["dedicated_rollout_gpus"] for s in result["per_step"]} == {6}, name
        if name != "pearl":  # pearl alone borrows the idle training GPUs (test below)
            assert all(s["borrowed_workers"] == 0 for s in result["per_step"]), name
            assert result["interrupted_turns"] == 0, name


@pytest.mark.parametrize(
    "segment,fraction,model,duration_s",
    [
        (1, 0.5, "qwen3-8b", 1800.0),
        (1, 0.25, "qwen3-30b-a3b", 1800.0),
        (2, 0.5, "qwen3-8b", 3000.0),
    ],
)
def test_disaggregated_elastic_borrowing_stress(
    segment: int, fraction: float, model: str, duration_s: float
) -> None:
    """Fixed P:D splits with trace-driven grants and reclaims *and* borrowing: KV
    transfers, interrupted transfers, impossible survivors (P without D) and returns
    before training all at once, audited after every event."""
    base = build("pearl", segment=segment, model=model)
    policy = dataclasses.replace(
        PolicyConfig(),
        pd_policy=PDPolicyName.FIXED_RATIO,
        borrowing=BorrowingName.GATED,
        expansion=ExpansionName.ALWAYS,
        prefill_fraction=fraction,
    )
    setup = dataclasses.replace(base.setup, name="stress", policy=policy)
    sim = AuditedSimulator(
        setup,
        base.cost,
        base.workload,
        initial_profile(base.cost, base.workload),
        seed=segment,
        duration_s=duration_s,
    ).run()
    steps = finished_steps(sim)
    assert len(steps) >= 4
    assert all(s.mode == "disaggregated" for s in steps)
    assert any(s.borrowed_workers > 0 for s in steps)
    assert not training_stalled(sim)
    assert sim.interrupted_turns > 0
    assert all(0.0 <= s.training_return_s <= STALL_S for s in steps)


def test_grants_not_worth_their_preparation_are_counted_and_given_back() -> None:
    """PEARL's gate over a 30 s expected window (the 56 s preparation never pays): every
    grant of segment 1 is rejected, counted in ``expansions_rejected``, and no elastic
    worker ever starts; with the configured window none is rejected."""

    class Counted(Simulator):
        elastic_starts = 0

        def start_workers(self, adds: Sequence[Any]) -> None:
            self.elastic_starts += sum(1 for a in adds if a.source is not None)
            super().start_workers(adds)

    base = build("pearl", segment=1)
    counts = {}
    for window_s in (30.0, base.setup.policy.expected_capacity_window_s):
        policy = dataclasses.replace(base.setup.policy, expected_capacity_window_s=window_s)
        setup = dataclasses.replace(base.setup, policy=policy)
        sim = Counted(
            setup, base.cost, base.workload, initial_profile(base.cost, base.workload),
            seed=1, duration_s=1800.0,
        ).run()  # fmt: skip
        counts[window_s] = (run_module._summary(sim)["expansions_rejected"], sim.elastic_starts)
    (rejected, started), (rejected_default, started_default) = counts.values()
    assert rejected > 0 and started == 0
    assert rejected_default == 0 and started_default > 0


# --------------------------------------------------------------------------- (f)
def test_throughput_is_mean_of_steps_and_ratios() -> None:
    doc = simulate(
        SimRequest(systems=("roll", "rlboost+", "pearl"), segment=1, duration_s=DURATION_S)
    )
    assert doc["ratios_vs_roll"]["roll"] == 1
    assert doc["ratios_vs_rlboost+"]["rlboost+"] == 1
    roll_tp = doc["systems"]["roll"]["throughput_tokens_per_s"]
    for name, result in doc["systems"].items():
        per_step = result["per_step"]
        assert len(per_step) == result["steps"] > 0
        mean = sum(s["throughput_tokens_per_s"] for s in per_step) / len(per_step)
        assert result["throughput_tokens_per_s"] == pytest.approx(mean, abs=2e-3)
        assert doc["ratios_vs_roll"][name] == pytest.approx(
            result["throughput_tokens_per_s"] / roll_tp, abs=1e-4
        )
        assert result["rollout_tokens"] == sum(s["rollout_tokens"] for s in per_step)
        assert result["trained_tokens"] == sum(s["trained_tokens"] for s in per_step)
        for s in per_step:
            assert s["throughput_tokens_per_s"] == pytest.approx(
                (s["rollout_tokens"] + s["trained_tokens"]) / s["duration_s"], rel=1e-4
            )
        # step windows tile the timeline
        for a, b in itertools.pairwise(per_step):
            assert b["started_s"] == a["finished_s"]
        assert per_step[0]["started_s"] == 0.0
        assert per_step[-1]["finished_s"] <= DURATION_S


def test_pearl_borrows_idle_training_gpus_on_fixed_resources() -> None:
    """Fixed 4 rollout GPUs, 16 training GPUs idle during rollout: the gated policy
    borrows them (each borrow pays off by minutes against a T_toggle of seconds), as
    the ungated ablation does; the decision engine alone (pd-only) cannot."""
    req = SimRequest(
        systems=("pd-only", "pd+toggle", "pearl"),
        segment=None,
        rollout_gpus=4,
        duration_s=DURATION_S,
        batch_size=16,
    )
    doc = simulate(req)
    borrowed = {
        name: sum(s["borrowed_workers"] > 0 for s in r["per_step"])
        for name, r in doc["systems"].items()
    }
    assert borrowed["pd-only"] == 0
    assert borrowed["pearl"] >= 1 and borrowed["pd+toggle"] >= 1
    tput = {name: r["throughput_tokens_per_s"] for name, r in doc["systems"].items()}
    assert tput["pearl"] > 1.1 * tput["pd-only"]


def test_the_calibrated_workload_prefills_pearls_share_of_tokens() -> None:
    """swe-bench-pearl-mix is calibrated to PEARL.md section 1's 96.7% of tokens
    prefilled: its agent rewrites its history, so no turn reuses a cached prefix; the
    uncalibrated swe-bench mix reuses them and prefills far less. The time colocated
    workers spend in prefill iterations follows (PEARL: 26.5%)."""
    from pearl_hpc.cli.common import resolve_workload

    share, time_share = {}, {}
    for name in ("swe-bench", "swe-bench-pearl-mix"):
        req = SimRequest(
            systems=("roll",),
            segment=None,
            rollout_gpus=8,
            duration_s=DURATION_S,
            batch_size=16,
            workload_path=resolve_workload(name),
        )
        roll = simulate(req)["systems"]["roll"]
        share[name], time_share[name] = roll["prefill_token_share"], roll["prefill_time_share"]
    assert share["swe-bench-pearl-mix"] == pytest.approx(0.967, abs=0.01)
    assert share["swe-bench"] < 0.8
    assert 0 < time_share["swe-bench"] < time_share["swe-bench-pearl-mix"] < 1
    assert time_share["swe-bench-pearl-mix"] > 4 * time_share["swe-bench"]


def test_a_prefill_iteration_batches_queued_prompts_up_to_the_token_budget() -> None:
    sim = build("static-2P2D", segment=None, rollout_gpus=8)
    traj = Traj(sim.batches(0)[0], 0)
    pre = SimWorker(99, Role.PREFILL, Zone.DEDICATED, 10**7)
    for tokens in (1000, 1500, 500):
        sim._enter(pre, "prefill", Request(traj, prefill_tokens=tokens, prompt_tokens=tokens))
    sim._reschedule(pre)
    assert pre.chunk == 3000  # three prompts in one iteration, first come first served
    assert pre.prefill_rate * pre.iteration_s == pytest.approx(3000)
    sim._enter(pre, "prefill", Request(traj, prefill_tokens=9000, prompt_tokens=9000))
    sim._reschedule(pre)
    assert pre.chunk == CHUNK_TOKENS
    # a colocated iteration's decode tokens come out of the same budget
    col = SimWorker(98, Role.COLOCATED, Zone.DEDICATED, 10**7)
    for _ in range(100):
        sim._enter(col, "decode", Request(traj, gen_left=50, prompt_tokens=100))
    sim._enter(col, "prefill", Request(traj, prefill_tokens=20000, prompt_tokens=20000))
    sim._reschedule(col)
    assert col.chunk == CHUNK_TOKENS - 100


def test_colocated_kv_runs_out_and_the_newest_request_is_preempted_and_recomputed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128 trajectories of long responses on one 30B worker: their prompts fit, their
    responses do not (~1M tokens against 763K), so decoding fills the KV; the newest
    requests are preempted, wait, and recompute. Nothing is lost or finished twice and
    the KV never overflows (audited after every event)."""
    workload = tmp_path / "long-responses.yaml"
    workload.write_text(
        "batch_size: 128\nturns_median: 2\nturns_sigma: 0\ntask_difficulty_sigma: 0\n"
        "prompt_tokens_median: 2000\nprompt_tokens_sigma: 0\ngen_tokens_median: 7000\n"
        "gen_tokens_sigma: 0.2\ngen_tokens_max: 16000\nenv_s_median: 1\nenv_s_sigma: 0\n"
    )
    monkeypatch.setattr(run_module, "Simulator", AuditedSimulator)
    keep: dict[str, Simulator] = {}
    req = SimRequest(
        model="qwen3-30b-a3b",
        systems=("roll",),
        segment=None,
        rollout_gpus=2,
        duration_s=1200,
        workload_path=workload,
    )
    roll = simulate(req, keep=keep)["systems"]["roll"]
    sim = keep["roll"]
    assert roll["preempted_turns"] > 0 and roll["kv_waits"] > 0  # readmissions waited
    assert roll["steps"] >= 1 and sim.trajs_finished >= 128
    assert sim.interrupted_turns == 0  # preemption is not a drain: the turn stays here


def test_no_engine_generates_while_the_new_weights_load() -> None:
    class Watched(Simulator):
        pauses = 0

        def _pause_for_sync(self, until_s: float) -> None:
            super()._pause_for_sync(until_s)
            vts = {s: w.vt for s, w in self.workers.items()}
            # just before the load ends, no worker has moved
            self.at(until_s - 1e-6, 0, self._check_paused, vts)

        def _check_paused(self, vts: dict[int, float]) -> None:
            Watched.pauses += 1
            for slot_id, vt in vts.items():
                w = self.workers.get(slot_id)
                if w is not None:
                    self._advance(w)
                    assert w.vt == vt and w.decode_rate == 0.0

    sim = build("roll", segment=None, rollout_gpus=4, sim_cls=Watched).run()
    assert Watched.pauses >= 2 and sim.cost.weight_sync_s > 0.1


def test_pearl_plus_starts_the_next_batch_in_the_tail_and_trains_in_step_order() -> None:
    """tail_start: batch j+1's trajectories start before batch j's last one finishes
    (when the staleness bound allows), training still takes the batches in step order,
    and the workers idle less than PEARL's, which waits for the whole batch."""
    sims = {name: build(name, segment=2, duration_s=3600).run() for name in ("pearl", "pearl+")}
    plus = sims["pearl+"]
    overlaps = [
        (a.step, b.step)
        for a, b in itertools.pairwise(plus.steps)
        if a.finished_s == 0 or b.rollout_started_s < a.finished_s
    ]
    assert overlaps, "no batch started before the previous one finished"
    for a, b in itertools.pairwise(sims["pearl"].steps):  # PEARL: one batch at a time
        assert a.finished_s == 0 or b.rollout_started_s >= a.finished_s
    done = [s for s in plus.steps if s.finished_s > 0]
    idle = {
        n: sum(s.idle_worker_s for s in finished_steps(sim))
        / sum(s.active_worker_s for s in finished_steps(sim))
        for n, sim in sims.items()
    }
    assert idle["pearl+"] < idle["pearl"]
    assert len(done) >= len(finished_steps(sims["pearl"]))
    assert plus._next_train == plus._trained_step + 1 + (plus._training_running is not None)


def test_a_staleness_of_two_keeps_three_batches_in_flight_within_the_bound() -> None:
    """pearl+ with ``--max-staleness 2``: batch j+2 starts before batch j has finished
    (never at staleness 1), but only once training step j-1 has (batch j may start once
    step j-1-s is trained); more batches train in the hour."""
    sims: dict[int, Simulator] = {}
    for s in (1, 2):
        kept: dict[str, Simulator] = {}
        req = SimRequest(segment=2, duration_s=3600, systems=("pearl+",), max_staleness=s)
        simulate(req, keep=kept)
        sims[s] = kept["pearl+"]

    def three_in_flight(sim: Simulator) -> list[int]:
        steps = sim.steps
        return [
            a.step
            for a, c in zip(steps, steps[2:], strict=False)
            if a.finished_s == 0 or c.rollout_started_s < a.finished_s
        ]

    assert three_in_flight(sims[2]) and not three_in_flight(sims[1])
    trained = {s.step: s.trained_s for s in sims[2].steps}
    for rec in sims[2].steps[3:]:
        assert 0 < trained[rec.step - 3] <= rec.rollout_started_s, rec
    assert len(finished_steps(sims[2])) > len(finished_steps(sims[1]))


def test_tail_level_is_where_decode_runs_at_half_its_bound() -> None:
    from pearl_hpc.core.policies import tail_level

    profile = initial_profile(CostModel.from_names("h800", "qwen3-8b"), WorkloadConfig())
    a, b = profile.decode_fixed_s, profile.decode_per_seq_s
    assert tail_level(profile, 4) == pytest.approx(4 * a / b)
    assert tail_level(profile.replace(decode_per_seq_s=0.0), 4) == 4
    assert tail_level(profile.replace(decode_fixed_s=0.0), 4) == 4  # at least one each


def test_conditional_disaggregation_pays_where_the_kv_transfer_is_slow() -> None:
    """local_prefill on a static 2P6D split (16 GPUs, prefixes reused): a turn whose
    prefix its decode worker holds is prefilled there when that beats the transfer. On a
    slow fabric (2 GB/s) many turns qualify and the split gets faster; on the data
    sheet's 50 GB/s few do (the interference outweighs a cheap transfer). Audited."""

    def run(local: bool, kv_bytes_per_s: float) -> Simulator:
        sim = build("static-2P6D", segment=None, rollout_gpus=16, sim_cls=AuditedSimulator)
        policy = dataclasses.replace(sim.setup.policy, local_prefill=local)
        cost = dataclasses.replace(sim.cost, kv_transfer_bytes_per_s=kv_bytes_per_s)
        return AuditedSimulator(
            dataclasses.replace(sim.setup, policy=policy),
            cost,
            sim.workload,
            initial_profile(cost, sim.workload),
            seed=0,
            duration_s=1800,
        ).run()

    def tokens_per_s(sim: Simulator) -> float:
        steps = finished_steps(sim)
        return sum(s.generated_tokens + s.trained_tokens for s in steps) / steps[-1].finished_s

    slow_off, slow_on = run(False, 2e9), run(True, 2e9)
    fast_on = run(True, 50e9)
    assert slow_off.local_prefills == 0
    assert slow_on.local_prefills > 5 * fast_on.local_prefills > 0
    assert tokens_per_s(slow_on) > 1.02 * tokens_per_s(slow_off)


def test_prefill_locally_weighs_the_stalled_decodes_against_the_transfer() -> None:
    from pearl_hpc.core.policies import prefill_locally

    profile = initial_profile(CostModel.from_names("h800", "qwen3-8b"), WorkloadConfig())
    per_token = profile.kv_bytes_per_token / profile.transfer_bytes_per_s
    ratio = per_token / profile.prefill_s_per_token  # local tokens per prompt token, alone
    prompt = 20000
    assert prefill_locally(profile, int(ratio * prompt), prompt, decoding=0)
    assert not prefill_locally(profile, int(ratio * prompt) + 10, prompt, decoding=0)
    assert not prefill_locally(profile, int(ratio * prompt), prompt, decoding=3)
    assert prefill_locally(profile, int(ratio * prompt / 4), prompt, decoding=3)


def test_turns_left_is_the_mean_residual_of_the_finished_trajectories() -> None:
    from pearl_hpc.core.policies import TurnsLeft

    left = TurnsLeft(prior_mean=30)
    assert left.expected(5) == 25 and left.expected(40) == 1  # the prior, at least one
    for turns in (10, 20, 30, 40):
        left.observe(turns)
    assert left.expected(0) == 25  # the mean
    assert left.expected(15) == 15  # (20 + 30 + 40) / 3 - 15
    assert left.expected(35) == 5  # only the 40-turn one is longer
    assert left.expected(40) == 1  # none longer: the prior's floor


def test_tail_dispatch_keeps_every_queue_in_batch_then_remaining_work_order() -> None:
    """tail_dispatch on pearl+tail (two batches in flight) with 4 GPUs, where queues
    form: each worker's queued prefills (behind the one under way) and KV admissions are
    ordered oldest batch first, then longest predicted remaining work; the predictor
    learns from the finished trajectories; nothing is lost (audited)."""

    class Watched(AuditedSimulator):
        checks = 0
        reordered = 0

        def _enter(self, w, phase, req, *, reserve=True):  # type: ignore[no-untyped-def]
            if phase == "prefill" and w.prefill and req.order < w.prefill[-1].order:
                Watched.reordered += 1
            super()._enter(w, phase, req, reserve=reserve)
            queued = [r.order for r in list(w.prefill)[1:]]
            waiting = [r.order for _, r in w.waiting if r.order != (0, 0.0, 0)]
            assert queued == sorted(queued)
            assert waiting == sorted(waiting) or any(o[0] for o in waiting)
            Watched.checks += 1

    sim = build("pearl+tail+dispatch", segment=None, rollout_gpus=4, sim_cls=Watched).run()
    assert Watched.checks > 1000 and Watched.reordered > 0
    counts = sim.turns_left.counts
    assert sum(counts.values()) == sim.trajs_finished > 0
    mean = sum(t * n for t, n in counts.items()) / sim.trajs_finished
    assert sim.turns_left.expected(0) == pytest.approx(mean)


def test_prewarm_moves_finalisation_off_every_workers_admission() -> None:
    """prewarm: an elastic joiner catches up to the latest weights in its own background
    (preparation + finalisation) and is admitted without pausing anyone; PEARL's atomic
    finalisation pauses every worker's admission instead. Same trace, same grants."""

    class Counting(AuditedSimulator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.paused_s = 0.0
            self.ready_after: list[float] = []
            self._started: dict[int, float] = {}

        def admit(self, slot_ids: Sequence[int]) -> None:
            before = max(self.admission_paused_until, self.now)
            super().admit(slot_ids)
            self.paused_s += max(0.0, self.admission_paused_until - before)

        def start_workers(self, adds: Sequence[Any]) -> None:
            self._started.update((a.slot_id, self.now) for a in adds if not a.reactivate)
            super().start_workers(adds)

        def _worker_ready(self, slot_id: int, w: SimWorker) -> None:
            if slot_id in self._started and self.workers.get(slot_id) is w:
                self.ready_after.append(self.now - self._started.pop(slot_id))
            super()._worker_ready(slot_id, w)

    def run(prewarm: bool) -> Counting:
        sim = build("pearl", segment=2)
        policy = dataclasses.replace(sim.setup.policy, prewarm=prewarm)
        return Counting(
            dataclasses.replace(sim.setup, policy=policy),
            sim.cost,
            sim.workload,
            initial_profile(sim.cost, sim.workload),
            seed=0,
            duration_s=DURATION_S,
        ).run()

    pearl, warm = run(False), run(True)
    prep, fin = pearl.cost.reconfig_s("preparation"), pearl.cost.reconfig_s("finalisation")
    assert pearl.paused_s >= fin > 0 and warm.paused_s == 0.0
    assert pearl.ready_after and all(t == pytest.approx(prep) for t in pearl.ready_after)
    assert warm.ready_after and all(t == pytest.approx(prep + fin) for t in warm.ready_after)


def test_role_changes_in_place_take_no_restart() -> None:
    """pearl+inplace: a role change is a drain and a new label (the real engines' NIXL
    kv_both), where pearl pays PEARL's measured restart; the same decisions otherwise."""

    class Timed(AuditedSimulator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rerole_s: list[float] = []
            self._since: dict[int, float] = {}

        def change_roles(self, changes: Sequence[tuple[int, Any]]) -> None:
            for slot_id, _role in changes:
                if self.workers[slot_id].state not in ("starting", "rerole"):
                    self._since[slot_id] = self.now
            super().change_roles(changes)

        def _rerole_done(self, slot_id: int, w: SimWorker) -> None:
            if slot_id in self._since and self.workers.get(slot_id) is w:
                self.rerole_s.append(self.now - self._since.pop(slot_id))
            super()._rerole_done(slot_id, w)

    # PEARL's mix: the workload on which pearl re-roles workers on the traces (on the
    # default it stays colocated: README, beyond PEARL)
    mix = DEFAULT_WORKLOAD.with_name("swe-bench-pearl-mix.yaml")
    pearl, in_place = (
        build(name, segment=1, workload_path=mix, sim_cls=Timed).run()
        for name in ("pearl", "pearl+inplace")
    )
    assert pearl.rerole_s and all(t == pytest.approx(20.0) for t in pearl.rerole_s)
    assert in_place.rerole_s and all(t == 0.0 for t in in_place.rerole_s)
