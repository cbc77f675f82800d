"""The stabilizer head-to-head's tables, from its kept runs.

    python bench/collapse/stabilizers_report.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/stabilizers_report.py (the module `collapse_lab.stabilizers_report`).
"""

from collapse_lab.stabilizers_report import main

if __name__ == "__main__":
    main()
