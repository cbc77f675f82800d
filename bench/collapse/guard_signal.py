"""Which guard signal foretells a collapse, replayed through the guard over kept runs.

    python bench/collapse/guard_signal.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/guard_signal.py (the module `collapse_lab.guard_signal`).
"""

from collapse_lab.guard_signal import main

if __name__ == "__main__":
    main()
