"""The cluster config (configs/clusters/*.yaml), worker GPU naming and Slurm minutes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pearl_hpc.cluster import BaseJobConfig, ClusterConfig, ComponentConfig, load_cluster
from pearl_hpc.config import REPO_CONFIGS
from pearl_hpc.core.table import ElasticSource
from pearl_hpc.errors import ConfigError
from pearl_hpc.launch import _minutes
from pearl_hpc.slurm.capacity import Component, ComponentState, gpu_ids_of
from pearl_hpc.slurm.scripts import HetComponent

LOCAL = REPO_CONFIGS / "clusters" / "local.yaml"

MINIMAL: dict[str, Any] = {
    "name": "t",
    "runs_dir": "runs",
    "profile": "profiles/qwen3-8b-h800-tp2.yaml",
}


def write(tmp_path: Path, data: dict[str, Any], name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def with_request(**base: Any) -> dict[str, Any]:
    data = copy.deepcopy(MINIMAL)
    data["base"] = {"gpus_per_worker": 2, **base}
    data["elastic"] = {
        "requests": [
            {
                "at_step": 0,
                "components": [
                    {"shape": "prefill", "gpus_per_node": 4},
                    {"shape": "decode", "gpus_per_node": 8},
                ],
            }
        ]
    }
    return data


# ------------------------------------------------------------------ shipped


def test_shipped_local_config_loads() -> None:
    cfg = load_cluster(LOCAL)
    assert isinstance(cfg, ClusterConfig)
    assert cfg.name == "local"
    assert cfg.mpi == "pmi2"
    assert cfg.base.num_tasks == 1 + 2 + 2
    base = cfg.base_component()
    assert base == HetComponent(
        partition="normal", nodes=1, gpus_per_node=4, ntasks_per_node=5, time_limit="30:00"
    )
    [request] = cfg.elastic.requests
    assert [c.shape for c in request.components] == ["prefill", "decode"]
    assert [(r.component, r.at_step) for r in request.release] == [(1, 2)]
    for comp in request.components:
        assert cfg.elastic_component(comp).ntasks_per_node == 2  # 2 GPUs / 1 per worker
    assert cfg.profile_path() == REPO_CONFIGS / "profiles" / "qwen3-8b-h800-tp2.yaml"
    assert cfg.profile_path().is_file()


def test_minimal_config_takes_defaults(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, MINIMAL))
    assert cfg.elastic.requests == []
    assert cfg.base.nodes == 1
    assert cfg.run.heartbeat_timeout_s > 0


# --------------------------------------------------------------- components


@pytest.mark.parametrize(
    ("nodes", "training", "rollout", "per_node"),
    [
        (1, 1, 1, 3),
        (1, 2, 2, 5),
        (2, 2, 2, 3),  # ceil(5 / 2)
        (2, 3, 2, 3),  # 6 / 2
        (3, 1, 0, 1),  # ceil(2 / 3)
        (4, 8, 7, 4),  # 16 / 4
    ],
)
def test_base_component_tasks_per_node(
    tmp_path: Path, nodes: int, training: int, rollout: int, per_node: int
) -> None:
    data = {
        **MINIMAL,
        "base": {
            "partition": "gpu",
            "nodes": nodes,
            "gpus_per_node": 8,
            "num_training_workers": training,
            "num_rollout_workers": rollout,
            "cpus_per_task": 4,
            "time_limit": "2:00:00",
        },
    }
    comp = load_cluster(write(tmp_path, data)).base_component()
    assert comp.ntasks_per_node == per_node
    assert comp.ntasks_per_node * nodes >= 1 + training + rollout
    assert (comp.partition, comp.nodes, comp.gpus_per_node) == ("gpu", nodes, 8)
    assert (comp.cpus_per_task, comp.time_limit) == (4, "2:00:00")


@pytest.mark.parametrize(
    ("gpus_per_node", "gpus_per_worker", "per_node"),
    [(8, 2, 4), (8, 8, 1), (4, 1, 4), (2, 2, 1), (6, 3, 2)],
)
def test_elastic_component_one_task_per_worker(
    gpus_per_node: int, gpus_per_worker: int, per_node: int
) -> None:
    cfg = ClusterConfig(
        name="t", runs_dir="r", profile="p", base=BaseJobConfig(gpus_per_worker=gpus_per_worker)
    )
    comp = ComponentConfig(partition="el", nodes=2, gpus_per_node=gpus_per_node, time_limit="5:00")
    het = cfg.elastic_component(comp)
    assert het.ntasks_per_node == per_node
    assert (het.partition, het.nodes, het.gpus_per_node, het.time_limit) == (
        "el",
        2,
        gpus_per_node,
        "5:00",
    )


@pytest.mark.parametrize(("gpus_per_node", "gpus_per_worker"), [(6, 4), (2, 4), (3, 2)])
def test_elastic_component_not_a_multiple(gpus_per_node: int, gpus_per_worker: int) -> None:
    cfg = ClusterConfig(
        name="t", runs_dir="r", profile="p", base=BaseJobConfig(gpus_per_worker=gpus_per_worker)
    )
    with pytest.raises(ConfigError) as err:
        cfg.elastic_component(ComponentConfig(gpus_per_node=gpus_per_node))
    msg = str(err.value)
    assert "gpus_per_node" in msg
    assert "gpus_per_worker" in msg
    assert str(gpus_per_node) in msg and str(gpus_per_worker) in msg


def test_load_rejects_elastic_gpus_not_a_multiple(tmp_path: Path) -> None:
    data = with_request()
    data["elastic"]["requests"][0]["components"][1]["gpus_per_node"] = 3
    with pytest.raises(ConfigError, match=r"gpus_per_node 3 .*gpus_per_worker 2"):
        load_cluster(write(tmp_path, data))


# -------------------------------------------------------------- strictness


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, {**MINIMAL, "nmae": "x"})
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert "'nmae'" in msg
    assert str(path) in msg
    for key in ("base", "elastic", "mpi", "name", "policy", "profile", "run", "runs_dir"):
        assert key in msg.split("valid keys:")[1]


def test_unknown_base_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_cluster(write(tmp_path, {**MINIMAL, "base": {"gpus": 8}}))
    msg = str(err.value)
    assert "base" in msg and "'gpus'" in msg
    valid = msg.split("valid keys:")[1]
    for key in ("gpus_per_node", "gpus_per_worker", "nodes", "num_training_workers"):
        assert key in valid


def test_unknown_component_key(tmp_path: Path) -> None:
    data = with_request()
    data["elastic"]["requests"][0]["components"][0]["gpu"] = 4
    with pytest.raises(ConfigError) as err:
        load_cluster(write(tmp_path, data))
    msg = str(err.value)
    assert "elastic.requests[0].components[0]" in msg
    assert "'gpu'" in msg
    valid = msg.split("valid keys:")[1]
    assert valid.strip() == "gpus_per_node, nodes, partition, shape, time_limit"


def test_bad_shape(tmp_path: Path) -> None:
    data = with_request()
    data["elastic"]["requests"][0]["components"][0]["shape"] = "training"
    with pytest.raises(ConfigError, match=r"shape 'training'.*prefill, decode or any"):
        load_cluster(write(tmp_path, data))


def test_wrong_type_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"base\.nodes: expected an integer"):
        load_cluster(write(tmp_path, {**MINIMAL, "base": {"nodes": "two"}}))
    with pytest.raises(ConfigError, match=r"base\.nodes: must be >= 1"):
        load_cluster(write(tmp_path, {**MINIMAL, "base": {"nodes": 0}}))


def test_missing_required_key(tmp_path: Path) -> None:
    data = dict(MINIMAL)
    del data["profile"]
    with pytest.raises(ConfigError, match=r"profile: missing required key"):
        load_cluster(write(tmp_path, data))


def test_release_past_the_components(tmp_path: Path) -> None:
    data = with_request()
    data["elastic"]["requests"][0]["release"] = [{"component": 2, "at_step": 1}]
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert "release" in msg
    assert "elastic.requests[0]" in msg
    assert str(path) in msg


def test_release_of_the_last_component_is_fine(tmp_path: Path) -> None:
    data = with_request()
    data["elastic"]["requests"][0]["release"] = [{"component": 1, "at_step": 1}]
    cfg = load_cluster(write(tmp_path, data))
    assert cfg.elastic.requests[0].release[0].component == 1


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_cluster(tmp_path / "absent.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_cluster(empty)


# ----------------------------------------------------------------- profile


def test_profile_path_is_relative_to_configs_not_the_yaml(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, {**MINIMAL, "profile": "profiles/x.yaml"}))
    assert cfg.profile_path() == REPO_CONFIGS / "profiles" / "x.yaml"
    assert tmp_path not in cfg.profile_path().parents


def test_absolute_profile_path_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "mine.yaml"
    cfg = load_cluster(write(tmp_path, {**MINIMAL, "profile": str(target)}))
    assert cfg.profile_path() == target


# ------------------------------------------------------------ worker GPU ids


def test_gpu_ids_of() -> None:
    assert gpu_ids_of("12+1", "n3", 1, 2) == ["12+1:n3:gpu2", "12+1:n3:gpu3"]
    assert gpu_ids_of("12+1", "n3", 0, 2) == ["12+1:n3:gpu0", "12+1:n3:gpu1"]
    assert gpu_ids_of("7+0", "a", 3, 1) == ["7+0:a:gpu3"]


@pytest.mark.parametrize(("gpus_per_node", "gpus_per_worker"), [(4, 2), (8, 2), (8, 1), (8, 8)])
def test_gpu_ids_of_matches_capacity_gpu_sets(gpus_per_node: int, gpus_per_worker: int) -> None:
    source = ElasticSource("12", 1)
    comp = Component(
        source,
        gpus_per_node,
        gpus_per_worker,
        state=ComponentState.RUNNING,
        nodes=("n3", "n4"),
    )
    per_node = gpus_per_node // gpus_per_worker
    from_workers = [
        tuple(gpu_ids_of(source.tag, node, local, gpus_per_worker))
        for node in comp.nodes
        for local in range(per_node)
    ]
    assert list(comp.gpu_sets()) == from_workers
    if (gpus_per_node, gpus_per_worker) == (4, 2):
        assert comp.gpu_sets()[1] == ("12+1:n3:gpu2", "12+1:n3:gpu3")


# --------------------------------------------------------------- Slurm time


@pytest.mark.parametrize(
    ("limit", "minutes"),
    [
        ("30:00", 30),
        ("1:00:00", 60),
        ("90", 90),
        ("0:30", 1),  # 30 s rounds up to a minute
        ("10:30", 11),  # MM:SS: partial minutes round up
        ("2:00:01", 121),
    ],
)
def test_minutes(limit: str, minutes: int) -> None:
    assert _minutes(limit) == minutes


def test_minutes_whole_day() -> None:
    assert _minutes("1-00:00:00") == 1440
    assert _minutes("1-12") == 2160
    assert _minutes("1-12:30") == 2190


def test_minutes_days_with_time() -> None:
    assert _minutes("1-01:00:00") == 1440 + 60
    assert _minutes("2-00:30:00") == 2 * 1440 + 30
