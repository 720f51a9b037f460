"""Fuzzing what users hand the CLI: random bytes, YAML of the wrong shape and huge
numbers in every config loader and the journal reader, and random arguments to the
commands. The only failure allowed is one clear error (a PearlError, which the CLI
prints as one line with exit 2), never a traceback."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearl_hpc.cli.main import main
from pearl_hpc.config.files import load_policy, load_profile
from pearl_hpc.errors import PearlError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.rundir import RunDir
from pearl_hpc.sim.workload import WorkloadConfig

REPO = Path(__file__).resolve().parents[1]
LOADERS = {
    "profile": (load_profile, REPO / "configs" / "profiles" / "tiny-cpu.yaml"),
    "policy": (load_policy, REPO / "configs" / "controller.yaml"),
    "run": (
        lambda p: load_run_config(p, need_slurm=False),
        REPO / "configs" / "runs" / "local.yaml",
    ),
    "workload": (WorkloadConfig.load, REPO / "configs" / "workloads" / "swe-bench.yaml"),
}
FUZZ = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
    st.integers(min_value=10**300, max_value=10**400),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _only_clear_errors(load, path: Path) -> None:  # type: ignore[no-untyped-def]
    try:
        load(path)
    except PearlError as exc:
        assert "\n" not in str(exc).strip(), f"a multi-line error: {exc}"


@pytest.mark.parametrize("kind", LOADERS)
@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_in_a_config_file(tmp_path: Path, kind: str, data: bytes) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(data)
    _only_clear_errors(LOADERS[kind][0], path)


@pytest.mark.parametrize("kind", LOADERS)
@FUZZ
@given(doc=st.one_of(values, st.dictionaries(st.text(max_size=8), values, max_size=4)))
def test_random_yaml_in_a_config_file(tmp_path: Path, kind: str, doc: object) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(doc))
    _only_clear_errors(LOADERS[kind][0], path)


@pytest.mark.parametrize("kind", LOADERS)
@FUZZ
@given(data=st.data())
def test_one_field_of_a_real_config_replaced(
    tmp_path: Path, kind: str, data: st.DataObject
) -> None:
    """Every top-level (and one level down) field of a shipped config, replaced by a
    random value: huge numbers, wrong types, nesting."""
    load, source = LOADERS[kind]
    doc = yaml.safe_load(source.read_text())
    key = data.draw(st.sampled_from(sorted(doc)))
    if isinstance(doc[key], dict) and doc[key] and data.draw(st.booleans()):
        sub = data.draw(st.sampled_from(sorted(doc[key])))
        doc[key][sub] = data.draw(values)
    else:
        doc[key] = data.draw(values)
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(doc))
    _only_clear_errors(load, path)


@FUZZ
@given(
    state=st.dictionaries(
        st.sampled_from(
            [
                "status",
                "pid",
                "next_step",
                "steps",
                "version",
                "t_s",
                "controller",
                "elastic_workers",
            ]
        ),
        values,
    )
)
def test_a_random_journal_state(tmp_path: Path, state: dict[str, object]) -> None:
    (tmp_path / "journal.json").write_text(
        json.dumps({"format": "pearl-hpc-journal/1", "state": state}, default=str)
    )
    _only_clear_errors(lambda p: RunDir(p).read_state(), tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["status", str(tmp_path)])
    assert rc in (0, 2) and len(err.getvalue().strip().splitlines()) <= 1


COMMANDS = [
    ["plan", "--profile", "tiny-cpu", "--rollout-workers"],
    ["plan", "--profile", "tiny-cpu", "--rollout-workers", "4", "--current"],
    ["plan", "--profile", "tiny-cpu", "--rollout-workers", "4", "--toggle-cost-s"],
    ["plan", "--profile"],
    ["simulate", "--no-progress", "--systems", "pearl", "--duration-s", "5", "--batch-size"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c[:1] + c[-1:]) for c in COMMANDS])
@settings(max_examples=40, deadline=None)
@given(arg=st.one_of(st.text(max_size=10), st.integers().map(str), st.floats().map(repr)))
def test_random_arguments_are_one_line(command: list[str], arg: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main([*command, arg])
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
    assert rc in (0, 2), err.getvalue()
    if rc == 2:
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()


def _hostile(tmp_path: Path, name: str, data: bytes) -> Path:
    """``data`` written as ``name`` under a fresh folder; returns the folder."""
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    return folder


# every subcommand that reads a user's file, with that file hostile; {f}: the file,
# {d}: its folder, {o}: an output path (none of these starts a run or a job)
FILE_COMMANDS = {
    "run --dry-run": ("x.yaml", ["run", "{f}", "--dry-run"]),
    "run --resume": ("journal.json", ["run", "--resume", "{d}"]),
    "status": ("journal.json", ["status", "{d}"]),
    "report metrics": ("metrics.jsonl", ["report", "{d}", "--out", "{o}"]),
    "report events": ("events.jsonl", ["report", "{d}", "--out", "{o}"]),
    "validate-sim": ("summary.json", ["validate-sim", "{d}"]),
    "plan --profile": ("p.yaml", ["plan", "--profile", "{f}", "--rollout-workers", "4"]),
    "simulate --trace": (
        "t.csv", ["simulate", "--trace", "{f}", "--no-progress", "--duration-s", "60"]
    ),
    "calibrate --nccl-dir": (
        "all_reduce_perf.txt", ["calibrate", "--nccl-dir", "{d}", "--out", "{o}"]
    ),
}  # fmt: skip


@pytest.mark.parametrize("command", FILE_COMMANDS)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.one_of(
        st.binary(max_size=200),
        values.map(lambda v: yaml.safe_dump(v).encode()),
        values.map(lambda v: json.dumps(v, default=str).encode()),
    )
)
def test_every_subcommand_reads_a_hostile_file_in_one_line(
    tmp_path: Path, command: str, data: bytes
) -> None:
    name, template = FILE_COMMANDS[command]
    folder = _hostile(tmp_path, name, data)
    subs = {"{f}": str(folder / name), "{d}": str(folder), "{o}": str(tmp_path / "out")}
    argv = [subs.get(a, a) for a in template]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
    assert rc in (0, 2), err.getvalue()
    if rc == 2:
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()


@pytest.mark.parametrize(
    "argv",
    [
        ["tiny-model", "{file}"],
        ["simulate", "--no-progress", "--duration-s", "60", "--report", "{file}"],
        ["calibrate", "--gloo", "--out", "{file}/x.yaml"],
        ["report", "{file}"],
        ["status", "{file}"],
    ],
    ids=lambda a: " ".join(a[:1] + a[-1:]),
)
def test_an_output_or_run_path_that_is_a_file_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main([a.replace("{file}", str(taken)) for a in argv])
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
    assert rc == 2 and len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
