"""Suite-wide: how the tests share the machine when run by two pytest-xdist workers.

`scripts/test.sh` runs the suite with `pytest -n 2 --dist loadgroup`. Each test file is a
group (its module-scoped fixtures, such as a trained tiny run, are built once), except the
tests that start sandboxes: they all share one group, so they run one after the other on one
worker. Sandboxes of both backends run as the same unprivileged uid, and RLIMIT_NPROC counts
a uid's processes across the machine, so a sandbox test on the other worker would change
what a pids-limit or busy-uid test measures. Without xdist the markers do nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_ROOT = Path(__file__).parent
_SANDBOX_USERS = ("integration/sandbox", "integration/envs", "unit/sandbox", "unit/envs")
"""Folders whose tests start sandbox processes (Docker containers, bubblewrap, the checker)."""


LONGEST_FIRST = (
    "integration/train/test_train_learns_lora.py",
    "integration/train/test_train_fsdp2.py",
    "integration/train/test_train_tiny.py",
    "integration/train/test_train_lora.py",
    "integration/train/test_train_async.py",
    "integration/train/test_train_learns.py",
)
"""Groups handed out first, longest first (from `--durations` of fresh-clone runs: 130-600 s
each). xdist gives whole groups to whichever worker is free, in collection order, so a long
group collected late runs alone at the end while the other worker idles."""


def _group(item: pytest.Item) -> str:
    relative = Path(item.path).relative_to(_ROOT).as_posix()
    return "sandbox" if relative.startswith(_SANDBOX_USERS) else relative


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: the rest in order
