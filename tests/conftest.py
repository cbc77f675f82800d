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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = Path(item.path).relative_to(_ROOT).as_posix()
        shares_uid = relative.startswith(_SANDBOX_USERS)
        item.add_marker(pytest.mark.xdist_group("sandbox" if shares_uid else relative))
