"""Which sequences a sequence mask drops: failed and succeeded episodes.

    python bench/collapse/sequence_study.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/sequence_study.py (the module `collapse_lab.sequence_study`).
"""

from collapse_lab.sequence_study import main

if __name__ == "__main__":
    main()
