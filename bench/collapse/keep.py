"""Copy the records of a folder of collapse-lab runs into the repository.

    python bench/collapse/keep.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/keep.py (the module `collapse_lab.keep`).
"""

from collapse_lab.keep import main

if __name__ == "__main__":
    main()
