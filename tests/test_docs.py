"""The docs stay true: the generated configuration reference is current, the README is
short, no release history in the docs, and the cheap commands of their shell blocks run
as written (the CLI the way `tests/test_cli.py` calls it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pearl_hpc.cli import docs
from pearl_hpc.rundir import FILES, RunDir

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")  # ```text holds synopses, not commands
HISTORY = re.compile(
    r"\bissues? #?\d+|\brelease before\b|\bthis release\b|\bprevious release\b"
    r"|\breleases? ago\b|\bsession \d+|\bused to say\b|\bwork[- ]?log\b",
    re.IGNORECASE,
)


def shell_commands(path: Path) -> list[str]:
    """Every command line of the file's shell-like fenced blocks (continuations joined)."""
    commands: list[str] = []
    fence: str | None = None  # the open block's info string
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence not in SHELL_BLOCKS:
            continue
        pending += stripped.removeprefix("$ ")
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending:
            commands.append(pending)
        pending = ""
    return commands


def is_cheap(argv: list[str]) -> bool:
    """`pearl-hpc ... --help`, `run CONFIG --dry-run`, `plan ...`, `simulate ...`."""
    if len(argv) < 2 or argv[0] != "pearl-hpc":
        return False
    return (
        "--help" in argv
        or argv[1] in ("plan", "simulate")
        or (argv[1] == "run" and "--dry-run" in argv)
    )


def cheap_commands() -> dict[str, str]:
    """Each cheap command once, with the first file that shows it."""
    found: dict[str, str] = {}
    for path in (README, *DOCS):
        for command in shell_commands(path):
            if command.startswith("pearl-hpc ") and is_cheap(shlex.split(command, comments=True)):
                found.setdefault(command.split(" #")[0].strip(), path.relative_to(ROOT).as_posix())
    return found


COMMANDS = cheap_commands()


def test_the_generated_pages_are_current() -> None:
    """docs/configuration.md (from the schema) and docs/running.md's run-directory table
    (from RunDir) are what `python -m pearl_hpc.cli.docs` makes now."""
    assert docs.main(["--docs", str(ROOT / "docs"), "--check"]) == 0, f"run {docs.COMMAND}"


def test_the_generators_check_mode(tmp_path: Path) -> None:
    (tmp_path / "configuration.md").write_text("old\n")
    (tmp_path / "running.md").write_text("x\n<!-- rundir:begin -->\nold\n<!-- rundir:end -->\n")
    assert docs.main(["--docs", str(tmp_path), "--check"]) == 1
    assert docs.main(["--docs", str(tmp_path)]) == 0
    assert docs.main(["--docs", str(tmp_path), "--check"]) == 0
    table = (tmp_path / "running.md").read_text()
    run = RunDir(tmp_path)
    for attr, name, _ in FILES:  # every file the table names is one RunDir names
        assert f"| `{name}` |" in table
        if attr:
            assert getattr(run, attr) == tmp_path / name.rstrip("/"), attr


def test_the_readme_is_short_and_keeps_the_two_setup_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    assert "bash launch/run-local.sh" in lines and "bash tests/run-all.sh" in lines


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_no_release_history_in_the_docs(path: Path) -> None:
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits)


def test_the_docs_show_cheap_commands_to_run() -> None:
    kinds = {shlex.split(c)[1] for c in COMMANDS}
    assert {"run", "plan", "simulate"} <= kinds, sorted(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=lambda c: f"{COMMANDS[c]}: {c}")
def test_a_documented_command_runs_as_written(command: str) -> None:
    argv = shlex.split(command, comments=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pearl_hpc.cli", *argv[1:]],
        cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, f"{COMMANDS[command]}: {command}\n{proc.stderr[-2000:]}"


def test_the_cost_of_a_version_in_the_gpu_page_is_what_the_formula_gives() -> None:
    """docs/gpu.md's table of one version's stages is `bench --weights --at-scale`'s (the
    formula the simulator charges): a change of either shows here."""
    from pearl_hpc.bench.weights import at_scale_table

    table = at_scale_table().split("\n\nrates")[0]
    assert table in (ROOT / "docs" / "gpu.md").read_text()
