"""`pearl-hpc simulate` end to end, in a subprocess: the --json document, --report files,
and one-line errors (exit 2, no traceback) for every input a user can get wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pearl_hpc.config import REPO_CONFIGS

BASE = ["--duration-s", "1800", "--no-progress"]
SYSTEM_KEYS = {
    "throughput_tokens_per_s",
    "rollout_tokens",
    "trained_tokens",
    "steps",
    "per_step",
    "interrupted_turns",
    "reconfigurations",
    "trajectories_started",
    "trajectories_finished",
}
STEP_KEYS = {
    "step",
    "started_s",
    "finished_s",
    "duration_s",
    "throughput_tokens_per_s",
    "rollout_tokens",
    "trained_tokens",
    "mode",
    "num_prefill",
    "num_decode",
    "num_colocated",
    "borrowed_workers",
    "dedicated_rollout_gpus",
    "training_return_wait_s",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str, hash_seed: str = "0", cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "simulate", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture(scope="module")
def roll_pearl() -> dict[str, Any]:
    proc = cli("--model", "qwen3-8b", "--segment", "2", "--json", *BASE, "--systems", "roll,pearl")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_document(roll_pearl: dict[str, Any]) -> None:
    doc = roll_pearl
    assert doc["model"] == "qwen3-8b"
    assert doc["gpu"] == "h800"
    assert doc["tp"] == 2
    assert doc["segment"] == 2
    assert doc["trace"] == "segment2"
    assert doc["duration_s"] == 1800
    assert doc["seed"] == 0
    assert doc["batch_size"] == 64
    assert doc["rollout_gpus"] is None
    assert list(doc["systems"]) == ["roll", "pearl"]
    for name, result in doc["systems"].items():
        assert set(result) >= SYSTEM_KEYS, name
        assert result["steps"] == len(result["per_step"]) > 0
        assert result["throughput_tokens_per_s"] > 0
        assert result["rollout_tokens"] == sum(s["rollout_tokens"] for s in result["per_step"])
        assert result["trained_tokens"] == sum(s["trained_tokens"] for s in result["per_step"])
        for entry in result["per_step"]:
            assert set(entry) >= STEP_KEYS, name
            assert entry["mode"] in ("colocated", "disaggregated")
            for key in ("num_prefill", "num_decode", "num_colocated", "borrowed_workers"):
                assert isinstance(entry[key], int) and entry[key] >= 0
            assert entry["throughput_tokens_per_s"] > 0
    assert doc["ratios_vs_roll"]["roll"] == 1
    assert set(doc["ratios_vs_roll"]) == {"roll", "pearl"}
    pearl = doc["systems"]["pearl"]
    assert doc["ratios_vs_roll"]["pearl"] == pytest.approx(
        pearl["throughput_tokens_per_s"] / doc["systems"]["roll"]["throughput_tokens_per_s"],
        abs=1e-4,
    )
    assert any(s["borrowed_workers"] > 0 for s in pearl["per_step"])
    assert all(s["borrowed_workers"] == 0 for s in doc["systems"]["roll"]["per_step"])


def test_json_is_reproducible_across_processes(roll_pearl: dict[str, Any]) -> None:
    # another interpreter with another string-hash seed: the same document
    proc = cli(
        "--model",
        "qwen3-8b",
        "--segment",
        "2",
        "--json",
        *BASE,
        "--systems",
        "roll,pearl",
        hash_seed="12345",
    )
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)
    first = json.loads(json.dumps(roll_pearl))
    assert json.dumps(again, sort_keys=True) == json.dumps(first, sort_keys=True)


def test_report_writes_files(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = cli(
        "--segment",
        "1",
        *BASE,
        "--batch-size",
        "16",
        "--systems",
        "roll,rlboost+,pearl",
        "--report",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "report:" in proc.stderr
    # without --json the markdown table goes to stdout
    assert "| system | tokens/s |" in proc.stdout
    assert "| roll |" in proc.stdout and "| pearl |" in proc.stdout
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# Simulation: qwen3-8b on h800 TP2, segment 1")
    assert "| rlboost+ |" in summary
    results = json.loads((out / "results.json").read_text())
    assert list(results["systems"]) == ["roll", "rlboost+", "pearl"]
    assert results["batch_size"] == 16
    pngs = ["throughput.png", "roles-roll.png", "roles-rlboostplus.png", "roles-pearl.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert len(data) > 1000, name
        assert data.startswith(PNG_MAGIC), name
    assert sorted(p.name for p in out.glob("roles-*.png")) == sorted(pngs[1:])


def test_fixed_resources_sweep() -> None:
    proc = cli(
        "--no-elastic",
        "--rollout-gpus",
        "4",
        "--sweep-static",
        "--batch-size",
        "16",
        "--json",
        *BASE,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc["systems"]) == ["pd-only", "static-coloc", "static-1P1D"]
    assert doc["segment"] is None and doc["trace"] is None and doc["rollout_gpus"] == 4
    assert all(r["throughput_tokens_per_s"] > 0 for r in doc["systems"].values())
    assert doc["ratios_vs_static-coloc"]["static-coloc"] == 1
    assert "ratios_vs_roll" not in doc


def test_trace_window(tmp_path: Path) -> None:
    trace = tmp_path / "spot.csv"
    trace.write_text("# seconds,instances\n0,0\n100,0\n100,6\n900,6\n900,2\n2000,4\n4000,4\n")
    proc = cli("--trace", str(trace), "--start-s", "50", "--json", *BASE, "--systems", "rlboost+")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["segment"] is None
    assert doc["trace"] == "spot[50+1800]"
    result = doc["systems"]["rlboost+"]
    assert result["reconfigurations"] > 2  # a grant at 50 s, a reclaim at 850 s
    assert max(s["dedicated_rollout_gpus"] for s in result["per_step"]) > 4
    # the same pool standing for a 4x larger cluster: 24 spot GPUs at 100 s, 8 at 900 s
    proc = cli(
        "--trace", str(trace), "--start-s", "50", "--trace-scale", "4", "--json", *BASE,
        "--systems", "rlboost+",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    scaled = json.loads(proc.stdout)
    assert scaled["trace"] == "spot[50+1800]x4"
    peak = max(s["dedicated_rollout_gpus"] for s in scaled["systems"]["rlboost+"]["per_step"])
    assert peak > 4 + 6, peak
    assert scaled["fluid_bound"]["rollout_worker_s"] > doc["fluid_bound"]["rollout_worker_s"]


# ---------------------------------------------------------------------------- errors
def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error" in lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--model", "llama-7b"], ["unknown model 'llama-7b'", "qwen3-30b-a3b, qwen3-8b"]),
        (["--gpu", "v100"], ["unknown GPU 'v100'", "a100, h100, h800"]),
        (["--systems", "roll,bogus"], ["unknown system 'bogus'", "pearl"]),
        (["--systems", "static-3P3D", "--rollout-gpus", "8", "--no-elastic"], ["needs 4"]),
        (["--rollout-gpus", "8"], ["--no-elastic"]),
        (["--no-elastic"], ["--rollout-gpus"]),
        (["--sweep-static"], ["--sweep-static needs fixed resources"]),
        (["--segment", "2", "--duration-s", "9000"], ["longer than segment 2"]),
        (["--segment", "4"], ["--segment"]),
        (["--tp", "0"], ["--tp"]),
        (["--duration-s", "-5"], ["--duration-s"]),
        (["--router", "random"], ["--router"]),
        (["--trace-scale", "0"], ["--trace-scale", ">= 0.01"]),
        (["--max-staleness", "5"], ["--max-staleness", "<= 4"]),
        (["--tp", "8"], ["reserved rollout GPUs = 4 cannot be split into TP8 workers"]),
        (["--rollout-gpus", "5", "--no-elastic"], ["--rollout-gpus = 5", "multiple of 2"]),
        (["--training-gpus", "1"], ["--training-gpus = 1"]),
        (["--workload", "nope"], ["--workload 'nope'", "swe-bench, swe-bench-pearl-mix"]),
        (["--kv-bandwidth-from", "nope"], ["--kv-bandwidth-from 'nope'", "qwen3-8b-h800-tp2"]),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], needles: list[str]) -> None:
    # --duration-s first so that a later --duration-s in args wins
    assert_one_line_error(cli("--duration-s", "600", "--no-progress", *args), *needles)


def test_malformed_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,instances\n0,3\n")
    assert_one_line_error(cli("--trace", str(bad), *BASE), "bad.csv:1", "non-numeric")
    bad.write_text("0,3\n100,2.5\n")
    assert_one_line_error(cli("--trace", str(bad), *BASE), "bad.csv:2", "whole number")
    bad.write_text("0,3\n100,4\n50,2\n")
    assert_one_line_error(cli("--trace", str(bad), *BASE), "bad.csv:3", "backwards")
    assert_one_line_error(cli("--trace", str(tmp_path / "missing.csv"), *BASE), "cannot read")


def test_trace_start_beyond_end(tmp_path: Path) -> None:
    trace = tmp_path / "short.csv"
    trace.write_text("0,2\n300,4\n600,4\n")
    # no --duration-s: the window would run from 900 s to the end, a negative length
    assert_one_line_error(cli("--trace", str(trace), "--start-s", "900", "--no-progress"))
    # with a duration: the window is not inside the trace
    assert_one_line_error(
        cli("--trace", str(trace), "--start-s", "900", "--duration-s", "60", "--no-progress"),
        "not inside the trace",
    )
    assert_one_line_error(
        cli("--trace", str(trace), "--start-s", "0", "--duration-s", "1800", "--no-progress"),
        "not inside the trace",
    )


def test_segment_with_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0,2\n3600,2\n")
    assert_one_line_error(
        cli("--segment", "1", "--trace", str(trace), *BASE), "--segment", "--trace"
    )


def test_kv_bandwidth_from_a_calibrated_profile_slows_disaggregation(tmp_path: Path) -> None:
    """The KV hand-off runs at the profile's measured transfer_bytes_per_s: a slow link
    (2 GB/s, as a congested or TCP fabric) lengthens a disaggregated split's rollout and
    leaves colocation (no hand-off) as it was."""
    shipped = REPO_CONFIGS / "profiles" / "qwen3-8b-h800-tp2.yaml"
    slow = tmp_path / "measured.yaml"
    slow.write_text(
        shipped.read_text().replace("transfer_bytes_per_s: 5.0e+10", "transfer_bytes_per_s: 2.0e+9")
    )
    base = ["--rollout-gpus", "8", "--no-elastic", "--duration-s", "1800", "--json"]
    args = [*base, "--systems", "static-coloc,static-2P2D", "--no-progress"]
    docs = [
        json.loads(cli(*args, *extra).stdout) for extra in ([], ["--kv-bandwidth-from", str(slow)])
    ]
    assert [d["kv_transfer_gb_per_s"] for d in docs] == [50.0, 2.0]
    tput = [{n: s["throughput_tokens_per_s"] for n, s in d["systems"].items()} for d in docs]
    assert tput[1]["static-coloc"] == tput[0]["static-coloc"]
    assert tput[1]["static-2P2D"] < 0.98 * tput[0]["static-2P2D"]  # 4% slower here
