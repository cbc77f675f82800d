"""Run a collapse-lab suite, then write its report.

    python bench/collapse/run.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/run.py (the module `collapse_lab.run`).
"""

from collapse_lab.run import main

if __name__ == "__main__":
    main()
