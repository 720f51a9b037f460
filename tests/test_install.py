"""A wheel install (not editable, away from the checkout) carries the shipped configs as
package data: the default run config, its profile and the cluster files are found, and
a dry run of the default config works from any directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_wheel_install_finds_the_shipped_configs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("pearl_hpc-*.whl")
    venv = tmp_path / "venv"  # the dependencies from this Python's site-packages
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)  # fmt: skip
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
         "--force-reinstall", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = (
        "import pearl_hpc.config.files as f; print(f.REPO_CONFIGS); "
        "print(sorted(p.name for p in f.REPO_CONFIGS.glob('*/*.yaml')))"
    )
    python = str(venv / "bin" / "python")
    where = subprocess.run(
        [python, "-c", probe], cwd=work, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert str(venv) in where.splitlines()[0]  # the installed copy, not the checkout
    for name in ("local.yaml", "tiny-cpu.yaml", "pearl-h800.yaml", "swe-bench.yaml"):
        assert name in where
    dry = subprocess.run(
        [str(venv / "bin" / "pearl-hpc"), "run", "--dry-run", "--offline"],
        cwd=work, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "## the controller's first decision" in dry.stdout
