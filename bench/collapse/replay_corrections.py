"""What each correction preset would have done to the episodes a run sampled.

    python bench/collapse/replay_corrections.py --help

A thin entry point: the code and the usage that `--help` prints are in
bench/collapse/collapse_lab/replay_corrections.py (the module `collapse_lab.replay_corrections`).
"""

from collapse_lab.replay_corrections import main

if __name__ == "__main__":
    main()
