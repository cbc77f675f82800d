"""The package's import graph follows the data flow: no cycles, no edge up a stage.

Every module of tir_rl belongs to one stage, lowest first. A module may import its own stage
and the stages below it, never one above: an environment does not know the chat format, the
chat format does not know the engine, nothing below the entry points reads the run config.
Imports are read from the source (module-level and function-local alike, `TYPE_CHECKING`
blocks included), so a lazy import cannot hide an upward edge.

The configuration is split by what it knows: the loader (`tir_rl.config`) is foundation and
knows no component, since every component owns its `Config`; the run config
(`tir_rl.run_config`), which composes those `Config`s, is an entry point.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "tir_rl",
            "errors",
            "types",
            "config",
            "console",
            "metric",
            "models",
            "lab",
            "lab.model",
            "process",
            "distributed",
        ),
    ),
    ("sandbox", ("sandbox",)),
    ("tools", ("tools",)),
    ("envs", ("envs",)),
    ("chat", ("chat",)),
    ("engine", ("engine",)),
    ("endpoint", ("endpoint",)),
    ("rollout", ("rollout",)),
    ("mismatch", ("mismatch",)),
    ("learning", ("trainer",)),
    ("weight sync", ("engine.weights.sync",)),
    ("reporting", ("report",)),
    (
        "entry",
        (
            "run_config",
            "runtime",
            "rl_loop",
            "evaluate",
            "config_audit",
            "doctor",
            "lab.sft_config",
            "lab.sft",
            "launch",
            "commands",
            "cli",
        ),
    ),
)
"""Stages, lowest first; a name covers the module ``tir_rl.<name>`` and its submodules."""


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of tir_rl, by dotted name, from pyproject's layout.

    `collapse_lab`, the collapse lab's library that pyproject installs beside it, is not
    tir_rl: it may import any stage, and tir_rl never imports it.
    """
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"tir_rl": root / "tir_rl"}
    folders.update(
        {
            pkg: root / folder
            for pkg, folder in setuptools["package-dir"].items()
            if pkg.startswith("tir_rl.")
        }
    )
    modules: dict[str, Path] = {}
    for package, folder in folders.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, anywhere in its source."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            # `from pkg import submodule` depends on the submodule, not on pkg's __init__
            found.update(submodules or {base})
    return {m for m in found if m in modules and m != name}


def stage_of(module: str) -> int:
    """Index of the stage `module` belongs to (the longest matching name wins)."""
    best: tuple[int, int] | None = None
    for index, (_, names) in enumerate(STAGES):
        for short in names:
            full = "tir_rl" if short == "tir_rl" else f"tir_rl.{short}"
            if module == full or module.startswith(full + "."):
                if short != "tir_rl" or module == "tir_rl":
                    length = len(full)
                    if best is None or length > best[1]:
                        best = (index, length)
    if best is None:
        raise AssertionError(
            f"{module} belongs to no stage: add it to STAGES in {Path(__file__).name}"
        )
    return best[0]


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_stage():
    for module in package_modules():
        stage_of(module)


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_module_imports_a_stage_above_its_own():
    upward = [
        f"{src} ({STAGES[stage_of(src)][0]}) imports {dst} ({STAGES[stage_of(dst)][0]})"
        for src, targets in sorted(import_graph().items())
        for dst in sorted(targets)
        if stage_of(dst) > stage_of(src)
    ]
    assert upward == []


def imported_names(path: Path) -> set[str]:
    """Every module name `path` imports (absolute imports, as written)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_product_never_imports_the_collapse_lab():
    lab_imports = {
        name: sorted(n for n in imported_names(path) if n.split(".")[0] == "collapse_lab")
        for name, path in package_modules().items()
    }
    assert {name: found for name, found in lab_imports.items() if found} == {}


# ------------------------------------------------------------------- the checker itself
def test_cycle_finder_finds_a_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_an_upward_import_is_reported(tmp_path):
    source = "from tir_rl.chat import ChatFormat\n\ndef f():\n    from tir_rl import rl_loop\n"
    (tmp_path / "probe.py").write_text(source)
    modules = {**package_modules(), "tir_rl.envs.probe": tmp_path / "probe.py"}
    found = imports_of("tir_rl.envs.probe", tmp_path / "probe.py", modules)
    assert found == {"tir_rl.chat", "tir_rl.rl_loop"}
    assert all(stage_of(m) > stage_of("tir_rl.envs.probe") for m in found)


@pytest.mark.parametrize(
    ("module", "stage"),
    [
        ("tir_rl", "foundation"),
        ("tir_rl.envs.multihop", "envs"),
        ("tir_rl.chat.parse", "chat"),
        ("tir_rl.mismatch.metrics", "mismatch"),
        ("tir_rl.trainer.loss", "learning"),
    ],
)
def test_stage_lookup(module, stage):
    assert STAGES[stage_of(module)][0] == stage


MAX_MODULE_LINES = 600
"""A module past this is doing more than one thing (issue 50): split it by concept."""


def test_no_module_is_over_600_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in package_modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_the_package_top_holds_at_most_16_modules():
    """A newcomer places a top-level module by its name; past 16 they stop being findable
    (process plumbing went to `tir_rl.process`, weight movement to `tir_rl.engine.weights`)."""
    top = sorted(p.name for p in (ROOT / "tir_rl").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 16, top


def test_code_vllm_runs_in_its_own_processes_sits_in_engine_in_vllm():
    """vLLM imports these by dotted name inside its processes; the sub-package says so."""
    from tir_rl.engine.in_vllm import gloo_receiver, layer_capture, server_guard

    for module in (gloo_receiver, layer_capture, server_guard):
        assert module.__name__.startswith("tir_rl.engine.in_vllm.")


def test_every_package_folder_is_declared_in_pyproject():
    """A sub-package left out of pyproject's list is missing from a built wheel (the GPU
    machine installs one), while an editable install hides it."""
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        ".".join(("tir_rl", *p.parent.relative_to(ROOT / "tir_rl").parts))
        for p in (ROOT / "tir_rl").rglob("__init__.py")
    }
    assert folders - declared == set()
