"""docs/performance.md quotes its tables from the kept records, as the commands print them."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "performance.md").read_text()
SHARED_PREFIX_RECORDS = ROOT / "bench" / "shared_prefix_records"
PREFIX_CACHE_RECORDS = ROOT / "bench" / "prefix_cache_records"


def table_lines(output: str, header: str, rows: int) -> list[str]:
    """The table a bench printed: the line that starts with `header` and `rows` more."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return lines[start : start + 1 + rows]


@pytest.mark.parametrize("record", sorted(SHARED_PREFIX_RECORDS.glob("*_time.txt")), ids=str)
def test_each_kept_update_timing_is_quoted_whole(record):
    quoted = table_lines(record.read_text(), "layout ", 3)  # packed, bucketed, shared_prefix
    assert len(quoted) == 4
    assert "\n".join(quoted) in DOC


@pytest.mark.parametrize("record", sorted(PREFIX_CACHE_RECORDS.glob("*.txt")), ids=str)
def test_each_kept_prefix_cache_measurement_is_quoted_whole(record):
    quoted = table_lines(record.read_text(), "sampler ", 4)  # 2 dtypes x cache off, on
    assert len(quoted) == 5
    assert "\n".join(quoted) in DOC


def test_the_make_train_rows_are_the_reports():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from lab_sft_train import report
    finally:
        sys.path.pop(0)
    rows = [line for line in report().splitlines() if "trainer.packing" in line]
    assert len(rows) == 6  # both layouts, seeds 0-2
    for row in rows:
        assert row in DOC, row


def test_the_agent_loop_rows_are_the_report():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from agent_loop import report
    finally:
        sys.path.pop(0)
    rows = report().splitlines()[2:]
    assert len(rows) == len(list((ROOT / "bench" / "agent_loop_records").glob("*.txt"))) >= 5
    for row in rows:
        assert row in DOC, row
