"""Which environment ``run.env`` names: a built-in, an installed plugin, or an import path.

    run.env: calc                          built-in (calc | code | synthetic)
    run.env: my_envs.maze:make_maze        an import path, ``package.module:factory``
    run.env: maze                          a plugin: an installed package's entry point in
                                           the group ``pearl_hpc.environments``

A package registers an environment in its ``pyproject.toml``::

    [project.entry-points."pearl_hpc.environments"]
    maze = "my_envs.maze:make_maze"

The factory is called once per trajectory with ``max_turns`` (``run.max_turns``) and the
options of ``run.env_options`` as keywords, and returns an
:class:`~pearl_hpc.rollout.envs.base.Environment`. It validates its own options (a
dataclass and :func:`~pearl_hpc.rollout.envs.base.options_config` do it strictly);
whatever it raises for bad options is reported as one line naming ``run.env_options``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pearl_hpc.config.run import RunSettings
from pearl_hpc.errors import ConfigError
from pearl_hpc.rollout.envs.base import Environment

ENTRY_POINT_GROUP = "pearl_hpc.environments"
Factory = Callable[..., Environment]


def _builtins() -> dict[str, Factory]:
    from pearl_hpc.rollout.envs.calc import CalcEnv
    from pearl_hpc.rollout.envs.code import CodeEnv
    from pearl_hpc.rollout.envs.synthetic import SyntheticEnv

    return {
        "calc": CalcEnv.from_options,
        "code": CodeEnv.from_options,
        "synthetic": SyntheticEnv.from_options,
    }


ENV_NAMES: tuple[str, ...] = ("calc", "code", "synthetic")  # the built-ins


def plugin_names() -> list[str]:
    """Environments installed packages register (entry point group above)."""
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


@functools.lru_cache(maxsize=64)
def resolve(spec: str) -> Factory:
    """The factory ``spec`` names; a :class:`ConfigError` saying what exists otherwise.
    Resolved once per spec (a lookup scans every installed distribution, ~7 ms, and
    :func:`make_env` runs per trajectory); a failure is not remembered."""
    builtins = _builtins()
    if spec in builtins:
        return builtins[spec]
    if ":" in spec:
        return _from_import_path(spec)
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
    if found:
        try:
            factory = found[0].load()
        except Exception as e:
            raise ConfigError(
                f"run.env {spec!r}: the plugin {found[0].value!r} does not import: "
                f"{type(e).__name__}: {e}"
            ) from None
        return _callable(spec, factory)
    plugins = ", ".join(plugin_names()) or "none installed"
    raise ConfigError(
        f"run.env {spec!r} is unknown; built-in: {', '.join(ENV_NAMES)}; plugins "
        f"({ENTRY_POINT_GROUP}): {plugins}; or an import path package.module:factory"
    )


def _from_import_path(spec: str) -> Factory:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"run.env {spec!r}: an import path is package.module:factory")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(
            f"run.env {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
            "install the package or put it on PYTHONPATH"
        ) from None
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"run.env {spec!r}: {module_name} has no {attr_path!r}")
        target = getattr(target, part)
    return _callable(spec, target)


def _callable(spec: str, factory: Any) -> Factory:
    if not callable(factory):
        raise ConfigError(f"run.env {spec!r} names {type(factory).__name__}, not a factory")
    return factory  # type: ignore[no-any-return]


def make_env(spec: str, **options: Any) -> Environment:
    """A fresh environment for one trajectory; ``options`` go to its factory."""
    factory = resolve(spec)
    try:
        env = factory(**options)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"run.env_options of {spec!r}: {type(e).__name__}: {e}") from None
    return _checked(spec, env)


def _checked(spec: str, env: Any) -> Environment:
    """The protocol's shape, checked once per environment (cheap)."""
    for method in ("reset", "step"):
        if not inspect.iscoroutinefunction(getattr(env, method, None)):
            raise ConfigError(f"run.env {spec!r}: the environment needs an async {method}()")
    turns = getattr(env, "max_turns", None)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ConfigError(f"run.env {spec!r}: the environment's max_turns must be an int >= 1")
    return env  # type: ignore[no-any-return]


def environment(run: RunSettings) -> Any:
    """A fresh environment of the run (one per trajectory)."""
    return make_env(run.env, max_turns=run.max_turns, **run.env_options)


def check_environment(run: RunSettings) -> None:
    """``run.env`` and its options make an environment (a machine without the tool
    sandbox is told so when the run starts, not by a config check)."""
    from pearl_hpc.rollout.sandbox import SandboxUnavailable

    try:
        environment(run)
    except SandboxUnavailable:
        pass
    except ConfigError as e:
        raise ConfigError(
            str(e) if str(e).startswith("run.env") else f"run.env_options: {e}"
        ) from None
