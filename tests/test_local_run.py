"""`pearl-hpc run` on the local backend with real engines: elastic grow and reclaim from
the trace, a borrow/return cycle of the overlap worker, GRPO steps with weight sync, and
nothing lost. Three engine processes at most (reserved, elastic, overlap)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from pearl_hpc.errors import ConfigError
from pearl_hpc.local import load_local, run_local
from tests.conftest import vllm_skip_reason

CONFIG = {
    "name": "t",
    "policy": {
        "borrowing": "ungated",  # the mechanism; the gate itself is tested in the core
        "expansion": "always",
        "toggle_cost_s": 3.0,
        "preparation_s": 10.0,
        "finalisation_s": 0.1,
        "expected_capacity_window_s": 120,
    },
    "workers": {"training_gpus": 1, "reserved_rollout": 1, "overlap": 1},
    "elastic": {
        "grace_s": 30,
        "trace": [{"at_step": 0, "workers": 1}, {"at_step": 2, "workers": 0}],
    },
    "run": {
        "steps": 3,
        "env": "calc",
        "max_turns": 2,
        "num_groups": 4,
        "group_size": 4,
        "max_tokens_per_turn": 24,
    },
}


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**config, "runs_dir": str(tmp_path / "runs")}))
    return path


def test_bad_run_config_names_the_field(tmp_path: Path):
    bad = {**CONFIG, "workers": {"training_gpus": 1, "overlap": 2}}
    with pytest.raises(ConfigError, match=r"workers\.overlap"):
        load_local(_write(tmp_path, bad))
    with pytest.raises(ConfigError, match=r"run\.env"):
        load_local(_write(tmp_path, {**CONFIG, "run": {"env": "chess"}}))
    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        load_local(_write(tmp_path, {**CONFIG, "run": {"stepz": 1}}))


@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_local_run_grows_reclaims_borrows_and_loses_nothing(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PEARL_HPC_CACHE", str(tmp_path / "cache"))
    cfg = load_local(_write(tmp_path, CONFIG))
    run_dir = tmp_path / "runs" / "t"
    summary = asyncio.run(run_local(cfg, run_dir))
    print("\n" + json.dumps(summary, indent=1))

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(metrics) == 3
    batch = 4 * 4
    assert [m["trajectories"] for m in metrics] == [batch] * 3  # nothing lost
    assert [m["version"] for m in metrics] == [1, 2, 3]
    c = summary["counters"]
    assert c["grows"] == 1 and c["reclaims"] == 1
    assert c["borrow_cycles"] >= 1
    # borrowed GPUs were back before every training step (the run raises otherwise),
    # and the measured return latency is reported per step
    assert len(c["return_latency_s"]) == 3
    kinds = [
        json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines()
    ]
    assert "release_capacity" in kinds and kinds.count("train") == 3
