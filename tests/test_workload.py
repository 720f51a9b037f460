"""The seeded workload model (pearl_hpc.sim.workload)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearl_hpc.errors import ConfigError
from pearl_hpc.sim.run import DEFAULT_WORKLOAD
from pearl_hpc.sim.workload import TrajectorySpec, Turn, WorkloadConfig, WorkloadGenerator

SHIPPED = WorkloadConfig.load(DEFAULT_WORKLOAD)


def batches(config: WorkloadConfig, seed: int, steps: int = 2) -> list[list[TrajectorySpec]]:
    gen = WorkloadGenerator(config, seed)
    return [gen.batch(step) for step in range(steps)]


def check_batch(config: WorkloadConfig, batch: list[TrajectorySpec], step: int) -> None:
    assert len(batch) == config.batch_size
    assert len({t.trajectory_id for t in batch}) == len(batch)
    cap = config.max_trajectory_tokens
    for traj in batch:
        assert traj.trajectory_id.startswith(f"s{step}g{traj.group_id}m")
        assert len(traj.turns) in range(1, config.max_turns + 1)
        context = 0
        for i, turn in enumerate(traj.turns):
            assert turn.new_tokens >= 1 and turn.gen_tokens >= 1 and turn.kept_tokens >= 1
            assert turn.kept_tokens <= turn.gen_tokens
            # the prompt of this turn plus its whole response fits the context cap
            assert context + turn.new_tokens + turn.gen_tokens <= cap
            assert turn.new_tokens + turn.gen_tokens <= cap
            assert turn.env_s >= 0
            assert turn.env_s <= config.env_s_max
            if i > 0:
                assert turn.new_tokens <= config.obs_tokens_max
            assert turn.gen_tokens <= config.gen_tokens_max
            context += turn.new_tokens + turn.kept_tokens
        assert traj.turns[-1].env_s == 0.0
        assert context == traj.final_context_tokens <= cap
        assert traj.total_tokens == sum(t.new_tokens + t.gen_tokens for t in traj.turns)
        assert traj.generated_tokens == sum(t.gen_tokens for t in traj.turns)
        assert traj.final_context_tokens <= traj.total_tokens
    # whole groups of group_size (the last one may be cut), members share the prompt
    groups: dict[int, list[TrajectorySpec]] = {}
    for traj in batch:
        groups.setdefault(traj.group_id, []).append(traj)
    sizes = [len(g) for g in groups.values()]
    assert all(s == config.group_size for s in sizes[:-1])
    assert sizes[-1] in range(1, config.group_size + 1)
    for members in groups.values():
        assert len({m.turns[0].new_tokens for m in members}) == 1
        assert [m.trajectory_id for m in members] == [
            f"s{step}g{members[0].group_id}m{i}" for i in range(len(members))
        ]


def test_shipped_config_loads_and_is_sane() -> None:
    assert SHIPPED.batch_size == 64
    assert SHIPPED.group_size == 16
    assert SHIPPED.max_trajectory_tokens == 32768
    assert SHIPPED.staleness == 1


def test_same_seed_same_batches() -> None:
    a = batches(SHIPPED, seed=7, steps=3)
    b = batches(SHIPPED, seed=7, steps=3)
    assert a == b


def test_different_seed_different_batches() -> None:
    a = batches(SHIPPED, seed=0)
    b = batches(SHIPPED, seed=1)
    assert a != b
    assert [t.turns for t in a[0]] != [t.turns for t in b[0]]


def test_consecutive_batches_differ_and_groups_continue() -> None:
    first, second = batches(SHIPPED, seed=3)
    assert [t.turns for t in first] != [t.turns for t in second]
    # group ids keep counting across steps
    assert max(t.group_id for t in first) < min(t.group_id for t in second)
    assert {t.group_id for t in first} == {0, 1, 2, 3}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_shipped_batches_hold_invariants(seed: int) -> None:
    for step, batch in enumerate(batches(SHIPPED, seed)):
        check_batch(SHIPPED, batch, step)


def test_shipped_workload_has_agentic_shape() -> None:
    specs = [t for b in batches(SHIPPED, 0, steps=4) for t in b]
    turns = sorted(len(t.turns) for t in specs)
    assert turns[len(turns) // 2] >= 10  # multi-turn
    # the context cap binds for some trajectories (long tail)
    assert any(t.final_context_tokens > SHIPPED.max_trajectory_tokens // 2 for t in specs)
    # groups share a task but not the rollout
    first_group = [t for t in specs if t.group_id == 0]
    assert len({t.turns for t in first_group}) > 1


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch_size=st.integers(1, 40),
    group_size=st.integers(1, 20),
    max_tokens=st.integers(2, 6000),
    prompt_median=st.floats(10, 10_000),
    turns_median=st.floats(1, 40),
    max_turns=st.integers(1, 60),
    gen_max=st.integers(1, 3000),
    obs_max=st.integers(1, 3000),
)
def test_invariants_hold_for_any_config(
    seed: int,
    batch_size: int,
    group_size: int,
    max_tokens: int,
    prompt_median: float,
    turns_median: float,
    max_turns: int,
    gen_max: int,
    obs_max: int,
) -> None:
    config = dataclasses.replace(
        SHIPPED,
        batch_size=batch_size,
        group_size=group_size,
        max_trajectory_tokens=max_tokens,
        prompt_tokens_median=prompt_median,
        turns_median=turns_median,
        max_turns=max_turns,
        gen_tokens_max=gen_max,
        obs_tokens_max=obs_max,
    )
    gen = WorkloadGenerator(config, seed)
    for step in range(2):
        check_batch(config, gen.batch(step), step)


def test_prompt_longer_than_cap_yields_one_truncated_turn() -> None:
    config = dataclasses.replace(
        SHIPPED, max_trajectory_tokens=100, prompt_tokens_median=5000, prompt_tokens_sigma=0
    )
    batch = WorkloadGenerator(config, 0).batch(0)
    for traj in batch:
        assert traj.turns == (Turn(99, 1, 1, 0.0),)


def test_zero_sigma_is_deterministic_medians() -> None:
    config = dataclasses.replace(
        SHIPPED,
        batch_size=4,
        group_size=2,
        prompt_tokens_sigma=0,
        turns_sigma=0,
        task_difficulty_sigma=0,
        obs_tokens_sigma=0,
        gen_tokens_sigma=0,
        kept_tokens_sigma=0,
        env_s_sigma=0,
        turns_median=3,
        prompt_tokens_median=100,
        obs_tokens_median=50,
        gen_tokens_median=40,
        kept_tokens_median=10,
        env_s_median=2.0,
        max_trajectory_tokens=10_000,
    )
    batch = WorkloadGenerator(config, 123).batch(0)
    expected = (Turn(100, 40, 10, 2.0), Turn(50, 40, 10, 2.0), Turn(50, 40, 10, 0.0))
    assert all(t.turns == expected for t in batch)
    assert [t.group_id for t in batch] == [0, 0, 1, 1]
    assert batch[0].total_tokens == 320
    assert batch[0].final_context_tokens == 230
    assert batch[0].generated_tokens == 120


def test_batch_size_not_multiple_of_group_cuts_last_group() -> None:
    config = dataclasses.replace(SHIPPED, batch_size=20, group_size=16)
    batch = WorkloadGenerator(config, 0).batch(0)
    assert len(batch) == 20
    assert [t.group_id for t in batch].count(0) == 16
    assert [t.group_id for t in batch].count(1) == 4


# ------------------------------------------------------------------- config strictness
def test_from_dict_defaults_and_values() -> None:
    config = WorkloadConfig.from_dict({"batch_size": 8, "env_s_max": 60})
    assert config.batch_size == 8
    assert config.env_s_max == 60.0 and isinstance(config.env_s_max, float)
    assert config.group_size == 16


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'batch_szie'.*valid keys: .*batch_size"):
        WorkloadConfig.from_dict({"batch_szie": 8})


@pytest.mark.parametrize(
    "data,match",
    [
        ({"batch_size": 0}, "batch_size: must be > 0"),
        ({"batch_size": 2.5}, "batch_size: expected an integer"),
        ({"batch_size": True}, "batch_size: expected an integer"),
        ({"staleness": -1}, "staleness: must be >= 0"),
        ({"env_s_median": "fast"}, "env_s_median: expected a number"),
        ({"obs_tokens_sigma": float("nan")}, "finite"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_values_are_rejected(data: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkloadConfig.from_dict(data)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("batch_size: 8\ngroup_sise: 4\n")
    with pytest.raises(ConfigError, match=r"w\.yaml: unknown key 'group_sise'"):
        WorkloadConfig.load(path)
    with pytest.raises(ConfigError, match="no such file"):
        WorkloadConfig.load(tmp_path / "missing.yaml")
