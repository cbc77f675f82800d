"""Detection study: which signal fires before a collapse, how early, how often wrongly.

    python bench/collapse/detection.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/detection.py (the module `collapse_lab.detection`).
"""

from collapse_lab.detection import main

if __name__ == "__main__":
    main()
