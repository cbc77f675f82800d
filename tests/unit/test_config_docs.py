from dataclasses import dataclass
from pathlib import Path

from tir_rl.config.reference import reference
from tir_rl.tools.docstring import attribute_docstrings

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    regenerate = "python -m tir_rl.config.reference > docs/configuration.md"
    assert committed == reference(), f"run: {regenerate}"


def test_every_config_field_is_documented():
    text = reference()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    undocumented = [row for row in rows if row.endswith("|  |")]
    assert rows
    assert undocumented == []


def test_attribute_docstrings_reads_the_docstring_under_each_field():
    @dataclass
    class Example:
        a: int = 1
        """first"""
        b: int = 2
        c: int = 3
        """third,
        on two lines"""

    assert attribute_docstrings(Example) == {"a": "first", "c": "third,\non two lines"}
