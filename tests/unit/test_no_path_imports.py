"""Tests and benches reach each other's code through installed packages, never through sys.path.

Code that both use lives in a package pyproject.toml installs: `tir_rl` (the product) or
`collapse_lab` (bench/collapse/collapse_lab/: the collapse lab's library, and the learning
tests' run that benches measure). So:

- no Python file under bench/ changes `sys.path`. A bench script imports the modules beside it
  because Python puts a script's folder first on `sys.path` (bench/soak_pool.py imports
  bench/soak_agent.py so; bench/collapse/*.py find collapse_lab so), and the packages because
  they are installed;
- a Python file under tests/ that changes `sys.path` names no bench/ path: no string in it
  mentions `bench`. Those that remain put the integration tests' helpers of tests/unit
  (tests/integration/{rollout,train,endpoint}), examples/ (whose modules are what the env
  resolver imports by name) or a temporary folder on the path, all within what tests own.

A change is any of `sys.path.insert/append/extend`, an assignment to `sys.path`,
`monkeypatch.syspath_prepend`, `monkeypatch.setattr(sys, "path", ...)` and
`site.addsitedir`. Loading one file by its path (`importlib.util.spec_from_file_location`, as
tests/unit/test_async_sim.py does for bench/async_sim.py) is not one: it adds no folder to
what every later import searches.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PATH_CALLS = frozenset({"sys.path.insert", "sys.path.append", "sys.path.extend", "site.addsitedir"})
"""Calls, as written, that add folders to `sys.path`."""


def path_changes(source: str) -> list[int]:
    """Line numbers of the statements in `source` that change `sys.path`."""
    if "sys" not in source and "addsitedir" not in source:
        return []  # every change names `sys` (or is site.addsitedir): no need to parse
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            setattr_path = (
                name.endswith("setattr")
                and len(node.args) >= 2
                and ast.unparse(node.args[0]) == "sys"
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "path"
            )
            if name in PATH_CALLS or name.endswith(".syspath_prepend") or setattr_path:
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t) == "sys.path" for t in targets):
                lines.append(node.lineno)
    return sorted(lines)


def mentions_bench(source: str) -> bool:
    """Whether any string constant in `source` names `bench`."""
    return any(
        isinstance(node, ast.Constant) and isinstance(node.value, str) and "bench" in node.value
        for node in ast.walk(ast.parse(source))
    )


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_bench_file_changes_sys_path():
    changes = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in python_files("bench")
        for line in path_changes(path.read_text(encoding="utf-8"))
    ]
    assert changes == [], "import through collapse_lab or tir_rl, not through sys.path"


def test_no_test_file_puts_a_bench_folder_on_sys_path():
    crossing = [
        f"{path.relative_to(ROOT)}:{','.join(map(str, lines))}"
        for path in python_files("tests")
        if (lines := path_changes(source := path.read_text(encoding="utf-8")))
        and mentions_bench(source)
    ]
    assert crossing == [], "import bench code from collapse_lab, not through sys.path"


# ------------------------------------------------------------------- the checker itself
def test_every_way_of_changing_sys_path_is_found():
    source = """
import site, sys
sys.path.insert(0, "a")
sys.path.append("b")
sys.path.extend(["c"])
sys.path = ["d", *sys.path]
sys.path += ["e"]
site.addsitedir("f")

def test(monkeypatch):
    monkeypatch.syspath_prepend("g")
    monkeypatch.setattr(sys, "path", [])
"""
    assert path_changes(source) == [3, 4, 5, 6, 7, 8, 11, 12]


def test_reading_sys_path_or_loading_a_file_by_its_path_is_no_change():
    source = """
import importlib.util, sys
here = "x" in sys.path
spec = importlib.util.spec_from_file_location("m", "bench/m.py")
"""
    assert path_changes(source) == []
    assert mentions_bench(source) and not mentions_bench("import sys\n# bench\n")
