"""Config files read numbers the way users write them (YAML 1.2 core schema scalars):
every finite float written with ``repr()`` and every int round-trips through each config
loader; YAML 1.1's look-alikes (``yes``, ``on``, ``0x1F``, ``1:30``, ``017``, dates) read
as :mod:`pearl_hpc.config.files` documents."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl_hpc.config.files import load_policy, load_profile, load_yaml, parse_yaml
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import load_run_config
from pearl_hpc.sim.workload import WorkloadConfig

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "configs" / "profiles" / "tiny-cpu.yaml"
RUN = REPO / "configs" / "runs" / "local.yaml"
POLICY = REPO / "configs" / "controller.yaml"
WORKLOAD = REPO / "configs" / "workloads" / "swe-bench.yaml"

finite = st.floats(allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-300, max_value=1e300, allow_nan=False)


def _with(source: Path, tmp: Path, line: str) -> Path:
    """A copy of ``source`` whose top-level key of ``line`` is set by ``line``."""
    key = line.split(":", 1)[0]
    kept = [ln for ln in source.read_text().splitlines() if not ln.startswith(f"{key}:")]
    out = tmp / source.name
    out.write_text("\n".join([*kept, line]) + "\n")
    return out


@settings(max_examples=300, deadline=None)
@given(st.one_of(finite, st.integers()))
def test_every_repr_float_and_int_reads_back_equal(value: float | int) -> None:
    read = parse_yaml(f"x: {value!r}\nlist: [{value!r}]")
    assert type(read["x"]) is type(value) and read["x"] == value
    assert read["list"] == [value]


@settings(max_examples=60, deadline=None)
@given(positive)
def test_a_repr_float_reads_back_through_each_config_loader(tmp_path_factory, value) -> None:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("cfg")
    profile = load_profile(_with(PROFILE, tmp, f"prefill_s_per_token: {value!r}"))
    assert profile.prefill_s_per_token == value
    policy = load_policy(_with(POLICY, tmp, f"toggle_cost_s: {value!r}"))
    assert policy.toggle_cost_s == value
    workload = WorkloadConfig.load(_with(WORKLOAD, tmp, f"env_s_max: {value!r}"))
    assert workload.env_s_max == value
    doc = yaml.safe_load(RUN.read_text())
    run = tmp / "run.yaml"
    run.write_text(yaml.safe_dump({**doc, "elastic": {}}) + f"elastic:\n  grace_s: {value!r}\n")
    assert load_run_config(run).elastic.grace_s == value


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=10**6))
def test_an_int_reads_back_through_a_config_loader(tmp_path_factory, value) -> None:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("cfg")
    assert load_profile(_with(PROFILE, tmp, f"batch_size: {value}")).batch_size == value
    grouped = f"{value:_}"  # 1_000_000, as Python writes it
    assert load_profile(_with(PROFILE, tmp, f"batch_size: {grouped}")).batch_size == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2e-5", 2e-5), ("1E9", 1e9), (".5", 0.5), ("-3.", -3.0), ("+1.5e+3", 1500.0),
        ("1_000", 1000), ("1_000.5", 1000.5), ("0x1F", 31), ("0o17", 15), ("017", 17),
        ("true", True), ("False", False), ("TRUE", True), ("~", None), ("null", None),
    ],
)  # fmt: skip
def test_yaml_12_scalars(text: str, value: object) -> None:
    read = parse_yaml(f"x: {text}")["x"]
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize(
    "text", ["yes", "no", "on", "off", "y", "n", "Yes", "1:30", "1:30:00", "2026-12-01", "1e", "_1"]
)
def test_yaml_11_look_alikes_are_strings(text: str) -> None:
    assert parse_yaml(f"x: {text}")["x"] == text


def test_an_unquoted_slurm_time_limit_is_a_time_not_a_number(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "configs" / "runs" / "slurm-local.yaml").read_text())
    run = tmp_path / "run.yaml"
    doc.pop("elastic")
    pools = "elastic:\n  pools:\n    - partition: elastic\n      time_limit: 1:30:00\n"
    run.write_text(yaml.safe_dump(doc) + pools)
    cfg = load_run_config(run, need_slurm=False)
    assert cfg.elastic.pools[0].time_limit == "1:30:00"  # YAML 1.1: the int 5400


@pytest.mark.parametrize(
    ("elastic", "names"),
    [
        ({"trace": [{"at_step": 0, "workers": 1}]}, "elastic.trace / elastic.replay"),
        ({"request": "bulk"}, "elastic.request 'bulk'"),
        ({"pools": []}, "elastic.pools is empty"),
        ({"request": "hetjob", "pools": [{"hetjob_workers": 0}]}, "hetjob_workers 0"),
        ({"pools": [{"partition": "a b"}]}, r"elastic.pools\[0\].partition 'a b'"),
        ({"pools": [{}, {"time_limit": "soon"}]}, r"elastic.pools\[1\].time_limit 'soon'"),
        ({"pools": [{"gpus": 2}]}, "unknown key 'gpus'"),
        ({"pools": [{"role": "training"}]}, r"elastic.pools\[0\].role 'training'"),
    ],
)
def test_a_bad_elastic_section_of_a_slurm_run_names_the_field(
    tmp_path: Path, elastic: dict, names: str
) -> None:
    doc = yaml.safe_load((REPO / "configs" / "runs" / "slurm-local.yaml").read_text())
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({**doc, "elastic": elastic}))
    with pytest.raises(ConfigError, match=names):
        load_run_config(run, need_slurm=False)


def test_a_run_named_yes_is_named_yes(tmp_path: Path) -> None:
    doc = yaml.safe_load(RUN.read_text())
    doc.pop("name")
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(doc) + "name: yes\n")  # YAML 1.1: the bool True
    assert load_run_config(run).name == "yes"


def test_a_yaml_11_boolean_where_a_choice_is_expected_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"borrowing: 'off' is not one of none, ungated"):
        load_policy(_with(POLICY, tmp_path, "borrowing: off"))


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "1e999"])
def test_non_finite_numbers_are_refused_by_the_range_checks(tmp_path: Path, text: str) -> None:
    assert not math.isfinite(parse_yaml(f"x: {text}")["x"])
    with pytest.raises(ConfigError, match="prefill_s_per_token"):
        load_profile(_with(PROFILE, tmp_path, f"prefill_s_per_token: {text}"))


def test_load_yaml_reads_a_file_with_these_rules(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("a: 2e-5\nb: on\n")
    assert load_yaml(path) == {"a": 2e-5, "b": "on"}


@pytest.mark.parametrize(
    ("train", "names"),
    [
        ({"correction": "is"}, "train.correction 'is': use one of none, tis, decoupled"),
        ({"loss_type": "mean"}, "train.loss_type 'mean'"),
        ({"advantage_std": "n-1"}, "train.advantage_std 'n-1'"),
        ({"is_cap": 0.5}, "is_cap"),
        ({"clip": 0.2}, "unknown key 'clip'"),
        ({"record_logprobs": False}, "train.record_logprobs false: correction tis needs"),
    ],
)
def test_a_bad_train_section_names_the_field(tmp_path: Path, train: dict, names: str) -> None:
    doc = yaml.safe_load(RUN.read_text())
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({**doc, "train": train}))
    with pytest.raises(ConfigError, match=names):
        load_run_config(run)


def test_the_train_section_reaches_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pearl_hpc.worker.trainer import grpo_config

    doc = yaml.safe_load(RUN.read_text())
    run = tmp_path / "run.yaml"
    train = {"correction": "decoupled", "is_cap": 3.0, "loss_type": "dr_grpo"}
    run.write_text(yaml.safe_dump({**doc, "train": train}))
    cfg = load_run_config(run)
    grpo = grpo_config(cfg)
    assert (grpo.correction, grpo.is_cap, grpo.loss_type) == ("decoupled", 3.0, "dr_grpo")
    assert grpo.temperature == cfg.run.temperature
    assert grpo.max_completion_tokens == cfg.run.max_turns * cfg.run.max_tokens_per_turn


def test_a_policy_built_only_in_the_simulator_is_refused_by_a_run(tmp_path: Path) -> None:
    doc = yaml.safe_load(RUN.read_text())
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({**doc, "policy": {**doc["policy"], "tail_dispatch": True}}))
    with pytest.raises(ConfigError, match=r"policy\.tail_dispatch is built in the simulator only"):
        load_run_config(run)
    run.write_text(yaml.safe_dump({**doc, "policy": {**doc["policy"], "local_prefill": True}}))
    assert load_run_config(run).policy.local_prefill  # built in the run's router too


def test_tail_start_needs_the_rollout_ahead(tmp_path: Path) -> None:
    doc = yaml.safe_load(RUN.read_text())
    run = tmp_path / "run.yaml"
    policy = {**doc["policy"], "tail_start": True}
    run.write_text(yaml.safe_dump({**doc, "policy": policy}))
    assert load_run_config(run).policy.tail_start
    run.write_text(
        yaml.safe_dump({**doc, "policy": policy, "run": {**doc["run"], "max_staleness": 0}})
    )
    with pytest.raises(ConfigError, match=r"tail_start .* needs run\.max_staleness >= 1"):
        load_run_config(run)
