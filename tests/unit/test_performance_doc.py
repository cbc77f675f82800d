"""docs/performance.md quotes its tables from the kept records, as the commands print them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "performance.md").read_text()
SHARED_PREFIX_RECORDS = ROOT / "bench" / "shared_prefix_records"
PREFIX_CACHE_RECORDS = ROOT / "bench" / "prefix_cache_records"
ENGINE_START_RECORDS = ROOT / "bench" / "engine_start_records"
SERVER_START_RECORDS = ROOT / "bench" / "server_start_records"


def bench_report(script: str) -> str:
    """What `python bench/SCRIPT --report` prints: the bench's table from its kept records."""
    command = [sys.executable, str(ROOT / "bench" / script), "--report"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


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
    report = bench_report("lab_sft_train.py")
    rows = [line for line in report.splitlines() if "trainer.packing" in line]
    assert len(rows) == 6  # both layouts, seeds 0-2
    for row in rows:
        assert row in DOC, row


def test_the_agent_loop_rows_are_the_report():
    rows = bench_report("agent_loop.py").splitlines()[2:]
    assert len(rows) == len(list((ROOT / "bench" / "agent_loop_records").glob("*.txt"))) >= 5
    for row in rows:
        assert row in DOC, row


@pytest.mark.parametrize(
    "record",
    sorted([*ENGINE_START_RECORDS.glob("*.txt"), *SERVER_START_RECORDS.glob("*.txt")]),
    ids=str,
)
def test_each_kept_engine_and_server_start_measurement_is_quoted_whole(record):
    quoted = table_lines(record.read_text(), "| phase ", 5)  # start, sample, close, tokens/s
    assert len(quoted) == 6
    assert "\n".join(quoted) in DOC
