"""The truncation suite's tables, from its kept runs.

    python bench/collapse/truncation_report.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/truncation_report.py (the module `collapse_lab.truncation_report`).
"""

from collapse_lab.truncation_report import main

if __name__ == "__main__":
    main()
