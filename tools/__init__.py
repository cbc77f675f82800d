"""Tools as typed Python functions (tir_rl.tools).

`@tool` derives a tool's OpenAI function-calling schema from its signature and Google-style
docstring; `ToolRegistry` calls tools by name with a model's arguments and turns every mistake
into an error result the model can read. See docs/tools.md.
"""

from tir_rl.tools.registry import ToolRegistry
from tir_rl.tools.spec import ToolFunction, ToolSpec, tool
from tir_rl.tools.stats import ToolStats

__all__ = ["ToolFunction", "ToolRegistry", "ToolSpec", "ToolStats", "tool"]
