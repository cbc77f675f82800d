"""Field documentation: the docstring written under each field of a class, read from source.

Config dataclasses document every field this way (a docstring under the field); so do the
dataclasses and TypedDicts a tool takes as parameters. `ast` reads them, so what the
configuration reference and a tool's schema say can never drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under class attributes (`x: int` then `\"\"\"text\"\"\"`).

    The one reader of field docstrings: the configuration reference and the schemas of tool
    parameter types (dataclasses, TypedDicts) both use it. Bases are read first, so a
    subclass inherits its bases' field docs and may override them.

    Args:
        cls: a class (dataclass or TypedDict) whose source may be available.

    Returns:
        Attribute name -> its docstring (`inspect.cleandoc`: line breaks kept); a class
        whose source is unavailable contributes nothing.
    """
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        class_defs = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        if not class_defs:
            continue
        body = class_defs[0].body
        for node, following in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                found[node.target.id] = inspect.cleandoc(following.value.value)
    return found
