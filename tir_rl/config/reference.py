"""A configuration reference in Markdown, generated from a tree of config dataclasses.

Field documentation is the docstring written under each field (`field_docs`), so the
reference can never drift from the code. The run config's reference is docs/configuration.md
(`python -m tir_rl.run_config > docs/configuration.md`; a test regenerates and compares).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from collections.abc import Sequence
from typing import Any

from tir_rl.config.field_docs import field_docs
from tir_rl.config.loading import to_dict


def render(cls: type, default: Any, *, prefix: str = "") -> list[str]:
    """Markdown sections for the config tree rooted at `cls` with value `default`."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        tp = hints[f.name]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            nested.append((f.name, type(value), value))
            continue
        doc = " ".join(docs.get(f.name, "").split()).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_type_name(tp)}` | `{_value(value)}` | {doc} |")
    title = prefix.rstrip(".") or "top level"
    out = [f"## `{title}`", ""]
    class_doc = inspect.getdoc(cls) or ""
    if class_doc and not class_doc.startswith(cls.__name__ + "("):
        out += [class_doc.splitlines()[0], ""]
    if rows:
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for name, sub_cls, sub_value in nested:
        out += render(sub_cls, sub_value, prefix=f"{prefix}{name}.")
    return out


def reference(root: type, *, header: Sequence[str] = ()) -> str:
    """The Markdown reference of the config tree `root` (at its defaults), after `header`."""
    return "\n".join([*header, *render(root, root())]) + "\n"


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return (text or str(tp)).replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def _value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(to_dict(value))
