"""Reading config files (the edge of :mod:`pearl_hpc.core.schema`).

Every failure is a :class:`~pearl_hpc.errors.ConfigError` whose one-line message names
the file, the field and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.errors import ConfigError

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file whose top level is a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping of keys")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}"
        )
    return data


def load_profile(path: str | Path) -> WorkloadProfile:
    """A workload profile file (keys: README "Configs")."""
    return WorkloadProfile.from_dict(load_yaml(path), where=str(path))


def load_policy(path: str | Path) -> PolicyConfig:
    """A controller policy file (keys: :class:`~pearl_hpc.core.policies.PolicyConfig`)."""
    return PolicyConfig.from_dict(load_yaml(path), where=str(path))
