"""Suite-wide: how the tests share the machine when run by two pytest-xdist workers.

`scripts/test.sh` runs the suite with `pytest -n 2 --dist loadgroup`. Each test file is a
group (its module-scoped fixtures, such as a trained tiny run, are built once), except the
tests that start sandboxes: they all share one group, so they run one after the other on one
worker. Sandboxes of both backends run as the same unprivileged uid, and RLIMIT_NPROC counts
a uid's processes across the machine, so a sandbox test on the other worker would change
what a pids-limit or busy-uid test measures. Without xdist the grouping does nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).parent
TIMELINE_VAR = "TIR_RL_TEST_TIMELINE"
"""A file to which each test appends when it ran, on which worker, and its group (set by
`scripts/test.sh`; `python bench/test_timeline.py FILE` reads it): where a run's wall time
went, and whether a worker idled at the end."""
_SANDBOX_USERS = ("integration/sandbox", "integration/envs", "unit/sandbox", "unit/envs")
"""Folders whose tests start sandbox processes (Docker containers, bubblewrap, the checker)."""


LONGEST_FIRST = (
    "integration/train/test_train_tiny.py",
    "integration/train/test_train_fsdp2.py",
    "integration/endpoint/test_verifiers_env.py",
    "integration/train/test_train_async.py",
    "integration/engine/test_doctor_causes.py",
    "integration/train/test_train_learns_lora.py",
    "integration/train/test_train_learns_full_weight.py",
    "integration/test_documented_commands.py",
    "integration/test_slurm_launch.py",
    "integration/train/test_train_lora.py",
    "integration/engine/test_vllm_local.py",
    "integration/train/test_train_pool.py",
    "integration/rollout/test_chat_families_vllm.py",
    "integration/trainer/test_truncated_sampling.py",
    "integration/endpoint/test_endpoint_vllm.py",
    "integration/train/test_train_injection.py",
    "integration/test_lab_sft_build.py",
    "sandbox",
)
"""Groups handed out first, longest first (from `--durations=0` of a fresh-clone run:
about 85-430 s each). xdist gives whole groups to whichever worker is free, in collection
order, so a long group collected late runs alone at the end while the other worker idles."""


def _group(item: pytest.Item) -> str:
    return _group_of(Path(item.path).relative_to(_ROOT).as_posix())


def _group_of(path: str) -> str:
    """The group of a test file (its path relative to tests/, or from the rootdir)."""
    relative = path.removeprefix("tests/")
    return "sandbox" if relative.startswith(_SANDBOX_USERS) else relative


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: the rest in order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist; without it, nothing to do
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Hand out whole groups (`_group`): a file, or every sandbox test together.

    pytest-xdist 3.8's own `loadgroup` never grouped (its `xdist_group` marks did not reach
    the node ids), so each file's module fixtures, engines included, were built once per
    worker; this scheduler groups by scope instead.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep LONGEST_FIRST's order, not test counts

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid.split("::", 1)[0])

    return GroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Append the test's span (set-up, call and tear-down) to the timeline, when asked."""
    timeline = os.environ.get(TIMELINE_VAR)
    start = time.time()
    yield
    if timeline:
        span = {
            "test": item.nodeid,
            "group": _group(item),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": start,
            "end": time.time(),
        }
        with open(timeline, "a") as out:  # one short line per write: workers may interleave
            out.write(json.dumps(span) + "\n")
