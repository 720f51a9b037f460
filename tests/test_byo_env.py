"""Bring your own environment and tasks: a third-party package, built and pip-installed
in the test, found by its entry point; `pearl-hpc run` trains on it with a task file,
one environment fault stays in its trajectories, and the step metrics reach TensorBoard
event files that TensorBoard's own reader reads."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pearl_hpc.backends.world import run_to_summary
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.rollout.envs import make_env
from pearl_hpc.rollout.envs.registry import plugin_names
from tests.conftest import vllm_skip_reason
from tests.plugin_env import ENTRY_POINT, IMPORT_PATH, install_package


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_package(tmp_path_factory.mktemp("plugin"))


def test_an_installed_package_registers_its_environment(plugin_site: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(plugin_site))
    assert ENTRY_POINT in plugin_names()
    by_entry_point, by_path = make_env(ENTRY_POINT, max_turns=3), make_env(IMPORT_PATH)
    assert type(by_entry_point).__name__ == type(by_path).__name__ == "EchoEnv"
    assert by_entry_point.max_turns == 3

    async def play() -> float:
        await by_path.reset(0, {"id": "a", "word": "tool"})
        return (await by_path.step("a tool")).reward

    assert asyncio.run(play()) == 0.5
    with pytest.raises(
        ConfigError, match=r"echo-word: unknown option\(s\) turns; valid: max_turns"
    ):
        make_env(ENTRY_POINT, turns=3)
    with pytest.raises(ConfigError, match=r"echo-word.max_turns must be int like its default 2"):
        make_env(ENTRY_POINT, max_turns="three")


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "environments.md"


def test_the_guides_environment_example_runs(tmp_path: Path, monkeypatch) -> None:
    """docs/environments.md's "Bring your own environment" block, as a user would save it."""
    text = GUIDE.read_text()
    marker = "<!-- readme-example: my_envs/guess.py -->\n```python\n"
    source = text.split(marker, 1)[1].split("```", 1)[0]
    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "guess.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_envs.guess:make_guess", max_turns=3, high=50)

    async def play() -> list:
        assert "between 1 and 50" in await env.reset(0, {"id": "t", "secret": 7})
        return [await env.step(a) for a in ("I say 5", "then 9", "7!")]

    steps = asyncio.run(play())
    assert [s.observation for s in steps] == ["higher", "lower", None]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0] and steps[-1].done
    with pytest.raises(ConfigError, match=r"guess: unknown option\(s\) hi; valid: max_turns"):
        make_env("my_envs.guess:make_guess", hi=3)


CONFIG = {
    "name": "byo",
    "profile": "profiles/tiny-cpu.yaml",
    "workers": {"training_gpus": 1, "reserved_rollout": 1, "overlap": 0},
    "run": {
        "steps": 1,
        "env": ENTRY_POINT,
        "env_options": {"fail_on": "broken"},
        "max_turns": 2,
        "num_groups": 2,
        "group_size": 4,
        "max_tokens_per_turn": 12,
        "max_staleness": 0,
    },
    "dashboards": {"tensorboard": True},
}


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**config, "runs_dir": str(tmp_path / "runs")}))
    return path


def test_run_config_checks_the_environment_and_the_tasks(tmp_path: Path) -> None:
    bad_env = {**CONFIG, "run": {**CONFIG["run"], "env": "no_such_env"}}
    with pytest.raises(ConfigError, match=r"run\.env 'no_such_env' is unknown"):
        load_run_config(_write(tmp_path, bad_env))
    bad_options = {**CONFIG, "run": {**CONFIG["run"], "env": "calc", "env_options": {"x": 1}}}
    with pytest.raises(ConfigError, match=r"run.env_options: calc: unknown option\(s\) x"):
        load_run_config(_write(tmp_path, bad_options))
    tasks = {"path": str(tmp_path / "none.jsonl")}
    no_file = {**CONFIG, "run": {**CONFIG["run"], "env": "calc", "env_options": {}, "tasks": tasks}}
    with pytest.raises(ConfigError, match=r"run.tasks.path: .*none.jsonl does not exist"):
        load_run_config(_write(tmp_path, no_file))


@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_pearl_hpc_run_trains_a_plugin_environment_on_a_task_file(
    tmp_path: Path, plugin_site: Path, monkeypatch
) -> None:
    monkeypatch.setenv("PEARL_HPC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(plugin_site))  # the world's ranks import it too
    monkeypatch.syspath_prepend(str(plugin_site))
    rows = [{"id": "broken", "word": "x"}] + [
        {"id": f"w{i}", "word": w} for i, w in enumerate(["tool", "value", "answer"])
    ]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = {"path": str(tmp_path / "tasks.jsonl"), "shuffle": False}
    config = {**CONFIG, "run": {**CONFIG["run"], "tasks": tasks}}
    cfg = load_run_config(_write(tmp_path, config))
    run_dir = tmp_path / "runs" / "byo"
    summary = run_to_summary(cfg, run_dir)
    assert summary["steps"] == 1

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the step's tasks: broken (its 4 trajectories fail, the run goes on) and w0
    assert [m["env_failures"] for m in metrics] == [4]
    assert [m["trajectories"] for m in metrics] == [4]
    assert [m["version"] for m in metrics] == [1]
    journal = [
        json.loads(line)
        for f in sorted((run_dir / "trajectories").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    last = {t["trajectory_id"]: t for t in journal}  # the latest record of each
    failed = [t for t in last.values() if t["info"].get("failed")]
    assert len(failed) == 4 and {t["info"]["task_id"] for t in failed} == {"broken"}
    assert "raised RuntimeError: task broken is broken" in failed[0]["info"]["failed"]
    assert {t["info"]["task_id"] for t in last.values()} == {"broken", "w0"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("pearl/mean_reward")
    assert [e.step for e in rewards] == [0]
    assert [round(e.value, 4) for e in rewards] == [m["mean_reward"] for m in metrics]
    assert {"pearl/rollout_s", "pearl/env_failures", "pearl/mismatch_mean"} <= set(
        events.Tags()["scalars"]
    )

    # pass@1 of the trained weights (the newest checkpoint) on HumanEval's held-out split
    evaluate = [sys.executable, "-m", "pearl_hpc.cli", "eval", str(run_dir)]
    no_split = subprocess.run(evaluate, capture_output=True, text=True, timeout=120)
    assert no_split.returncode == 2 and "have no eval split" in no_split.stderr
    assert len(no_split.stderr.strip().splitlines()) == 1
    options = ["--env", "code", "--problems", "2", "--max-turns", "1", "--max-tokens", "16"]
    done = subprocess.run([*evaluate, *options], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((run_dir / "eval" / "code-v1.json").read_text())
    assert report["weights_version"] == 1 and report["problems"] == 2
    assert [p["id"] for p in report["per_problem"]] == ["HumanEval/4", "HumanEval/9"]
    assert 0.0 <= report["pass_at_1"] <= 1.0 and "pass@1" in done.stdout
