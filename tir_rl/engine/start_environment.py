"""Environment variables an engine's processes inherit, set for its start only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def variable_for_start(name: str, value: str | None) -> Iterator[None]:
    """Set `name` to `value` for the block unless the user's environment already sets it.

    Only for the block: a later engine in the same process gets its own setting, not the
    first one's left behind in `os.environ`. None sets nothing.
    """
    if value is None or name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
