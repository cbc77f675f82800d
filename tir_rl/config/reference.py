"""Generate the configuration reference (docs/configuration.md) from the config dataclasses.

Field documentation is the docstring written under each field, read from the source by
`tir_rl.tools.docstring.attribute_docstrings` (the same reader that gives a tool's parameters
their descriptions), so the reference can never drift from the code (a test regenerates and
compares).

    python -m tir_rl.config.reference > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from typing import Any

from tir_rl.config.loading import to_dict
from tir_rl.tools.docstring import attribute_docstrings


def render(cls: type, default: Any, *, prefix: str = "") -> list[str]:
    """Markdown sections for the config tree rooted at `cls` with value `default`."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
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


def reference() -> str:
    """The whole configuration reference as Markdown."""
    from tir_rl.config.run import RunConfig

    header = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `python -m tir_rl.config.reference`; do not",
        "edit. Every key can be set in the YAML file or with `--set section.key=value`; an",
        "unknown key is an error that names the nearest valid one. `correction_preset` names a",
        "recipe (see docs/mismatch.md) whose fields the `correction` section can override.",
        "",
    ]
    return "\n".join(header + render(RunConfig, RunConfig())) + "\n"


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return (text or str(tp)).replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def _value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(to_dict(value))


if __name__ == "__main__":
    print(reference(), end="")
