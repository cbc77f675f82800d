"""Without cgroups, RLIMIT_NPROC counts every process of the sandbox uid: a start refused
with EAGAIN (e.g. while an earlier fork bomb is still dying) is retried, then explained."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest

from tir_rl.errors import SandboxError
from tir_rl.sandbox.bwrap import BwrapBackend, _KernelBusy

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as the sandbox uid"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]

UID = 1987
"""A uid no other test runs as: RLIMIT_NPROC counts a uid's processes machine-wide, so
sandboxes started by a test on the other pytest-xdist worker (as uid 1000) would eat the limit."""
PIDS_LIMIT = 2  # RLIMIT_NPROC = 16 processes of UID: room for the REPL once the uid is free
BUSY = 20  # processes that keep UID at its limit


def _processes_of_uid(count: int, seconds: float) -> list[subprocess.Popen]:
    def become_uid() -> None:
        os.setgid(UID)
        os.setuid(UID)

    processes = [
        subprocess.Popen(["sleep", str(seconds)], preexec_fn=become_uid) for _ in range(count)
    ]
    for process in processes:  # reaped as they end: a zombie still counts against the limit
        threading.Thread(target=process.wait, daemon=True).start()
    return processes


def _backend(busy_retry_s: float) -> BwrapBackend:
    config = BwrapBackend.Config(
        pool_size=1, cgroups=False, pids_limit=PIDS_LIMIT, uid=UID, busy_retry_s=busy_retry_s
    )
    return BwrapBackend(config=config)


def test_a_start_refused_while_the_uid_is_busy_succeeds_once_it_is_not(sandbox_image):
    backend = _backend(busy_retry_s=60.0)
    refused = threading.Event()
    start_once = backend._start_worker_once

    def watched_start():
        try:
            return start_once()
        except _KernelBusy:
            refused.set()
            raise

    backend._start_worker_once = watched_start
    others = _processes_of_uid(BUSY, seconds=600)

    def free_the_uid_once_refused() -> None:
        if refused.wait(timeout=30):
            for p in others:  # the uid is free once they are reaped
                p.kill()
                p.wait()

    # The worker starts in this thread: bubblewrap's --die-with-parent ends the sandbox when
    # the thread that started it exits.
    freer = threading.Thread(target=free_the_uid_once_refused)
    try:
        freer.start()
        worker = backend.start_worker()
        try:
            assert refused.is_set(), "the start was not refused while the uid was busy"
            assert worker.request({"op": "ping"}, timeout_s=30.0)["pong"]
        finally:
            worker.kill()
    finally:
        refused.set()  # the freer ends the busy processes in any case
        freer.join(timeout=60)
        for p in others:
            p.kill()
            p.wait()


def test_a_uid_that_stays_busy_gets_an_error_that_names_the_limit(sandbox_image):
    others = _processes_of_uid(BUSY, seconds=60)
    try:
        with pytest.raises(SandboxError, match=f"RLIMIT_NPROC .*uid {UID}"):
            _backend(busy_retry_s=1.0).start_worker()
    finally:
        for p in others:
            p.kill()
            p.wait()
