"""Reading config files (the edge of :mod:`pearl_hpc.core.schema`).

Every failure is a :class:`~pearl_hpc.errors.ConfigError` whose one-line message names
the file, the field and the fix.

Every config file (profiles, policies, runs, workloads, calibration outputs) is read by
:class:`ConfigLoader`: PyYAML's safe loader with YAML 1.2's core schema for plain
scalars, so numbers read the way users (and Python's ``repr``) write them:

    2e-5  1E9  .5  -3.  6.02e+23  -> float      17  +3  0x1F  0o17  1_000  -> int
    true / True / TRUE, false ... -> bool        ~  null  (empty)          -> None
    yes  no  on  off  y  n        -> string (YAML 1.1 booleans; a bool field refuses them)
    1:30  1:30:00  2026-12-01     -> string (YAML 1.1 read sexagesimal 90 and dates)
    017                           -> int 17 (YAML 1.1 read octal 15)
    .inf  -.inf  .nan             -> float, refused by every field's range check

Digits may be grouped with ``_`` between them, as in Python (YAML 1.2 has no grouping;
PyYAML's 1.1 rules allowed it, and configs used it).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, ClassVar

import yaml

from pearl_hpc.core.policies import PolicyConfig
from pearl_hpc.core.profile import WorkloadProfile
from pearl_hpc.errors import ConfigError

# the shipped configs (runs, profiles, clusters, workloads): package data (configs/ in a
# checkout is a link to it)
REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


_DIGITS = r"[0-9](?:_?[0-9])*"
_INT = re.compile(rf"^(?:[-+]?{_DIGITS}|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    rf"^(?:[-+]?(?:\.{_DIGITS}|{_DIGITS}(?:\.(?:{_DIGITS})?)?)(?:[eE][-+]?{_DIGITS})?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema scalars (see the module doc)."""

    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {
        first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] in ("null", "merge")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_yaml_int(self, node: yaml.Node) -> int:
        text = str(self.construct_scalar(node))  # type: ignore[arg-type]
        return int(text, 0) if text[:2] in ("0x", "0o") else int(text, 10)

    def construct_yaml_float(self, node: yaml.Node) -> float:
        text = str(self.construct_scalar(node))  # type: ignore[arg-type]
        lowered = text.lower()
        if lowered.endswith(".inf"):
            return -math.inf if text.startswith("-") else math.inf
        if lowered == ".nan":
            return math.nan
        return float(text)

    def construct_yaml_bool(self, node: yaml.Node) -> bool:
        return str(self.construct_scalar(node)).lower() == "true"  # type: ignore[arg-type]


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789"))
ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", ConfigLoader.construct_yaml_float)
ConfigLoader.add_constructor("tag:yaml.org,2002:bool", ConfigLoader.construct_yaml_bool)


def parse_yaml(text: str) -> Any:
    """One YAML document, read as every config file is (:class:`ConfigLoader`)."""
    return yaml.load(text, Loader=ConfigLoader)  # a SafeLoader: plain values only


def read_user_text(path: str | Path, what: str = "") -> str:
    """A text file a user hands the CLI; a missing, unreadable or non-UTF-8 one is one
    ConfigError line (``what``: the option that named it, e.g. ``--profile``)."""
    path = Path(path)
    where = f"{what} {path}" if what else str(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file whose top level is a mapping."""
    path = Path(path)
    text = read_user_text(path)
    try:
        data = parse_yaml(text)
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
    """A workload profile file (keys: docs/configuration.md)."""
    return WorkloadProfile.from_dict(load_yaml(path), where=str(path))


def load_policy(path: str | Path) -> PolicyConfig:
    """A controller policy file (keys: :class:`~pearl_hpc.core.policies.PolicyConfig`)."""
    return PolicyConfig.from_dict(load_yaml(path), where=str(path))
