"""Cluster-wide config files, and a run config resolved over one.

A cluster's file is written once, by whoever runs the cluster, and holds what is true of
the cluster rather than of an experiment::

    name: lab                       # configs/clusters/lab.yaml, or $PEARL_CLUSTER_CONFIG
    nodes:                          # node shapes (checked by `pearl-hpc cluster check`)
      - partitions: [gpu, scavenger]
        gpus: 8
        gpu_type: a100
        cpus: 64
        memory_mb: 512000
    slurm: {account: lab, mpi: pmix, gpu_type: a100, setup: [module load cuda/12.4]}
    layout: {gpus_per_node: 8, gpu_memory_gb: 80}
    elastic: {pools: [{partition: scavenger}]}
    profile: /shared/pearl/profiles/a100.yaml

Every key besides ``name`` and ``nodes`` is a run config's key, a default every run on
the cluster starts from. A run config names its cluster (``cluster: lab``) and overrides
what differs; ``--set key.path=value`` overrides both. :func:`resolve_run_mapping`
records where each value came from (the dry run prints it).

Where ``cluster: NAME`` is looked for: ``$PEARL_CLUSTER_CONFIG`` (a file whose ``name``
is NAME, or a directory holding NAME.yaml), then the repository's ``configs/clusters``; a
NAME ending in .yaml is a path (relative to the run config). A run config without
``cluster`` uses ``$PEARL_CLUSTER_CONFIG`` when it names a file: a site sets it for all
its users.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pearl_hpc.config.files import REPO_CONFIGS, ConfigLoader, load_yaml, parse_yaml
from pearl_hpc.core.schema import from_mapping, spec_field
from pearl_hpc.errors import ConfigError

CLUSTER_ENV = "PEARL_CLUSTER_CONFIG"
CLUSTERS = REPO_CONFIGS / "clusters"


@dataclass(frozen=True)
class NodeShape:
    """Nodes of one shape, and the partitions that hold them."""

    partitions: list[str] = spec_field("the partitions these nodes are in")
    gpus: int = spec_field("GPUs of one node", ge=0)
    gpu_type: str = spec_field("their GRES type ('': untyped, as gres.conf names it)", default="")
    cpus: int = spec_field("CPUs of one node", default=1, ge=1)
    memory_mb: int = spec_field("memory of one node, MB (Slurm's RealMemory)", default=0, ge=0)


@dataclass(frozen=True)
class ClusterFile:
    """A cluster's file: its name, its node shapes, and the run-config defaults."""

    path: Path
    name: str
    nodes: list[NodeShape]
    defaults: dict[str, Any]

    def shapes_of(self, partition: str) -> list[NodeShape]:
        return [n for n in self.nodes if partition in n.partitions]


@dataclass
class Resolved:
    """A run config's mapping over its cluster's defaults and ``--set`` overrides, and
    where each leaf value came from (dotted key -> 'cluster FILE' or '--set')."""

    mapping: dict[str, Any]
    cluster: ClusterFile | None = None
    origins: dict[str, str] = field(default_factory=dict)
    sets: tuple[str, ...] = ()

    def text(self, source: Path) -> str:
        """The resolved config as YAML (what a run directory keeps), its sources in a
        comment; the cluster named by its absolute path."""
        mapping = dict(self.mapping)
        head = f"# {source}"
        if self.cluster:
            mapping["cluster"] = str(self.cluster.path.resolve())
            head += f" over cluster {self.cluster.name} ({self.cluster.path})"
        if self.sets:
            head += " with --set " + " --set ".join(self.sets)
        return f"{head}, resolved\n" + yaml.safe_dump(mapping, sort_keys=False)


def read_cluster(path: Path) -> ClusterFile:
    """A cluster's file (its defaults are checked as a run config's keys by
    :func:`pearl_hpc.config.run.read_run_config`)."""
    data = load_yaml(path)
    name = data.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: name: missing; name the cluster (name: lab)")
    shapes = data.pop("nodes", [])
    if not isinstance(shapes, list):
        raise ConfigError(f"{path}: nodes: expected a list of node shapes")
    nodes = [from_mapping(NodeShape, s, where=f"{path}: nodes[{i}]") for i, s in enumerate(shapes)]
    for key in ("name", "cluster"):
        if key in data:
            raise ConfigError(f"{path}: {key}: a run's own key; remove it from the cluster file")
    return ClusterFile(path, name, nodes, data)


def find_cluster(name: str, config_path: Path) -> Path | None:
    """The file of cluster ``name`` ('' : ``$PEARL_CLUSTER_CONFIG`` when it is a file)."""
    site = os.environ.get(CLUSTER_ENV, "")
    if not name:
        return Path(site) if site and Path(site).is_file() else None
    if name.endswith((".yaml", ".yml")):
        path = Path(name) if Path(name).is_absolute() else config_path.parent / name
        if not path.is_file():
            raise ConfigError(f"{config_path}: cluster {name}: no such file")
        return path
    if site and Path(site).is_dir() and (Path(site) / f"{name}.yaml").is_file():
        return Path(site) / f"{name}.yaml"
    if site and Path(site).is_file() and _name_of(Path(site)) == name:
        return Path(site)
    if (CLUSTERS / f"{name}.yaml").is_file():
        return CLUSTERS / f"{name}.yaml"
    known = sorted(p.stem for p in CLUSTERS.glob("*.yaml") if not p.stem.endswith("-bandwidth"))
    raise ConfigError(
        f"{config_path}: cluster {name!r}: no such cluster file (${CLUSTER_ENV} "
        f"{site or 'unset'}; configs/clusters has {', '.join(known) or 'none'}); write "
        f"configs/clusters/{name}.yaml or set ${CLUSTER_ENV} to the site's file"
    )


def _name_of(path: Path) -> str:
    try:
        return str(load_yaml(path).get("name", ""))
    except ConfigError:
        return ""


def resolve_run_mapping(path: str | Path, sets: Sequence[str] = ()) -> Resolved:
    """The run config at ``path`` over its cluster's defaults, with ``sets`` applied."""
    path = Path(path)
    own = load_yaml(path)
    cluster_name = own.get("cluster", "")
    if not isinstance(cluster_name, str):
        raise ConfigError(f"{path}: cluster: expected a name or a path, got {cluster_name!r}")
    cluster_path = find_cluster(cluster_name, path)
    cluster = read_cluster(cluster_path) if cluster_path else None
    origins: dict[str, str] = {}
    mapping = copy.deepcopy(cluster.defaults) if cluster else {}
    if cluster:
        origins = {key: f"cluster {cluster.path}" for key in _leaves(mapping)}
        absolute_paths(mapping, cluster.path.parent)
    own = copy.deepcopy(own)
    absolute_paths(own, path.parent)
    _merge(mapping, own, origins)
    for item in sets:
        key, value = _parse_set(item)
        if key in PATH_KEYS:
            value = _absolute(key, value, Path.cwd())
        _set(mapping, key, value, item)
        for old in [k for k in origins if k == key or k.startswith(key + ".")]:
            del origins[old]
        origins.update({k: "--set" for k in _leaves({key: value})})
    return Resolved(mapping, cluster, origins, tuple(sets))


def run_config_text(path: str | Path, sets: Sequence[str] = ()) -> str:
    """What a run directory keeps of its config (``--resume`` reads it): the config
    resolved over its cluster, with ``sets``."""
    return resolve_run_mapping(path, sets).text(Path(path))


# the keys that name files a run reads: a relative one is read from the directory of the
# file that sets it (a cluster's, a run config's; --set: the working directory). Where a
# run writes (runs_dir) is the working directory's, as sbatch's --output is.
PATH_KEYS = ("model", "profile", "run.tasks.path", "run.tasks.eval_path",
             "elastic.replay.file", "slurm.template")  # fmt: skip


def absolute_paths(mapping: dict[str, Any], base: Path) -> None:
    """Make the relative paths of ``mapping`` (its :data:`PATH_KEYS`) absolute against
    ``base``, in place."""
    for key in PATH_KEYS:
        *parents, last = key.split(".")
        node: Any = mapping
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(last), str):
            node[last] = _absolute(key, node[last], base)


def _absolute(key: str, value: Any, base: Path) -> Any:
    """``value`` of ``key`` against ``base``: as written when empty, absolute, a model
    named ``tiny``, or a model or profile not found there (a model: its check names it
    as written, a hub id too; a profile: the shipped one of that name, e.g.
    ``profiles/qwen3-8b-h800-tp2.yaml``)."""
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    here = Path(os.path.normpath(base.absolute() / value))  # (symlinks as they are named)
    if key == "model" and (value == "tiny" or not here.exists()):
        return value
    if key == "profile" and not here.exists() and (REPO_CONFIGS / value).is_file():
        return str(REPO_CONFIGS / value)
    return str(here)


def _leaves(mapping: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of a mapping's leaves (lists are leaves)."""
    out = []
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _leaves(value, dotted + ".")
        else:
            out.append(dotted)
    return out


def _merge(base: dict[str, Any], top: dict[str, Any], origins: dict[str, str],
           prefix: str = "") -> None:  # fmt: skip
    """``top`` over ``base``, mapping by mapping; a leaf of ``top`` drops its origin."""
    for key, value in top.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, origins, dotted + ".")
            continue
        base[key] = copy.deepcopy(value)
        for old in [k for k in origins if k == dotted or k.startswith(dotted + ".")]:
            del origins[old]


def _parse_set(item: str) -> tuple[str, Any]:
    key, eq, text = item.partition("=")
    if not eq or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item}: write KEY.PATH=VALUE, e.g. --set run.steps=3")
    try:
        return key, parse_yaml(text) if text else ""
    except yaml.YAMLError:
        raise ConfigError(f"--set {item}: the value is not YAML; quote it") from None


def _set(mapping: dict[str, Any], key: str, value: Any, item: str) -> None:
    """Set ``key`` (dotted; a number indexes a list) in ``mapping``."""
    *parents, last = key.split(".")
    node: Any = mapping
    for part in parents:
        if isinstance(node, list):
            node = node[_position(node, part, item)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"--set {item}: {part} is a value, not a section")
    if isinstance(node, list):
        node[_position(node, last, item)] = value
    else:
        node[last] = value


def _position(items: list[Any], part: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"--set {item}: {part}: the list has items 0-{len(items) - 1}")
    return int(part)



def key_lines(path: Path) -> dict[str, int]:
    """The line (1-based) of each dotted key of a YAML file (list items by index)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                dotted = f"{prefix}{k.value}"
                lines[dotted] = k.start_mark.line + 1
                walk(v, dotted + ".")
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines[f"{prefix}{i}"] = v.start_mark.line + 1
                walk(v, f"{prefix}{i}.")

    root = yaml.compose(path.read_text(), Loader=ConfigLoader)
    if root is not None:
        walk(root, "")
    return lines
