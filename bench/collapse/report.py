"""Judge, plot and tabulate the runs of a collapse-lab folder.

    python bench/collapse/report.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/report.py (the module `collapse_lab.report`).
"""

from collapse_lab.report import main

if __name__ == "__main__":
    main()
