"""Dataclass config trees: load from YAML, apply `--set key=value` overrides, validate.

A config is a tree of (keyword-only) dataclasses. Values from YAML and from `--set` are
checked against the field's type annotation; an unknown key is an error that names the
nearest valid key, so a typo never silently falls back to a default. A section that moved
some of its keys declares where they went (`MOVED_KEYS`, a class variable: old key ->
(sub-section, key)): an old config still loads, with a warning that names the new key. A key
that is gone (`RETIRED_KEYS`: old key -> (its inert value, why)) is dropped at that value, so
saved configs load, and refused with the reason at any other.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tir_rl.errors import ConfigError, did_you_mean

C = TypeVar("C")
logger = logging.getLogger(__name__)


def from_dict(cls: type[C], data: Mapping[str, Any], *, where: str = "") -> C:
    """Build dataclass `cls` from a (nested) mapping, checking every key and value."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = _move_keys(cls, data, where)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigError(_unknown_key_message(path, key, fields))
        default = _default_of(fields[key])
        if isinstance(value, Mapping) and dataclasses.is_dataclass(default):
            # A section given in part keeps the defaults of its other keys, including
            # defaults the field's own class does not have (e.g. a required model path).
            # Keys the section moved go where they live before its defaults fill the rest.
            value = merge(to_dict(default), _move_keys(type(default), value, path))
        kwargs[key] = _convert(hints[key], value, path)
    try:
        config = cls(**kwargs)
    except TypeError as exc:  # a required field was not given
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc
    resolve = getattr(config, "resolve", None)
    if callable(resolve):  # fill in what follows other settings (e.g. `RunConfig.resolve`)
        resolve()
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    return config


def to_dict(config: Any) -> Any:
    """Plain YAML/JSON-able form of a config tree (enums as their values, paths as str)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, enum.Enum):
        return config.value
    if isinstance(config, Path):
        return str(config)
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested mapping; values are parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set trainer.lr=1e-6")
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} was already set to a value")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return nested


def merge(
    base: Mapping[str, Any], update: Mapping[str, Any], *, empty_clears: bool = False
) -> dict[str, Any]:
    """Deep-merge `update` into a copy of `base`.

    With `empty_clears`, an empty mapping in `update` replaces the mapping under its key
    instead of merging into it (which would change nothing): how `--set env.kwargs={}`
    drops every option the config file gave.
    """
    out = dict(base)
    for key, value in update.items():
        merges = isinstance(value, Mapping) and (value or not empty_clears)
        if merges and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value, empty_clears=empty_clears)
        else:
            out[key] = value
    return out


def load(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Load config `cls` from a YAML file (optional) plus `--set` overrides.

    An override merges into the file's mapping (`--set env.kwargs={horizon: 4}` keeps the
    file's other options); `{}` clears it (`--set env.kwargs={}`). Overrides apply in the
    order given, so `--set env.kwargs={} --set env.kwargs={horizon: 4}` leaves `{horizon: 4}`.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {path} does not exist.")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded
    for override in overrides:
        data = merge(data, parse_overrides([override]), empty_clears=True)
    return from_dict(cls, data)


def dump(config: Any, path: str | Path) -> None:
    """Write the resolved config tree as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def _move_keys(cls: type, data: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """`data` with the keys `cls.MOVED_KEYS` names moved where they now live (with a warning).

    A saved config of an older version keeps loading; a value given both ways is refused.
    """
    moved: Mapping[str, tuple[str, str]] = getattr(cls, "MOVED_KEYS", {})
    retired: Mapping[str, tuple[Any, str]] = getattr(cls, "RETIRED_KEYS", {})
    if not any(key in moved or key in retired for key in data):
        return data
    out = dict(data)
    for old, (inert, why) in retired.items():
        if old not in out:
            continue
        value = out.pop(old)
        if value != inert:
            path = f"{where}.{old}" if where else old
            raise ConfigError(f"{path}={value!r} is no longer a setting: {why}")
    for old, (section, key) in moved.items():
        if old not in out:
            continue
        value = out.pop(old)
        old_path = f"{where}.{old}" if where else old
        new_path = f"{where}.{section}.{key}" if where else f"{section}.{key}"
        target = dict(out.get(section) or {})
        if key in target and target[key] != value:
            raise ConfigError(
                f"{old_path}={value!r} and {new_path}={target[key]!r} are set: {old_path} is "
                f"the old name of {new_path}. Keep {new_path} only."
            )
        target[key] = value
        out[section] = target
        logger.warning("config key %s is now %s; read as that", old_path, new_path)
    return out


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _unknown_key_message(path: str, key: str, fields: Mapping[str, Any]) -> str:
    hint = did_you_mean(str(key), fields, cutoff=0.5)
    return f"Unknown config key {path!r}.{hint} Valid keys here: {', '.join(sorted(fields))}."


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits no {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            values = [str(m.value) for m in tp]
            hint = did_you_mean(str(value), values)
            choices = ", ".join(map(repr, values))
            raise ConfigError(f"{path}: {value!r} is not one of {choices}.{hint}") from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, where=path)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {k: _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"{path}: expected a path, got {value!r}")
    return value
