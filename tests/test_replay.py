"""A finished run replayed in the simulator (``pearl-hpc validate-sim``, the report's
counterfactual): the replay takes the run's recorded timeline, trajectories and costs.

The run directories here are written by the test in pearl-hpc's formats (a unit test of
the replay); ``test_local_run`` and ``test_slurm_run`` replay the runs of real worlds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pearl_hpc.cli.main import main
from pearl_hpc.config import REPO_CONFIGS, load_profile
from pearl_hpc.master.journal import TrajectoryLog
from pearl_hpc.rollout.types import Segment, Trajectory, TurnStats
from pearl_hpc.sim import counterfactual as cf
from pearl_hpc.sim.replay import ReplayError, capacity_trace, load_run, recorded_batch

PRIOR = REPO_CONFIGS / "profiles" / "tiny-cpu-pd-prior.yaml"
STEPS = 3
GROUPS, GROUP_SIZE = 4, 4


def _trajectory(step: int, g: int, k: int, turns: int = 2) -> Trajectory:
    """Two turns (or the first alone); the second's context keeps 10 of the first's 30
    response tokens."""
    first = TurnStats(0, 40 + k, 30, 70 + k, 0.05 * (step + 1), ("w0",))
    second = TurnStats(1, 12, 20, 40 + k + 10 + 12 + 20, 0.0, ("w0",))
    segments = [Segment((1,) * (40 + k), False), Segment((2,) * 30, True),
                Segment((3,) * 12, False), Segment((4,) * 20, True)]  # fmt: skip
    return Trajectory(f"s{step}-g{g}-k{k}", f"s{step}-g{g}", segments[: 2 * turns],
                      done=turns == 2, turns=[first, second][:turns])  # fmt: skip


def write_run(root: Path, *, reserved: int = 1, resumed: bool = False) -> Path:
    """A finished 3-step run: start-up until 2.0 s, an elastic grant during it (ready at
    3.0 s), reclaimed at 5.0 s, a second grant at 6.0 s."""
    run = root / "run"
    (run / "trajectories").mkdir(parents=True)
    config = yaml.safe_load((REPO_CONFIGS / "runs" / "local.yaml").read_text())
    config["profile"] = str(PRIOR)
    config["workers"]["reserved_rollout"] = reserved
    config["run"].update(steps=STEPS, num_groups=GROUPS, group_size=GROUP_SIZE)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    fitted = load_profile(PRIOR).replace(prefill_s_per_token=6e-5, decode_fixed_s=0.005)
    counters = {"activation_s": [0.8], "deactivation_s": [0.4], "mode_changes": 1}
    (run / "summary.json").write_text(json.dumps({"profile": fitted.to_dict(),
                                                  "counters": counters}))  # fmt: skip
    events = [
        {"t_s": 0.0, "kind": "clock", "wall": 1.0},
        {"t_s": 1.0, "kind": "event", "event": "CapacityGranted", "source": "el1+0"},
        {"t_s": 2.0, "kind": "admit", "slots": [2]},
        {"t_s": 3.0, "kind": "ready", "slot": 3, "source": "el1+0", "s": 2.0},
        {"t_s": 4.0, "kind": "rerole", "slot": 2, "role": "colocated", "s": 0.25},
        {"t_s": 5.0, "kind": "event", "event": "CapacityReclaimed", "source": "el1+0"},
        {"t_s": 6.0, "kind": "event", "event": "CapacityGranted", "source": "el2+0"},
    ]
    if resumed:
        events.append({"t_s": 0.0, "kind": "clock", "wall": 99.0})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = []
    log = TrajectoryLog(run)  # what a master writes: a record per turn
    for step in range(STEPS):
        for turns in (1, 2):
            for g in range(GROUPS):
                for k in range(GROUP_SIZE):
                    log.record(step, _trajectory(step, g, k, turns))
    log.close()
    for step in range(STEPS):
        metrics.append({"step": step, "t_s": 10.0 * (step + 1), "rollout_s": 5.0,
                        "train_s": 2.0, "sync_s": 0.1, "generated_tokens": 16 * 50,
                        "config": "1P1D" if step == 0 else "2C",
                        "rollout_started_s": 0.5 + 10 * step,
                        "rollout_ended_s": 6.0 + 10 * step})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def test_the_replay_takes_the_runs_recorded_timeline(tmp_path: Path) -> None:
    record = load_run(write_run(tmp_path))
    assert record.startup_s == 2.0
    # the grant during start-up is there at 0; the reclaim and the next grant at their
    # times on the replay's clock (the run's less the start-up)
    trace = record.capacity
    assert trace is not None
    assert (trace.times_s, trace.counts) == ((0.0, 3.0, 4.0), (1, 0, 1))
    lat = record.cost.latencies
    assert lat["preparation"] == 1.0  # ready 3.0 - the start-up's end 2.0
    assert (lat["activation"], lat["deactivation"], lat["rerole"]) == (0.8, 0.4, 0.25)
    assert record.cost.train_s_per_token == pytest.approx(
        6.0 / sum(s.total_tokens for b in record.batches for s in b)
    )
    # step 0's rollout from the start-up's end; each record on the replay's clock
    assert [s.rollout_s for s in record.steps] == [4.0, 5.5, 5.5]
    assert [s.recorded_s for s in record.steps] == [8.0, 18.0, 28.0]

    sim = cf.replay(record, cf.setups(record)[cf.PEARL])
    # the simulator met the same capacity at the same times: reserved 1, elastic 1
    assert sim.steps[-1].trained_s > 4.0
    # the recorded trajectories, every step trained, and nothing more
    assert [s.generated_tokens for s in sim.steps] == [16 * 50] * STEPS
    assert len(sim.steps) == STEPS and all(s.trained_s > 0 for s in sim.steps)
    assert sim.trajs_finished == sim.trajs_started == STEPS * 16


def test_recorded_turns_keep_what_the_next_context_shows() -> None:
    (spec,) = recorded_batch([_trajectory(0, 0, 3)], overhead_s=0.02)
    first, second = spec.turns
    assert (first.new_tokens, first.gen_tokens, first.kept_tokens) == (43, 30, 10)
    assert first.env_s == pytest.approx(0.07)  # the environment + the per-turn overhead
    assert (second.kept_tokens, second.env_s) == (20, 0.0)  # the last turn waits nothing


def test_the_counterfactual_replays_every_system_on_the_same_inputs(tmp_path: Path) -> None:
    record = load_run(write_run(tmp_path, reserved=3))
    doc = cf.counterfactual(record)
    names = [r["system"] for r in doc["systems"]]
    assert names == ["pearl", "no borrowing", "no elastic", "colocated only",
                     "static colocated", "static 1P2D", "static 2P1D", "rlboost+"]  # fmt: skip
    assert all(r["finished"] and len(r["per_step"]) == STEPS for r in doc["systems"])
    assert sum(r["best_static"] for r in doc["systems"]) == 1
    best = min((r for r in doc["systems"] if r["system"].startswith("static")),
               key=lambda r: r["run_s"])  # fmt: skip
    assert best["best_static"]
    statics = [r for r in doc["systems"] if r["system"].startswith("static")]
    assert all(r["elastic_worker_s"] == 0 and r["borrow_cycles"] == 0 for r in statics)
    assert doc["systems"][-1]["elastic_worker_s"] > 0  # rlboost+ takes every grant
    pearl = doc["systems"][0]
    v = doc["validation"]
    assert [r["measured_rollout_s"] for r in v["per_step"]] == [4.0, 5.5, 5.5]
    assert v["run_error"] == pytest.approx((pearl["run_s"] - 28.0) / 28.0, abs=1e-3)
    table = cf.format_validation(doc)
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + STEPS
    assert "static 1P2D" in cf.format_systems(doc)


def test_validate_sim_prints_the_error_and_refuses_a_resumed_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate-sim", str(write_run(tmp_path / "a"))]) == 0
    out = capsys.readouterr().out
    assert "overall: rollout" in out and "not modelled:" in out
    resumed = write_run(tmp_path / "b", resumed=True)
    with pytest.raises(ReplayError, match="resumed 1 time"):
        load_run(resumed)
    assert main(["validate-sim", str(resumed)]) == 2
    assert "resumed 1 time" in capsys.readouterr().err


def test_a_failed_elastic_worker_takes_its_capacity_with_it() -> None:
    events = [
        {"t_s": 1.0, "kind": "event", "event": "CapacityGranted", "source": "el1+0"},
        {"t_s": 2.0, "kind": "ready", "slot": 3, "source": "el1+0", "s": 1.0},
        {"t_s": 5.0, "kind": "worker_failed", "slot": 3, "reason": "killed"},
        {"t_s": 7.0, "kind": "event", "event": "CapacityGranted", "source": "el2+0",
         "also": ["el2+1"]},  # a heterogeneous job's two components in one grant
        {"t_s": 8.0, "kind": "release_capacity", "source": "el2+1"},  # declined: stays
    ]  # fmt: skip
    trace = capacity_trace(events, origin=0.5)
    assert trace is not None
    assert (trace.times_s, trace.counts) == ((0.0, 0.5, 4.5, 6.5), (0, 1, 0, 2))
