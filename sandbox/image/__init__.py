"""The sandbox image: local build without a registry, and the in-sandbox REPL server.

`ImageBuilder` (in `build.py`) makes the image; `repl_server.py` is the interpreter that
runs inside every sandbox; `repl_source()` returns its text for shipping in at start.
"""

from pathlib import Path

from tir_rl.sandbox.image.build import ImageBuilder, default_cache_dir

__all__ = ["ImageBuilder", "default_cache_dir", "repl_source"]


def repl_source() -> str:
    """Source of the REPL server, passed to ``python3 -c`` when a sandbox starts."""
    return (Path(__file__).parent / "repl_server.py").read_text()
