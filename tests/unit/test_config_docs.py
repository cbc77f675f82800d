from dataclasses import dataclass
from pathlib import Path

from tir_rl.config.field_docs import field_docs
from tir_rl.run_config import configuration_reference

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == configuration_reference(), (
        "run: python -m tir_rl.run_config > docs/configuration.md"
    )


def test_every_config_field_is_documented():
    text = configuration_reference()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    undocumented = [row for row in rows if row.endswith("|  |")]
    assert rows
    assert undocumented == []


def test_field_docs_reads_the_docstring_under_each_field():
    @dataclass
    class Example:
        a: int = 1
        """first"""
        b: int = 2
        c: int = 3
        """third,
        on two lines"""

    assert field_docs(Example) == {"a": "first", "c": "third,\non two lines"}


def test_field_docs_inherits_the_docs_of_base_fields():
    @dataclass
    class Base:
        a: int = 1
        """from the base"""
        b: int = 2
        """overridden"""

    @dataclass
    class Child(Base):
        a: int = 3
        b: int = 4
        """the child's own"""

    assert field_docs(Child) == {"a": "from the base", "b": "the child's own"}
