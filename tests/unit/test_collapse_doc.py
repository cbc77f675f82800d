"""docs/collapse.md quotes only what `report.py` (and the studies beside it) regenerate from
the kept records.

Each suite's kept `report.md` must be what `report.py` writes from the records beside it, and
every result figure the page quotes to three decimals (held-out pass@1, paired changes,
intervals) or in scientific notation (k3 KL, log-ratios) must appear in one of those
regenerated reports, in `sequence_study.py`'s table, or in a kept command output
(`KEPT_OUTPUTS`).
Figures with fewer digits (0.19 → 0.03, step counts, minutes) are not checked.
"""

import functools
import re
from pathlib import Path

import pytest

from collapse_lab.report import load_runs, report_text

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "collapse" / "results"
DOC = ROOT / "docs" / "collapse.md"
SUITES = ("long", "map", "breaking", "sft_map", "sft_long", "guard_new")
SETTINGS_NOT_RESULTS = {"0.999", "1.001"}
"""The `geo_rs` band, quoted as a setting."""
KEPT_OUTPUTS = tuple(
    RESULTS / "sft_long" / name
    for name in (
        "precision_drift.md",
        "precision_drift_h200_cuda.md",
        "precision_drift_h200_cpu.md",
    )
)
"""Commands' outputs kept as written: their inputs (every checkpoint of the long runs) are
too large to keep, so they cannot be regenerated here; bench/collapse/README.md gives the
command that wrote each one."""
README = ROOT / "bench" / "collapse" / "README.md"


def _regenerated(suite: str) -> str:
    return report_text(load_runs(RESULTS / suite))


@functools.cache
def _stabilizers() -> str:
    from collapse_lab.stabilizers_report import report_text as stabilizers_text

    return stabilizers_text(_kept("stabilizers"))


@functools.cache
def _sequence_table() -> str:
    from collapse_lab.sequence_study import study

    return study(load_runs(RESULTS / "sft_long"))


@functools.cache
def _kept(suite: str) -> list:
    return load_runs(RESULTS / suite)


@functools.cache
def _guard_study(*new: str) -> str:
    from collapse_lab.guard_signal import study

    return study(_kept("sft_long"), [run for suite in new for run in _kept(suite)], 5, 5)


@pytest.mark.parametrize("suite", SUITES)
def test_each_kept_report_is_what_report_py_writes_from_its_records(suite):
    committed = (RESULTS / suite / "report.md").read_text()
    assert _regenerated(suite) + "\n" == committed, (
        f"run: python bench/collapse/report.py bench/collapse/results/{suite} "
        f"--plots docs/collapse/{suite}"
    )


def _figures(text: str) -> set[str]:
    text = text.replace("−", "-")
    decimals = set(re.findall(r"(?<![\d.])[+-]?\d\.\d{3}(?!\d)", text))
    scientific = {re.sub(r"e-0*(\d)", r"e-\1", n) for n in re.findall(r"\d\.\d+e-\d+", text)}
    return decimals | scientific


def test_every_figure_collapse_md_quotes_is_in_a_regenerated_report():
    reports = "\n".join([*(_regenerated(suite) for suite in SUITES), _sequence_table(),
                         _guard_study("guard_new"), _stabilizers(),
                         *(path.read_text() for path in KEPT_OUTPUTS)])  # fmt: skip
    reports = re.sub(r"e-0*(\d)", r"e-\1", reports)
    quoted = _figures(DOC.read_text()) - SETTINGS_NOT_RESULTS
    assert len(quoted) > 100  # the page quotes its tables, not only prose
    missing = sorted(f for f in quoted if f.lstrip("+") not in reports and f not in reports)
    assert not missing, f"docs/collapse.md quotes figures no kept record gives: {missing}"


def _missing_rows(table: str) -> tuple[int, list[str]]:
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    doc = DOC.read_text()
    return len(rows), [row for row in rows if row not in doc]


def test_the_detection_table_is_what_detection_py_writes_from_the_long_runs():
    from collapse_lab.detection import study

    count, missing = _missing_rows(
        study(load_runs(RESULTS / "sft_long"), window=25, smooth=5, baseline=25)
    )
    assert count > 5 and not missing, (
        "run: python bench/collapse/detection.py bench/collapse/results/sft_long, and paste "
        f"its table into docs/collapse.md section A3; missing rows: {missing}"
    )


def test_the_sequence_table_is_what_sequence_study_py_writes_from_the_long_runs():
    count, missing = _missing_rows(_sequence_table())
    assert count > 20 and not missing, (
        "run: python bench/collapse/sequence_study.py bench/collapse/results/sft_long, and "
        f"paste its table into docs/collapse.md section A5; missing rows: {missing}"
    )


@pytest.mark.parametrize("kept", KEPT_OUTPUTS, ids=lambda path: path.name)
def test_the_readme_gives_the_command_that_wrote_each_kept_output(kept):
    lines = README.read_text().splitlines()
    written = [i for i, line in enumerate(lines) if f"> {kept.relative_to(ROOT)}" in line]
    assert written, f"bench/collapse/README.md gives no command writing {kept.relative_to(ROOT)}"
    command = lines[written[0] - 1] + lines[written[0]]
    scripts = re.findall(r"(\w+)\.py", command)
    assert any(kept.stem.startswith(script) for script in scripts), (
        f"the command before the line writing {kept.name} runs {scripts}, not its script"
    )


def test_the_guard_study_record_is_what_guard_signal_py_writes_from_the_kept_runs():
    committed = (RESULTS / "guard_new" / "guard_signal.md").read_text()
    assert _guard_study("guard_new") + "\n" == committed, (
        "run: python bench/collapse/guard_signal.py bench/collapse/results/sft_long --new "
        "bench/collapse/results/guard_new > bench/collapse/results/guard_new/guard_signal.md"
    )


def test_the_stabilizer_report_is_what_stabilizers_report_py_writes_from_the_kept_runs():
    committed = (RESULTS / "stabilizers" / "report.md").read_text()
    assert _stabilizers() + "\n" == committed, (
        "run: python bench/collapse/stabilizers_report.py bench/collapse/results/stabilizers "
        "> bench/collapse/results/stabilizers/report.md"
    )


def test_the_stabilizer_matrix_in_collapse_md_is_the_kept_reports():
    count, missing = _missing_rows(_stabilizers().split("## Every cell")[0])
    assert count > 3 and not missing, (
        "paste the matrix of bench/collapse/results/stabilizers/report.md into docs/collapse.md "
        f"section A7; missing rows: {missing}"
    )


def test_the_stabilizer_guard_record_is_what_guard_signal_py_writes_from_the_kept_runs():
    committed = (RESULTS / "stabilizers" / "guard_signal.md").read_text()
    assert _guard_study("guard_new", "stabilizers") + "\n" == committed, (
        "run: python bench/collapse/guard_signal.py bench/collapse/results/sft_long --new "
        "bench/collapse/results/guard_new bench/collapse/results/stabilizers "
        "> bench/collapse/results/stabilizers/guard_signal.md"
    )


def test_the_truncation_report_is_what_truncation_report_py_writes_from_the_kept_runs():
    from collapse_lab.truncation_report import report_text as truncation_text

    committed = (RESULTS / "truncation" / "report.md").read_text()
    regenerated = truncation_text(_kept("truncation"))
    assert regenerated + "\n" == committed, (
        "run: python bench/collapse/truncation_report.py bench/collapse/results/truncation "
        "> bench/collapse/results/truncation/report.md"
    )
    rows = [line for line in regenerated.splitlines() if line.startswith("| top_p")]
    mismatch_doc = (ROOT / "docs" / "mismatch.md").read_text()
    missing = [row for row in rows if row not in mismatch_doc]
    assert len(rows) == 6 and not missing, (
        "paste the tables of bench/collapse/results/truncation/report.md into docs/mismatch.md "
        f"(truncated sampling); missing rows: {missing}"
    )
