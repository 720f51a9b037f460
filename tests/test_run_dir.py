"""The run directory: one per run even when two start in the same second, plain run
names only, an exclusive lock held by the live master (a dead master's lock is free at
once, and ``--resume`` of a live run is one line, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.rundir import RunDir, RunDirBusy

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "configs" / "runs" / "local.yaml"

HOLD = """
import sys, time
from pathlib import Path
from pearl_hpc.rundir import RunDir
lock = RunDir(Path(sys.argv[1])).lock()
print("held", flush=True)
time.sleep(60)
"""


def test_two_runs_in_one_second_get_two_directories(tmp_path: Path) -> None:
    dirs = {RunDir.new(tmp_path / "runs", "t", LOCAL.read_text()).path for _ in range(3)}
    assert len(dirs) == 3 and all((d / "config.yaml").exists() for d in dirs)


def test_runs_dir_that_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("")
    with pytest.raises(ConfigError, match=r"runs_dir .*is a file"):
        RunDir.new(tmp_path / "runs", "t", LOCAL.read_text())


@pytest.mark.parametrize("name", ["../../x", "a/b", ".hidden", "", "x" * 101, "a b"])
def test_a_run_name_is_a_plain_name(tmp_path: Path, name: str) -> None:
    doc = yaml.safe_load(LOCAL.read_text())
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**doc, "name": name}))
    with pytest.raises(ConfigError, match="a plain name"):
        load_run_config(path)
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", str(path), "--dry-run"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_the_lock_is_exclusive_and_dies_with_its_holder(tmp_path: Path) -> None:
    run_dir = RunDir.new(tmp_path / "runs", "t", LOCAL.read_text()).path
    assert RunDir(run_dir).lock_held() is None  # no master ever ran
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert RunDir(run_dir).lock_held() is True
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
            RunDir(run_dir).lock()
        proc = subprocess.run(
            [sys.executable, "-m", "pearl_hpc.cli", "run", "--resume", str(run_dir)],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2 and "in use by a live master" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    finally:
        holder.kill()
        holder.wait()
    assert RunDir(run_dir).lock_held() is False  # SIGKILLed: the kernel dropped its lock
    RunDir(run_dir).lock().close()


def _journal(**state: object) -> bytes:
    base = {"status": "running", "pid": 1, "next_step": 0, "steps": 6, "version": 0, "t_s": 0.0}
    base |= {"elastic_workers": 0, "controller": {}, "counters": {}}
    return json.dumps({"format": "pearl-hpc-journal/1", "state": {**base, **state}}).encode()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b"\xff\xfe not utf-8", "not UTF-8"),
        (b"[1, 2]", "journal format"),
        (b'{"format": "pearl-hpc-journal/1", "state": 3}', "no state mapping"),
        (b'{"format": "pearl-hpc-journal/1", "state": {"pid": 1}}', "no status"),
        (_journal(pid="x"), "pid"),
        (_journal(pid=1e300), "pid"),
        (_journal(pid=99999999999999999999), "range"),
        (_journal(controller={"table": 3}), "corrupt journal"),
    ],
)
def test_a_bad_journal_is_one_line_from_status(tmp_path: Path, text: bytes, said: str) -> None:
    run_dir = RunDir.new(tmp_path / "runs", "t", LOCAL.read_text()).path
    (run_dir / "journal.json").write_bytes(text)
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "status", str(run_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and said in proc.stderr


def test_a_non_utf8_config_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_run_config(path)


def test_status_counts_elastic_workers_per_pool() -> None:
    from pearl_hpc.cli.view import format_pools

    jobs = [
        {"component": "7+0", "state": "running", "pool": "elastic", "nodes": ["n1"]},
        {"component": "7+1", "state": "draining", "pool": "elastic", "nodes": ["n2"]},
        {"component": "9+0", "state": "pending", "pool": "spot", "nodes": []},
        {"component": "8+0", "state": "running", "pool": "elastic", "nodes": ["n3"]},
    ]
    assert format_pools(jobs) == "elastic: 2 running, 1 draining; spot: 1 pending"
    assert format_pools([]) == ""
    jobs += [  # Slurm's expected starts of pending requests: the soonest per pool
        {"component": "10+0", "state": "pending", "pool": "spot", "nodes": [], "starts_in_s": 400},
        {"component": "11+0", "state": "pending", "pool": "spot", "nodes": [], "starts_in_s": 250},
    ]
    assert format_pools(jobs) == (
        "elastic: 2 running, 1 draining; spot: 3 pending (start in ~4 min)"
    )


def test_status_of_a_running_run_says_how_long_its_steps_left_take(tmp_path: Path) -> None:
    """3 of 10 steps recorded, ended at 45, 60 and 80 s: 17.5 s a step, ~122 s for the 7
    left (the pace the expansion gate judges capacity over); none once it finished."""
    from dataclasses import asdict

    from pearl_hpc.cli.view import format_status, run_status
    from pearl_hpc.master.records import StepMetrics

    run_dir = RunDir.new(tmp_path / "runs", "t", LOCAL.read_text()).path
    lock = RunDir(run_dir).lock()  # this process is the live master
    try:
        rows = [
            StepMetrics(
                step,
                t_s,
                10.0,
                1.0,
                0.1,
                0.0,
                100,
                10.0,
                0.5,
                step + 1,
                {},
                0,
                False,
                0,
                16,
                0,
                10.0,
                "1C",
            )
            for step, t_s in enumerate((45.0, 60.0, 80.0))
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(asdict(m)) + "\n" for m in rows))
        journal = _journal(next_step=3, steps=10, controller={"table": {"slots": []}})
        (run_dir / "journal.json").write_bytes(journal)
        doc = run_status(run_dir)
        assert doc["status"] == "running" and doc["left_s"] == round(7 * 17.5)
        assert "step 3/10 (~2 min left)" in format_status(doc)
    finally:
        lock.close()
    (run_dir / "journal.json").write_bytes(
        _journal(status="finished", next_step=10, steps=10, controller={"table": {"slots": []}})
    )
    assert run_status(run_dir)["left_s"] is None
