"""Fakes for environment unit tests: an in-process stand-in for the Docker sandbox."""

import ast
import contextlib
import io
import json
from dataclasses import dataclass, field

import pytest

from tir_rl.sandbox.base import ExecResult


class FakeSandbox:
    """Runs code with `exec` in this process (no isolation!), keeping state between cells."""

    def __init__(self) -> None:
        self.namespace: dict = {"__name__": "__sandbox__"}
        self.cells: list[str] = []
        self.closed = False

    def run(self, code: str, *, timeout_s: float) -> ExecResult:
        assert not self.closed, "a closed sandbox was used"
        self.cells.append(code)
        out = io.StringIO()
        try:
            tree = ast.parse(code)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            with contextlib.redirect_stdout(out):
                exec(compile(tree, "<cell>", "exec"), self.namespace)
                value = None
                if last is not None:
                    expr = ast.Expression(last.value)
                    value = eval(compile(expr, "<cell>", "eval"), self.namespace)
        except Exception as exc:  # the model's code failed: an error result
            return ExecResult(stdout=out.getvalue(), error=f"{type(exc).__name__}: {exc}")
        result = None if value is None else repr(value)
        return ExecResult(stdout=out.getvalue(), result=result)

    def call_function(self, source, function_name, arguments, *, timeout_s):
        assert not self.closed, "a closed sandbox was used"
        self.cells.append(source)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(source, self.namespace)
                value = self.namespace[function_name](**arguments)
        except Exception as exc:
            return ExecResult(stdout=out.getvalue(), error=f"{type(exc).__name__}: {exc}")
        return ExecResult(stdout=out.getvalue(), value=json.loads(json.dumps(value)))

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeSandboxFactory:
    """Counts how many sandboxes were opened and closed; passes as `sandbox_factory`."""

    opened: list[FakeSandbox] = field(default_factory=list)

    @contextlib.contextmanager
    def __call__(self):
        sandbox = FakeSandbox()
        self.opened.append(sandbox)
        try:
            yield sandbox
        finally:
            sandbox.close()

    @property
    def num_open(self) -> int:
        return sum(not s.closed for s in self.opened)


@pytest.fixture
def fake_sandboxes() -> FakeSandboxFactory:
    return FakeSandboxFactory()
