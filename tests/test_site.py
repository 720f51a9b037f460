"""The site settings of a run (``slurm:``), cluster files and ``--set``, and the checks
against what ``sinfo`` reports -- pure, without a cluster (the local cluster's own
checks: tests/test_site_cluster.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pearl_hpc.backends.slurm import elastic_job_spec
from pearl_hpc.backends.world import base_job_spec
from pearl_hpc.config.cluster import CLUSTER_ENV, key_lines, resolve_run_mapping
from pearl_hpc.config.files import REPO_CONFIGS
from pearl_hpc.config.run import RunConfig, read_run_config
from pearl_hpc.errors import ConfigError
from pearl_hpc.master.preflight import model_problem
from pearl_hpc.slurm.cluster import (
    NodeGroup,
    base_problems,
    parse_sinfo,
    pool_problems,
    shape_problems,
)
from pearl_hpc.slurm.scripts import render_sbatch

REPO = Path(__file__).resolve().parents[1]

CLUSTER = {
    "name": "lab",
    "nodes": [{"partitions": ["gpu", "scav"], "gpus": 8, "gpu_type": "a100", "cpus": 64}],
    "slurm": {
        "partition": "gpu",
        "account": "lab",
        "gpu_type": "a100",
        "mpi": "pmix",
        "env": {"HF_HUB_OFFLINE": "1"},
        "setup": ["module load cuda"],
    },
    "layout": {"gpus_per_node": 8},
    "elastic": {"pools": [{"partition": "scav"}]},
}
RUN = {"name": "r", "backend": "slurm", "cluster": "lab", "slurm": {"qos": "high"}}


def _write(tmp_path: Path, run: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    (tmp_path / "clusters").mkdir(exist_ok=True)
    (tmp_path / "clusters" / "lab.yaml").write_text(yaml.safe_dump(cluster or CLUSTER))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CLUSTER_ENV, str(tmp_path / "clusters"))
    return tmp_path


def test_a_run_starts_from_its_clusters_file_and_overrides_what_differs(site: Path) -> None:
    path = _write(site, {**RUN, "slurm": {"qos": "high", "env": {"NCCL_DEBUG": "WARN"}}})
    cfg = read_run_config(path)
    s = cfg.slurm
    assert (s.partition, s.account, s.qos, s.mpi, s.gpu_type) == (
        "gpu",
        "lab",
        "high",
        "pmix",
        "a100",
    )
    assert s.env == {"HF_HUB_OFFLINE": "1", "NCCL_DEBUG": "WARN"}  # mappings merge
    assert s.setup == ["module load cuda"] and cfg.elastic.pools[0].partition == "scav"
    origins = resolve_run_mapping(path).origins
    assert origins["slurm.account"].startswith("cluster ") and "slurm.qos" not in origins
    assert "slurm.env.HF_HUB_OFFLINE" in origins and "slurm.env.NCCL_DEBUG" not in origins


def test_set_overrides_both_and_the_run_directory_keeps_the_result(site: Path) -> None:
    path = _write(site, RUN)
    sets = ["slurm.account=other", "run.steps=7", "elastic.pools.0.partition=gpu"]
    cfg = read_run_config(path, sets)
    assert (cfg.slurm.account, cfg.run.steps, cfg.elastic.pools[0].partition) == ("other", 7, "gpu")
    resolved = resolve_run_mapping(path, sets)
    assert resolved.origins["slurm.account"] == "--set" and resolved.origins["run.steps"] == "--set"
    kept = site / "kept.yaml"
    kept.write_text(resolved.text(path))
    again = read_run_config(kept)  # what --resume reads: the same run, its cluster's path
    assert again.cluster == str(site / "clusters" / "lab.yaml")
    assert dataclasses.replace(again, cluster="lab") == cfg


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("run.steps", "KEY.PATH=VALUE"),
        ("elastic.pools.3.partition=x", "the list has items 0-0"),
        ("run.steps.x=1", "run.steps: expected an integer"),
        ("elastic.pools.0.partition.x=1", "partition is a value"),
        ("slurm.acount=x", "unknown key 'acount'"),
        ("run.steps=[", "not YAML"),
    ],
)
def test_a_bad_set_is_one_line_naming_it(site: Path, item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_run_config(_write(site, RUN), [item])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"time": "two days"}, "slurm.time 'two days' is not a Slurm time"),
        ({"mem": "lots"}, "slurm.mem 'lots': a Slurm size"),
        ({"mem": "10G", "mem_per_gpu": "1G"}, "Slurm takes one"),
        ({"gpu_option": "gpus"}, "use gres or gpus-per-node"),
        ({"env": {"NO-DASH": "1"}}, "not a shell variable name"),
        ({"setup": ["a\nb"]}, "one non-empty shell line"),
        ({"sbatch_extra": ["exclusive"]}, "an option"),
        ({"account": "a b"}, "slurm.account"),
    ],
)
def test_a_bad_site_value_in_a_cluster_file_names_that_file(
    site: Path, change: dict[str, Any], message: str
) -> None:
    cluster = {**CLUSTER, "slurm": {**CLUSTER["slurm"], **change}}
    with pytest.raises(ConfigError, match=message) as err:
        read_run_config(_write(site, RUN, cluster))
    assert "clusters/lab.yaml" in str(err.value)


def test_where_a_cluster_is_found(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"cluster 'nope': no such cluster file.*local"):
        read_run_config(_write(site, {**RUN, "cluster": "nope"}))
    # a site's one file: used by a run that names no cluster, and by its own name
    monkeypatch.setenv(CLUSTER_ENV, str(site / "clusters" / "lab.yaml"))
    assert read_run_config(_write(site, {"name": "r"})).slurm.account == "lab"
    assert read_run_config(_write(site, RUN)).slurm.account == "lab"
    # a path, relative to the run config; the repository's own by name
    assert (
        read_run_config(_write(site, {**RUN, "cluster": "clusters/lab.yaml"})).slurm.mpi == "pmix"
    )
    monkeypatch.delenv(CLUSTER_ENV)
    assert read_run_config(_write(site, {**RUN, "cluster": "local"})).slurm.gpu_type == "sim"
    (site / "clusters" / "bad.yaml").write_text(yaml.safe_dump({**CLUSTER, "cluster": "x"}))
    with pytest.raises(ConfigError, match="cluster: a run's own key"):
        read_run_config(_write(site, {**RUN, "cluster": "clusters/bad.yaml"}))


def test_the_base_job_carries_the_site_and_asks_for_typed_gpus(site: Path) -> None:
    cfg = read_run_config(_write(site, RUN))
    text = render_sbatch(base_job_spec(cfg, Path("/runs/r-1"), python="py"))
    for line in ("--partition=gpu", "--account=lab", "--qos=high", "--gres=gpu:a100:2",
                 "--signal=B:USR2@300", "--output=/runs/r-1/batch-%j.out"):  # fmt: skip
        assert f"#SBATCH {line}\n" in text
    body = text.split("set -euo pipefail\n")[1].splitlines()
    assert body == ["export HF_HUB_OFFLINE=1", "module load cuda",
                    "exec py -m pearl_hpc.cli run --resume /runs/r-1"]  # fmt: skip
    cfg = read_run_config(_write(site, RUN), ["slurm.gpu_option=gpus-per-node"])
    assert "#SBATCH --gpus-per-node=a100:2\n" in render_sbatch(base_job_spec(cfg, Path("/r")))


def test_an_elastic_job_inherits_the_site_and_a_pool_overrides_it(site: Path) -> None:
    pools = [{"partition": "scav", "account": "scavenger", "mem": "100G"}]
    sets = ["slurm.mem_per_gpu=64G", "slurm.srun_extra=[--cpu-bind=none]"]
    cfg = read_run_config(_write(site, {**RUN, "elastic": {"pools": pools}}), sets)
    job = elastic_job_spec(cfg.elastic, [0], cfg.slurm, "tag", Path("/r/elastic"), "/m", "py")
    text = render_sbatch(job)
    assert "#SBATCH --account=scavenger\n" in text and "#SBATCH --qos=high\n" in text
    assert "#SBATCH --mem=100G\n" in text and "--mem-per-gpu" not in text  # the pool's own
    assert "#SBATCH --gres=gpu:a100:1\n" in text and "module load cuda\n" in text
    assert "--mpi=pmix" in text and "--srun-option=--cpu-bind=none" in text
    cfg = read_run_config(_write(site, RUN), sets)
    job = elastic_job_spec(cfg.elastic, [0], cfg.slurm, "tag", Path("/r/elastic"), "/m", "py")
    assert "#SBATCH --mem-per-gpu=64G\n" in render_sbatch(job)


SINFO = """gpu*|4|gpu:a100:8(S:0-1)|64+|512000|up
gpu*|2|gpu:a100:4,gpu:v100:4|32|256000|up
scav|6|gpu:a100:2|16|128000|down
"""


def test_sinfo_lines_parse_into_node_groups() -> None:
    groups = parse_sinfo(SINFO)
    assert groups[0] == NodeGroup("gpu", True, 4, 8, "a100", 64, 512000, True)
    assert (groups[1].gpus, groups[1].gpu_type) == (8, "a100")
    assert (groups[2].gpus, groups[2].default, groups[2].up) == (2, False, False)
    assert parse_sinfo("cpu|2|(null)|8|1000|up")[0].gpus == 0


def _cfg(**changes: Any) -> RunConfig:
    from pearl_hpc.core.schema import from_mapping

    pools = [{"partition": "scav", "gpus_per_worker": 1}]
    doc: dict[str, Any] = {
        "name": "r", "backend": "slurm", "slurm": {"gpu_type": "a100"}, "elastic": {"pools": pools}
    }  # fmt: skip
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            doc.setdefault(section, {})[field] = value
        else:
            doc[section] = value
    return from_mapping(RunConfig, doc)


@pytest.mark.parametrize(
    ("changes", "key", "message"),
    [
        ({"slurm__partition": "gpux"}, "slurm.partition", "no such partition"),
        ({"slurm__gpu_type": "h100"}, "slurm.gpu_type", "are a100"),
        ({"layout__cpus_per_rank": 32}, "layout.cpus_per_rank", "at most 64"),
        ({"workers__reserved_rollout": 8, "workers__training_gpus": 48,
          "layout__rollout_nodes": 1, "layout__training_nodes": 6},
         "layout", "7 nodes, but partition gpu has 6"),
    ],
)  # fmt: skip
def test_a_base_job_the_cluster_cannot_hold_is_named(
    changes: dict[str, Any], key: str, message: str
) -> None:
    cfg = _cfg(**changes)
    found = base_problems(cfg, parse_sinfo(SINFO), base_job_spec(cfg, Path("/r")))
    assert [k for k, _ in found] == [key] and message in found[0][1], found


def test_a_pool_the_cluster_cannot_hold_is_named() -> None:
    groups = parse_sinfo(SINFO)
    assert pool_problems(_cfg(), groups) == []
    bad = _cfg(elastic__pools=[{"partition": "nope"}, {"partition": "gpu", "gpus_per_worker": 16}])
    assert [k for k, _ in pool_problems(bad, groups)] == [
        "elastic.pools.0.partition", "elastic.pools.1.gpus_per_worker"
    ]  # fmt: skip


def test_channels_without_authentication_on_shared_nodes_are_warned_of() -> None:
    from pearl_hpc.backends.checks import shared_node_warnings

    def said(**changes: Any) -> list[str]:
        return [w.split(":")[0] for w in shared_node_warnings(_cfg(**changes))]

    pd = "PD disaggregation on nodes other users' jobs may share"
    assert said() == [pd]  # not exclusive, PD allowed
    assert said(policy__pd_policy="colocated") == []
    assert said(slurm__exclusive=True, elastic__pools=[]) == []
    assert said(slurm__exclusive=True) == [  # the pools' nodes are shared
        "PD disaggregation on elastic pools' nodes other users' jobs may share"
    ]
    fabric = {"gpu_type": "a100", "engine_interface": "ib0", "env": {"UCX_NET_DEVICES": "mlx5_0:1"}}
    assert said(slurm=fabric) == []
    assert said(slurm={**fabric, "exclusive": True}) == []
    assert shared_node_warnings(_cfg(backend="local", elastic={})) == []


def test_a_cluster_files_shapes_are_checked_and_named_by_line(tmp_path: Path) -> None:
    from pearl_hpc.config.cluster import read_cluster

    path = tmp_path / "lab.yaml"
    doc = {**CLUSTER, "nodes": [{"partitions": ["gpu", "gpux"], "gpus": 10, "gpu_type": "h100"}]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    found = dict(shape_problems(read_cluster(path), parse_sinfo(SINFO)))
    assert set(found) == {"nodes.0.gpus", "nodes.0.gpu_type", "nodes.0.partitions.1"}
    lines = key_lines(path)
    text = path.read_text().splitlines()
    assert text[lines["nodes.0.gpus"] - 1].strip() == "gpus: 10"
    assert "gpux" in text[lines["nodes.0.partitions.1"] - 1]


def test_a_model_directory_is_whole_or_named(tmp_path: Path) -> None:
    assert model_problem("tiny") == ""
    assert "no such directory" in model_problem(str(tmp_path / "nope"))
    assert "huggingface-cli download Qwen/Qwen3-8B" in model_problem("Qwen/Qwen3-8B")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert "tokenizer" in model_problem(str(model)) and "weights" in model_problem(str(model))
    (model / "tokenizer.json").write_text("{}")
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert model_problem(str(model)) == ""


def test_relative_paths_are_read_from_the_file_that_sets_them(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (site / "exp").mkdir()
    (site / "exp" / "model").mkdir()
    (site / "exp" / "my-profile.yaml").write_text(
        (REPO / "configs/profiles/tiny-cpu.yaml").read_text()
    )
    (site / "clusters").mkdir(exist_ok=True)
    (site / "clusters" / "tasks.jsonl").write_text('{"prompt": "1+1"}\n')
    cluster = {**CLUSTER, "run": {"tasks": {"path": "tasks.jsonl"}}}  # beside its file
    run = {**RUN, "model": "model", "profile": "my-profile.yaml", "runs_dir": "out"}
    (site / "clusters").mkdir(exist_ok=True)
    (site / "clusters" / "lab.yaml").write_text(yaml.safe_dump(cluster))
    path = site / "exp" / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    monkeypatch.chdir(site / "clusters")  # not where any of them is
    cfg = read_run_config(path)
    assert cfg.model == str(site / "exp" / "model")
    assert cfg.profile == str(site / "exp" / "my-profile.yaml")
    assert cfg.run.tasks.path == str(site / "clusters" / "tasks.jsonl")
    assert cfg.runs_dir == "out"  # where a run writes: the working directory's
    # a profile not beside the config: the shipped one of that name
    path.write_text(yaml.safe_dump({**run, "profile": "profiles/tiny-cpu.yaml"}))
    assert read_run_config(path).profile == str(REPO_CONFIGS / "profiles/tiny-cpu.yaml")
    # --set: the working directory's
    tasks = read_run_config(path, ["run.tasks.path=t.jsonl"]).run.tasks.path
    assert tasks == str(site / "clusters" / "t.jsonl")
    # a model that is not there stays as written (its check says so, a hub id's how)
    path.write_text(yaml.safe_dump({**run, "model": "lab/agent-7b"}))
    assert read_run_config(path).model == "lab/agent-7b"


def test_a_sites_template_wraps_the_base_jobs_script(site: Path) -> None:
    template = site / "clusters" / "batch.tmpl"
    (site / "clusters").mkdir(exist_ok=True)
    template.write_text(
        "#!/bin/bash -l\n$options\n#SBATCH --mail-type=FAIL\nset -eu\n"
        'echo "job $$SLURM_JOB_ID"\n$setup\n$command\n'
    )
    cluster = {**CLUSTER, "slurm": {**CLUSTER["slurm"], "template": "batch.tmpl"}}
    cfg = read_run_config(_write(site, RUN, cluster))
    assert cfg.slurm.template == str(template)  # beside the cluster's file
    text = render_sbatch(base_job_spec(cfg, Path("/runs/r-1"), python="py"))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash -l" and lines[1] == "#SBATCH --job-name=r"
    assert "#SBATCH --account=lab" in lines and "#SBATCH --mail-type=FAIL" in lines
    assert 'echo "job $SLURM_JOB_ID"' in lines  # $$: a dollar sign
    assert lines[-3:] == ["export HF_HUB_OFFLINE=1", "module load cuda",
                          "exec py -m pearl_hpc.cli run --resume /runs/r-1"]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("$options\n$setup\n", "$command is missing"),
        ("$options\n$cmd\n$command\n", "$cmd is not a placeholder"),
        ("$options\necho 5$\n$command\n", "a lone $"),
    ],
)
def test_a_bad_template_is_one_line(site: Path, text: str, message: str) -> None:
    (site / "clusters").mkdir(exist_ok=True)
    (site / "clusters" / "batch.tmpl").write_text(text)
    cluster = {**CLUSTER, "slurm": {**CLUSTER["slurm"], "template": "batch.tmpl"}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_run_config(_write(site, RUN, cluster))


def test_the_interface_the_run_binds_is_gloo_and_nccls_too() -> None:
    from pearl_hpc.config.slurm import SlurmSettings, job_env

    both = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert job_env(SlurmSettings(engine_interface="ib0")) == both
    mine = SlurmSettings(engine_interface="ib0", env={"NCCL_SOCKET_IFNAME": "=ib0,ib1", "X": "1"})
    assert job_env(mine) == {**both, "NCCL_SOCKET_IFNAME": "=ib0,ib1", "X": "1"}  # env wins
    for unnamed in ("hostname", "10.1.2.3"):  # no interface named: NCCL and gloo pick
        assert job_env(SlurmSettings(engine_interface=unnamed, env={"X": "1"})) == {"X": "1"}


def test_the_ranks_run_in_the_sites_image(site: Path) -> None:
    """slurm.container: pyxis puts the image on every step's srun (a one-node world's
    gforker in a one-task step), apptainer wraps every rank's command; the launchers
    stay on the host. (The Slurm run tests run ranks through an apptainer stand-in.)"""
    from pearl_hpc.backends.world import domain_argv, world_argv, world_env
    from pearl_hpc.comm.layout import base_layout, domains_of

    image = ["slurm.container.image=/shared/pearl.sqsh", "slurm.container.mounts=[/scratch]"]
    rank = ["python3", "-m", "pearl_hpc.rank", "rank", "--run-dir", "/r", "--model-dir", "/m"]
    pyxis = read_run_config(_write(site, RUN), ["slurm.container.runtime=pyxis", *image])
    assert world_argv(pyxis, Path("/r"), "/m", python="py") == [
        "srun", "-n1", "--mpi=none", "--container-image=/shared/pearl.sqsh",
        "--container-mounts=/scratch", "mpiexec.gforker", "-n", "1", *rank,
    ]  # fmt: skip
    engine = domains_of(base_layout(pyxis.workers, pyxis.layout))[-1]
    assert domain_argv(pyxis, Path("/r"), "/m", engine, 0, python="py")[:8] == [
        "srun", "-n1", "--mpi=none", "--overlap", "--container-image=/shared/pearl.sqsh",
        "--container-mounts=/scratch", "mpiexec.gforker", "-n",
    ]  # fmt: skip
    assert world_env(pyxis, Path("/r"), in_step=True) == {"SLURM_OVERLAP": "1"}
    job = elastic_job_spec(pyxis.elastic, [0], pyxis.slurm, "t", Path("/r/elastic"), "/m", "py")
    command = render_sbatch(job).splitlines()[-1]
    assert command.startswith("exec py -m pearl_hpc.backends.slurm_job ")  # on the host
    assert command.endswith(
        " --srun-option=--container-image=/shared/pearl.sqsh "
        "--srun-option=--container-mounts=/scratch --rank-command=python3"
    )
    sets = ["slurm.container.runtime=apptainer", "slurm.container.options=[--cleanenv]", *image]
    two = ["layout.training_nodes=1", "layout.rollout_nodes=1"]
    apptainer = read_run_config(_write(site, RUN), [*sets, *two])
    wrap = ["apptainer", "exec", "--nv", "--bind", "/scratch", "--cleanenv", "/shared/pearl.sqsh"]
    argv = world_argv(apptainer, Path("/r"), "/m", python="py")
    assert argv[0] == "srun" and argv[argv.index("apptainer") :] == [*wrap, *rank]
    job = elastic_job_spec(apptainer.elastic, [0], apptainer.slurm, "t", Path("/e"), "/m", "py")
    assert "".join(f" --rank-command={w}" for w in [*wrap, "python3"]) in render_sbatch(job)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("slurm.container.runtime=docker", "runtime 'docker': use pyxis, apptainer"),
        ("slurm.container.image=", "image '': the image the ranks run in"),
        ("slurm.container.mounts=[scratch]", "absolute paths"),
        ("slurm.container.mounts=['/a,/b']", "one mount an item"),
        ("slurm.container.options=[writable]", "an option, e.g. --container-writable"),
    ],
)
def test_a_bad_container_is_one_line(site: Path, item: str, message: str) -> None:
    image = ["slurm.container.runtime=pyxis", "slurm.container.image=/i.sqsh"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_run_config(_write(site, RUN), [*image, item])


def test_the_tool_sandbox_is_checked_before_the_queue(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment that runs the policy's code needs bubblewrap: where it cannot start
    a sandbox, a local run is refused with the fix, a Slurm run warned (this node is not
    the run's); an environment that runs no code is not asked."""
    import pearl_hpc.rollout.sandbox as sandbox
    from pearl_hpc.backends.checks import prequeue_checks

    def check(backend: str, env: str) -> Any:
        doc = {**RUN, "backend": backend, "model": "tiny", "run": {"env": env}}
        cfg = read_run_config(_write(site, doc))
        return prequeue_checks(cfg, slurm=False)

    assert "the tool sandbox of run.env calc starts here" in check("local", "calc").done
    why = "bubblewrap could not start a sandbox here (...); sysctl user.max_user_namespaces"
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: why)
    assert f"run.env calc: {why}" in check("local", "calc").problems
    slurm = check("slurm", "code")
    assert not slurm.problems and any(why in w for w in slurm.warnings)
    assert not any("sandbox" in line for line in check("local", "synthetic").lines())
