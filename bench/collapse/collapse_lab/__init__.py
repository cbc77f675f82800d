"""The collapse lab's library: its settings, verdict, reports and studies (bench/collapse/).

An importable package, installed beside `tir_rl` by the project's editable install
(pyproject.toml maps `collapse_lab` to bench/collapse/collapse_lab/), so that the lab's
command-line scripts (bench/collapse/*.py, each a thin entry point into a module here), the
other benches that share its code and the unit tests that check it all import it by name,
with no `sys.path` edits. A script run as `python bench/collapse/NAME.py` finds the package
beside it (Python puts a script's folder first on `sys.path`) whether or not it is installed.

Modules: `settings` (the named suites), `run` (runs a suite), `verdict` (did a run collapse),
`report` (judge, plot and tabulate a folder of runs), `keep` (copy a folder's records into
the repository), `detection`, `guard_signal`, `sequence_study`, `replay_corrections` and
`stabilizers_report` (the studies over kept records), `drift_episodes` (the episodes of
bench/precision_drift.py's study). `lab_learns` is the lab model's learning run, one definition
for the benches that measure it.
"""
