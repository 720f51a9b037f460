"""`pearl-hpc plan`: the JSON contract, the readable output and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pearl_hpc.config import REPO_CONFIGS
from pearl_hpc.core.types import PDConfig

PROFILE = REPO_CONFIGS / "profiles" / "qwen3-30b-a3b-h800-tp2.yaml"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", *args], capture_output=True, text=True, timeout=60
    )


def plan_json(*args: str) -> dict:
    result = cli("plan", "--profile", str(PROFILE), "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_json_contract_from_scratch() -> None:
    doc = plan_json("--rollout-workers", "8")
    for key in (
        "mode",
        "num_prefill",
        "num_decode",
        "num_colocated",
        "predicted_makespan_s",
        "switch",
        "reason",
        "candidates",
        "plan",
        "decision_time_s",
    ):
        assert key in doc
    target = PDConfig(doc["num_prefill"], doc["num_decode"], doc["num_colocated"])
    assert target.total == 8
    assert doc["mode"] == target.mode.value
    assert len(doc["candidates"]) == 8  # colocated + 7 splits
    feasible = [c for c in doc["candidates"] if c["feasible"]]
    assert doc["predicted_makespan_s"] == min(c["predicted_makespan_s"] for c in feasible)
    assert len(doc["plan"]["add"]) == 8 and not doc["plan"]["remove"]
    assert [a["role"] for a in doc["plan"]["add"]].count("prefill") == target.num_prefill
    assert 0 < doc["decision_time_s"] < 5


def test_plan_hysteresis_keeps_colocated_and_borrowing_adds_overlap_workers() -> None:
    doc = plan_json("--rollout-workers", "8", "--current", "8C", "--borrowable-workers", "4")
    assert doc["mode"] == "colocated" and doc["switch"] is False
    assert "threshold" in doc["reason"]
    assert doc["borrowing"]["allowed"] is True
    assert doc["num_colocated"] == 12
    assert all(a["reactivate"] and a["zone"] == "overlap" for a in doc["plan"]["add"])


def test_plan_gate_refuses_borrowing_when_toggle_is_expensive() -> None:
    doc = plan_json(
        "--rollout-workers",
        "8",
        "--current",
        "8C",
        "--borrowable-workers",
        "4",
        "--toggle-cost-s",
        "1000",
    )
    assert doc["borrowing"]["allowed"] is False
    assert doc["num_colocated"] == 8 and doc["plan"]["add"] == []


def test_plan_shrink_removes_and_forces_when_decode_is_gone() -> None:
    doc = plan_json("--rollout-workers", "1", "--current", "3P5D")
    assert doc["mode"] == "colocated" and doc["forced"] is True
    assert len(doc["plan"]["remove"]) == 7


def test_plan_readable_output_by_shipped_name() -> None:
    result = cli(
        "plan", "--profile", "qwen3-8b-h800-tp2", "--rollout-workers", "6", "--current", "3P3D"
    )
    assert result.returncode == 0, result.stderr
    assert "candidates" in result.stdout and "plan" in result.stdout


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return str(path)


def _profile_text(**changes: object) -> str:
    data = yaml.safe_load(PROFILE.read_text())
    data.update(changes)
    return yaml.safe_dump({k: v for k, v in data.items() if v is not None})


@pytest.mark.parametrize(
    ("text", "args", "needle"),
    [
        ("batch_size: [1, 2\n", (), "malformed YAML at line"),
        (_profile_text(decode_fixd_s=1.0), (), "unknown key 'decode_fixd_s'; valid keys:"),
        (_profile_text(batch_size=-3), (), "batch_size: must be > 0"),
        (_profile_text(gen_tokens_per_turn=0), (), "gen_tokens_per_turn: must be > 0"),
        (_profile_text(decode_fixed_s="fast"), (), "decode_fixed_s: expected a number"),
        (_profile_text(turns=None), (), "turns: missing required key"),
        ("- 1\n- 2\n", (), "expected a mapping"),
        (_profile_text(), ("--current", "3P"), "needs at least 1 prefill and 1 decode"),
        (_profile_text(), ("--current", "2P3C"), "mixes colocated and disaggregated"),
        (_profile_text(), ("--current", "eight"), "cannot parse SPEC"),
        (_profile_text(), ("--current", "0C"), "has no workers"),
        (_profile_text(), ("--current", "2P2P"), "names P twice"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path: Path, text: str, args: tuple, needle: str) -> None:
    result = cli("plan", "--profile", _write(tmp_path, text), "--rollout-workers", "4", *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--rollout-workers", "0"), "must be >= 1"),
        (("--rollout-workers", "4", "--borrowable-workers", "-1"), "must be >= 0"),
        (("--rollout-workers", "x"), "expected an integer"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args: tuple, needle: str) -> None:
    result = cli("plan", "--profile", str(PROFILE), *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr


def test_missing_profile_names_the_shipped_ones() -> None:
    result = cli("plan", "--profile", "no-such-profile", "--rollout-workers", "4")
    assert result.returncode == 2
    assert "qwen3-8b-h800-tp2" in result.stderr


def test_bench_prints_every_size_and_records_its_line(tmp_path: Path) -> None:
    lines = tmp_path / "bench.jsonl"
    result = cli("bench", "--json", "--repeats", "3", "--record", str(lines))
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {r["workers"] for r in rows} == {64, 256, 1024, 4096, 50_000}
    assert all(r["median_ms"] > 0 for r in rows)
    (line,) = [json.loads(x) for x in lines.read_text().splitlines()]
    assert line["bench"] == "decision" and line["result"] == rows
    assert re.fullmatch(r"[0-9a-f]{7,}", line["commit"]) and line["args"]["repeats"] == 3
    ratios, by = line["ratios"], {(r["workers"], r["event"]): r for r in rows}
    assert ratios["cold 50000 / 64 workers"] == pytest.approx(
        by[50_000, "cold"]["median_ms"] / by[64, "cold"]["median_ms"], rel=1e-3
    )
    assert ratios["decide speed-up over the scalar loop at 50000"] == pytest.approx(
        by[50_000, "decide-only"]["speedup"], rel=1e-3
    )


def test_bench_messages_round_trips_a_train_batch_and_a_log_both_ways() -> None:
    """The TRAIN message of a small batch, pickled and as the plane sends it: each
    decodes to the same trajectories (the benchmark asserts it), the figures printed."""
    from pearl_hpc.bench import messages

    rows = messages.run(trajectories=4, tokens=512, turns=4, ranks=2)
    assert [r["encoding"].split()[0] for r in rows] == ["pickle", "msgpack"]
    assert all(r["encode_vs_pickle"] > 0 and r["decode_vs_pickle"] > 0 for r in rows)
    assert rows[0]["encode_vs_pickle"] == 1.0
    # the trajectory log both ways (each reads back to the batch: the bench asserts it)
    whole, appended = messages.log_rows(trajectories=4, tokens=512, turns=4)
    assert 0 < appended["bytes_vs_whole"] < 1 == whole["bytes_vs_whole"]


def test_bench_train_measures_each_case_and_packs_without_padding(capsys: Any) -> None:
    """A small ``bench --train``: each memory case measured in its own process, and the
    packed micro-batch computes only trajectory tokens."""
    from pearl_hpc.bench import train

    args = ["--layers", "2", "--hidden", "64", "--vocab", "4096", "--chunk", "64"]
    argv = [*args, "--lengths", "512,256", "--mixed", "256,64,32", "--json", "--record", ""]
    assert train.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    memory = {r["case"]: r for r in rows if "case" in r}
    assert list(memory) == ["neither", "checkpointing", "chunked", "both"]
    assert all(r["peak_mib"] > 0 and r["step_s"] > 0 for r in memory.values())
    padded, packed = [r for r in rows if "layout" in r]
    assert (padded["tokens_computed"], packed["tokens_computed"]) == (3 * 256, 256 + 64 + 32)
    assert packed["padding_share"] == 0.0 < padded["padding_share"]


def test_bench_weights_times_both_paths_and_the_engine_gets_the_weights() -> None:
    """A 32 MiB model through the gloo group and through shared memory to a second
    process (the figures are printed, not judged here)."""
    result = cli("bench", "--weights", "--gib", "0.03", "--json", "--record", "")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["same_weights"] is True and out["bytes"] == 32 << 20
    for path in ("gloo", "shm"):
        assert len(out["runs"][path]) == out["repeats"] == 3
        assert all(r["total_s"] > 0 and r["deliver_s"] >= 0 for r in out["runs"][path])
    assert out["digest_s"] > 0


def test_bench_weights_at_scale_prints_each_stage_of_a_version() -> None:
    """The arithmetic of one version at Qwen3-8B and 30B-A3B (no run): its stages, each
    part, and the rates it assumes."""
    result = cli("bench", "--weights", "--at-scale")
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in result.stdout.splitlines()}
    assert "| 0.82 s | 3.05 s |" in rows["each engine reloads from its host copy"]
    assert "| 6.90 s | 25.29 s |" in rows["= the step's last update to every engine serving it"]
    assert "pageable 10 GB/s" in result.stdout


def test_a_versions_cost_is_each_stage_bytes_over_its_rate() -> None:
    from pearl_hpc.core.weightcost import BUCKET_BYTES, Links, sync_cost

    links = Links(train_bus=4, bcast_bus=8, pinned=2, pageable=1, host_copy=4, hash_core=1,
                  hash_threads=2)  # fmt: skip
    cost = sync_cost(8, trainer_ranks=4, tp=2, links=links)  # (one bucket: B = W)
    assert (cost.gather_s, cost.to_host_s, cost.stage_s) == (1.5, 4.0, 2.0)
    assert (cost.digest_s, cost.broadcast_s, cost.verify_s, cost.load_s) == (4, 17, 4, 4)
    assert (cost.trainer_s, cost.publish_s, cost.pause_s, cost.total_s) == (6, 25, 4, 35)
    near = sync_cost(8, trainer_ranks=4, tp=2, links=links, remote=False)
    assert near.publish_s == 0 and near.total_s == 10  # every engine maps it: no hashing
    # buckets pipeline: the slowest stage for every byte, the other two for one bucket
    big = sync_cost(8 * BUCKET_BYTES, trainer_ranks=4, tp=2, links=links)
    assert big.broadcast_s == (8 * BUCKET_BYTES) / 1 + BUCKET_BYTES / 8 + BUCKET_BYTES / 1
    assert big.verify_s == BUCKET_BYTES / 2  # the last bucket's hashing


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--profile", str(PROFILE), "--rollout-workers", "99999999"],
        ["plan", "--profile", str(PROFILE), "--rollout-workers", "4", "--current", "99999999P1D"],
        ["plan", "--profile", str(PROFILE), "--rollout-workers", "4",
         "--borrowable-workers", "99999999"],
        ["simulate", "--batch-size", "99999999"],
    ],
)  # fmt: skip
def test_sizes_no_machine_can_finish_are_one_line_not_a_hang(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", *args],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "at most" in proc.stderr or "must be <=" in proc.stderr
