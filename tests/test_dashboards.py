"""Step metrics on TensorBoard (read back with TensorBoard's own reader) and Weights &
Biases in offline mode (no network), under metrics.jsonl's keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pearl_hpc.config.run import DashboardSettings, dashboards_problem
from pearl_hpc.master.dashboards import Dashboards, scalars
from pearl_hpc.master.records import StepMetrics


def metrics(step: int, reward: float) -> StepMetrics:
    values: dict = {f.name: 0 for f in dataclasses.fields(StepMetrics)}
    values.update(roles={"e0": "colocated"}, config="1C", borrowed=step == 1)
    return StepMetrics(**{**values, "step": step, "mean_reward": reward, "rollout_s": 2.5})


def test_scalars_are_the_numeric_metrics_jsonl_keys() -> None:
    values = scalars(metrics(1, 0.5))
    assert values["pearl/mean_reward"] == 0.5 and values["pearl/borrowed"] == 1.0
    assert "pearl/roles" not in values and "pearl/config" not in values
    assert "pearl/step" not in values  # the step is the x axis


def test_tensorboard_event_files_read_by_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the dashboards extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = Dashboards(DashboardSettings(tensorboard=True), tmp_path, "t", {})
    for step, reward in enumerate((0.25, 0.5, 0.75)):
        board.log(metrics(step, reward))
    board.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("pearl/mean_reward")] == [
        (0, 0.25),
        (1, 0.5),
        (2, 0.75),
    ]
    assert [e.value for e in events.Scalars("pearl/borrowed")] == [0.0, 1.0, 0.0]


def test_wandb_offline_writes_the_run_without_a_network(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="pip install wandb (the dashboards extra)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    board = Dashboards(DashboardSettings(wandb_project="pearl-test"), tmp_path, "t", {"lr": 1})
    board.log(metrics(0, 0.25))
    board.log(metrics(1, 0.5))
    board.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{tmp_path.name}"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    data = next(runs[0].glob("run-*.wandb")).read_bytes()  # W&B's binary record log
    assert data.count(b"pearl/mean_reward") >= 2 and b"pearl/tokens_per_s" in data


def test_dashboard_settings_are_checked() -> None:
    assert "use offline or online" in dashboards_problem(DashboardSettings(wandb_mode="cloud"))
    assert dashboards_problem(DashboardSettings()) == ""
