"""`env_maker`: an ``env.id`` of a run config to a function that builds the environment.

Three forms are accepted (the first two are Gymnasium's own)::

    tir_rl/MathPython-v0        a registered id (importing `tir_rl.envs` registers ours)
    my_module:My-v0             import `my_module` (which registers `My-v0`), then make it
    my_module:MyEnv             import `my_module`, then build its class MyEnv (a
                                `gymnasium.Env` or a `tir_rl.envs.AgentEnv`)

The module is imported when the id is resolved, not when `tir_rl.envs` is imported, from
`sys.path` or else the current folder (where `python -m` would find it). Each
failure is a `ConfigError` that says which part is wrong: the module cannot be found, its
import raised, or it neither registers nor defines the name (with the nearest names).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys
from collections.abc import Callable
from importlib.machinery import PathFinder
from typing import Any

import gymnasium

from tir_rl.envs.agent_env import AgentEnv
from tir_rl.errors import ConfigError, did_you_mean

EnvMaker = Callable[..., gymnasium.Env | AgentEnv]
"""Builds one environment from keyword arguments (its config fields, e.g. ``split``)."""
ENV_CLASSES = (gymnasium.Env, AgentEnv)
"""What a ``module:ClassName`` id may name: an env tir-rl steps, or one an agent plays."""


def env_maker(env_id: str) -> EnvMaker:
    """Resolve `env_id` (see the module docstring) to a function ``(**kwargs) -> env``.

    Raises:
        ConfigError: the id is not registered, or its module cannot be imported, or the
            module neither registers nor defines the name.
    """
    import tir_rl.envs  # noqa: F401 (registers the tir_rl/... ids)

    module_name, sep, name = env_id.partition(":")
    if not sep:
        if env_id not in gymnasium.registry:
            hint = did_you_mean(env_id, gymnasium.registry)
            raise ConfigError(
                f"env.id {env_id!r} is not a registered gymnasium id.{hint} A user environment "
                "is named 'module:Name-v0' (the module registers Name-v0 when imported) or "
                "'module:ClassName' (a gymnasium.Env subclass defined in the module)."
            )
        return _registered(env_id)
    if not module_name or not name:
        raise ConfigError(
            f"env.id {env_id!r}: expected 'module:Name-v0' or 'module:ClassName' with both "
            "parts non-empty (e.g. 'my_envs:Product-v0')"
        )
    module = _import(module_name, env_id)
    if name in gymnasium.registry:
        return _registered(name)
    found = getattr(module, name, None)
    if inspect.isclass(found) and issubclass(found, ENV_CLASSES):
        return found
    candidates = [*_registered_by(module_name), *_env_classes(module)]
    hint = did_you_mean(name, candidates)
    listing = f" It registers or defines: {sorted(candidates)}." if candidates else ""
    raise ConfigError(
        f"env.id {env_id!r}: module {module_name!r} was imported but registers no gymnasium id "
        f"{name!r} and defines no gymnasium.Env or AgentEnv class of that name.{hint}{listing} "
        f"Register it in the module (gymnasium.register(id={name!r}, entry_point=...)) or name "
        "the class."
    )


def _registered(env_id: str) -> EnvMaker:
    def make(**kwargs: Any) -> gymnasium.Env:
        return gymnasium.make(env_id, **kwargs)

    return make


def _import_here_or_on_path(module_name: str) -> Any:
    """Import `module_name` from `sys.path`, else from the current folder.

    `python -m ...` puts the current folder on `sys.path`; an installed console script such
    as `tir-rl` does not (its own folder comes first). An id names a module the user keeps
    beside them, so the current folder is looked in too, after everything installed.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        top = module_name.split(".")[0]
        on_path = here in sys.path or "" in sys.path
        if exc.name != top or on_path or PathFinder.find_spec(top, [here]) is None:
            raise
    sys.path.append(here)
    return importlib.import_module(module_name)


def _import(module_name: str, env_id: str) -> Any:
    try:
        return _import_here_or_on_path(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            top = [m.name for m in pkgutil.iter_modules()]
            hint = did_you_mean(module_name.split(".")[0], top)
            raise ConfigError(
                f"env.id {env_id!r}: cannot import module {module_name!r} ({exc}).{hint} Make it "
                "importable: run from the folder that holds it, add that folder to PYTHONPATH, "
                "or pip install the package."
            ) from exc
        raise ConfigError(
            f"env.id {env_id!r}: importing module {module_name!r} failed because it imports "
            f"{missing!r}, which is not installed ({exc}). Install it into this environment."
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"env.id {env_id!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc} (the traceback above shows where)"
        ) from exc


def _registered_by(module_name: str) -> list[str]:
    """Ids whose entry point lives in `module_name` (or a submodule of it)."""
    ids = []
    for env_id, spec in gymnasium.registry.items():
        entry = spec.entry_point
        where = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
        if where == module_name or where.startswith(module_name + "."):
            ids.append(env_id)
    return ids


def _env_classes(module: Any) -> list[str]:
    """Public env classes defined in `module` itself (not imported into it)."""
    return [
        attr
        for attr, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, ENV_CLASSES)
        and value.__module__ == module.__name__
        and not attr.startswith("_")
    ]
