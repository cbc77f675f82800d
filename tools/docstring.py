"""Google-style docstring parsing: the text a model reads about a tool and its parameters.

The docstrings written under the fields of a parameter type are read by
`tir_rl.config.field_docs`, the one reader of field docstrings.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass, field

_ARGS_HEADERS = frozenset({"args", "arguments", "parameters", "params"})
_RETURNS_HEADERS = frozenset({"returns", "return", "yields", "yield"})
_ATTRIBUTES_HEADERS = frozenset({"attributes"})
_OTHER_HEADERS = frozenset(
    {
        "raises",
        "raise",
        "examples",
        "example",
        "note",
        "notes",
        "see also",
        "warning",
        "warnings",
        "todo",
        "references",
        "keyword args",
        "keyword arguments",
        "other parameters",
    }
)
_KNOWN_HEADERS = _ARGS_HEADERS | _RETURNS_HEADERS | _ATTRIBUTES_HEADERS | _OTHER_HEADERS
_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:(.*)$")


@dataclass(frozen=True)
class Docstring:
    """The parts of a Google-style docstring that tools use."""

    summary: str = ""
    """First paragraph, on one line."""
    body: str = ""
    """Paragraphs between the summary and the first section (may be empty)."""
    args: dict[str, str] = field(default_factory=dict)
    """Parameter name -> description, from the `Args:` section (or `Attributes:` for classes)."""
    returns: str = ""
    """Text of the `Returns:` section, on one line."""

    @property
    def description(self) -> str:
        """Summary, extended description and the `Returns:` text, as shown to a model."""
        parts = [p for p in (self.summary, self.body) if p]
        if self.returns:
            parts.append(f"Returns: {self.returns}")
        return "\n\n".join(parts)


def parse_docstring(doc: str | None) -> Docstring:
    """Split a Google-style docstring into summary, body, per-argument text and returns.

    Args:
        doc: the raw docstring (`__doc__`), or None.

    Returns:
        The parsed docstring; empty fields for parts that are absent.
    """
    if not doc or not doc.strip():
        return Docstring()
    lines = inspect.cleandoc(doc).splitlines()
    sections: dict[str, list[str]] = {}
    preamble: list[str] = []
    current: list[str] = preamble
    for line in lines:
        match = _HEADER.match(line)
        if match and match.group(1).strip().lower() in _KNOWN_HEADERS:
            current = sections.setdefault(match.group(1).strip().lower(), [])
        else:
            current.append(line)
    paragraphs = _paragraphs(preamble)
    summary = paragraphs[0] if paragraphs else ""
    body = "\n\n".join(paragraphs[1:])
    args: dict[str, str] = {}
    for header in (*_ARGS_HEADERS, *_ATTRIBUTES_HEADERS):
        args.update(_entries(sections.get(header, [])))
    returns = " ".join(
        " ".join(_paragraphs(sections[h])) for h in _RETURNS_HEADERS if h in sections
    )
    return Docstring(summary=summary, body=body, args=args, returns=returns)


def _paragraphs(lines: list[str]) -> list[str]:
    """Blank-line separated paragraphs, each joined onto one line."""
    out: list[str] = []
    chunk: list[str] = []
    for line in [*lines, ""]:
        if line.strip():
            chunk.append(line.strip())
        elif chunk:
            out.append(" ".join(chunk))
            chunk = []
    return out


def _entries(lines: list[str]) -> dict[str, str]:
    """`name (type): text` entries of an Args-like section; continuation lines are indented."""
    text = textwrap.dedent("\n".join(lines))
    entries: dict[str, list[str]] = {}
    name: str | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _ENTRY.match(line) if not line[0].isspace() else None
        if match:
            name = match.group(1)
            entries[name] = [match.group(2).strip()]
        elif name is not None:
            entries[name].append(line.strip())
    return {key: " ".join(part for part in parts if part) for key, parts in entries.items()}
