"""How a run ends besides finishing, with real ranks and engines:

- a run that cannot go on ends: a base rank that raises at start (here the trainer, on
  a model whose weights are not safetensors) ends the whole world within seconds, its
  error one line on the launcher's output and in ``pearl-hpc status``; the launcher does
  not restart a world that failed before it joined (it would fail the same way);
- ``pearl-hpc cancel`` stops a run cleanly (a checkpoint, status stopped) and
  ``--resume`` carries it to the end, every step trained once.

No process of the run is left after either."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import vllm_skip_reason

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_a_trainer_that_raises_at_start_ends_the_world_in_seconds(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"\xff" * 4096)  # a header no reader takes
    runs = tmp_path / "runs"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", "configs/runs/local.yaml",
         f"--set=model={model}", f"--set=runs_dir={runs}", "--set=run.steps=1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and elapsed < 30, (elapsed, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pearl-hpc run:")]
    # (either trainer rank may be the first to fail: the first is the one recorded)
    assert re.search(r"rank [12] \(trainer\) failed: SafetensorError", lines[0]), proc.stderr
    assert "a restart would fail the same way" in lines[1] and "restart 1" not in proc.stderr
    (run_dir,) = runs.iterdir()
    note = json.loads((run_dir / "failure.json").read_text())
    assert note["rank"] in (1, 2) and (note["kind"], note["joined"]) == ("trainer", False)
    assert "Traceback" in (run_dir / note["log"]).read_text()  # the whole of it, in its log
    status = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "status", str(run_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0 and "failed: failed at start" in status.stdout
    assert f"rank {note['rank']} (trainer) failed: SafetensorError" in status.stdout
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes of the run left: {left.stdout}"


@pytest.mark.vllm
@pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason()))
def test_cancel_stops_a_run_cleanly_and_resume_finishes_it(tmp_path: Path) -> None:
    from pearl_hpc.cli.view import run_status
    from pearl_hpc.errors import PearlError
    from pearl_hpc.rundir import read_jsonl

    runs = tmp_path / "runs"
    steps = 4
    sets = [f"--set=runs_dir={runs}", f"--set=run.steps={steps}", "--set=run.max_staleness=0",
            "--set=train.checkpoint_every=100"]  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pearl_hpc.cli", "run", "configs/runs/local.yaml", *sets],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = set()  # what status said of the run as it started
    try:
        deadline = time.monotonic() + 300
        while not list(runs.glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            for path in runs.glob("*/config.yaml"):
                with contextlib.suppress(PearlError):  # (a journal mid-write)
                    seen.add(run_status(path.parent)["status"])
            time.sleep(0.2)
        (run_dir,) = runs.iterdir()
        assert "starting" in seen and "running" in seen, seen
        cancel = subprocess.run(
            [sys.executable, "-m", "pearl_hpc.cli", "cancel", str(run_dir), "--wait"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert cancel.returncode == 0 and "stopped; continue it" in cancel.stdout, cancel.stderr
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 0 and "stopped (pearl-hpc cancel)" in out, out[-2000:]
    assert "restart" not in out
    state = json.loads((run_dir / "journal.json").read_text())["state"]
    assert state["status"] == "stopped" and state["next_step"] < steps
    assert list((run_dir / "checkpoints").glob("v*/meta.json"))  # the stop's checkpoint
    status = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "status", str(run_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "stopped" in status.stdout and "--resume" in status.stdout
    resumed = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", "run", "--resume", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(steps))
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes of the run left: {left.stdout}"
