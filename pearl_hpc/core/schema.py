"""Strict construction of typed config dataclasses from plain mappings (parsed YAML).

Each field is declared with :func:`spec_field`: a docstring and an optional range. An
unknown key is an error listing the valid keys; a wrong type or an out-of-range value is
an error naming the field, what it means and how to fix it. Pure: no file I/O here
(:mod:`pearl_hpc.config` reads the files).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar

from pearl_hpc.errors import ConfigError

T = TypeVar("T")


def spec_field(
    doc: str,
    *,
    default: Any = dataclasses.MISSING,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with a docstring and a range checked by :func:`from_mapping`."""
    metadata = {"doc": doc, "gt": gt, "ge": ge, "le": le}
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_doc(cls: type, name: str) -> str:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata.get("doc", ""))
    raise KeyError(name)


def from_mapping(cls: type[T], data: Any, *, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, strictly (see module docstring)."""
    prefix = f"{where}: " if where else ""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{prefix}expected a mapping of keys for {cls.__name__}, got {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ConfigError(
            f"{prefix}unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in data:
            no_default = (
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            )
            if no_default:
                doc = f.metadata.get("doc", "")
                raise ConfigError(f"{path}: missing required key ({doc})")
            continue
        value = _coerce(hints[name], data[name], path)
        _check_range(f, value, path)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix}{exc}") from None


MAX_INT = 1 << 63  # no config number needs more; bigger ones are typos or attacks


def _check_range(f: dataclasses.Field[Any], value: Any, path: str) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return
    doc = f.metadata.get("doc", "")
    hint = f" ({doc})" if doc else ""
    gt, ge, le = f.metadata.get("gt"), f.metadata.get("ge"), f.metadata.get("le")
    if isinstance(value, int) and abs(value) >= MAX_INT:  # also beyond any float
        raise ConfigError(
            f"{path}: must be below 2**63, got an integer of {value.bit_length()} bits{hint}"
        )
    if not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value}{hint}")
    if gt is not None and not value > gt:
        raise ConfigError(f"{path}: must be > {gt}, got {value}{hint}")
    if ge is not None and not value >= ge:
        raise ConfigError(f"{path}: must be >= {ge}, got {value}{hint}")
    if le is not None and not value <= le:
        raise ConfigError(f"{path}: must be <= {le}, got {value}{hint}")


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, path)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where=path)
    if isinstance(hint, type) and issubclass(hint, Enum):
        valid = [m.value for m in hint]
        if value not in valid:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, valid))}")
        return hint(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {_describe(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer beyond the float range (YAML ints are unbounded)
            raise ConfigError(f"{path}: must be a finite number, got a huge integer") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_describe(value)}")
        return value
    raise ConfigError(f"{path}: unsupported config type {hint!r}")  # a bug in the schema


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"
