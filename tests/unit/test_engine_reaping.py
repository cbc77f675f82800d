"""Engine process reaping, on real processes (``sleep`` stands in for an engine core).

Owners here are real processes too: the test process (alive) and finished children (dead).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tir_rl.doctor import Verdict, leftover_engine_finding
from tir_rl.engine.reaping import (
    OWNER_ENV,
    engine_processes,
    leftover_engine_processes,
    owner_alive,
    owner_id,
    reap_leftovers,
)


def dead_owner() -> str:
    """The `owner_id` of a process that has exited (and been waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    owner = owner_id(child.pid)
    child.kill()
    child.wait()
    return owner


def marked_sleeper(owner: str) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"], env={**os.environ, OWNER_ENV: owner})


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_owner_id_tells_a_live_process_from_a_dead_one():
    assert owner_alive(owner_id())
    assert not owner_alive(dead_owner())
    assert not owner_alive("not-an-owner")


def test_reaping_ends_only_processes_of_dead_owners(sleepers):
    dead = dead_owner()
    orphan = marked_sleeper(dead)
    live = marked_sleeper(owner_id())
    sleepers += [orphan, live]
    assert wait_until(lambda: {orphan.pid, live.pid} <= {p.pid for p in engine_processes()}, 5)
    assert orphan.pid in [p.pid for p in leftover_engine_processes()]

    ended = reap_leftovers(grace_s=2.0)

    assert orphan.pid in [p.pid for p in ended]
    assert live.pid not in [p.pid for p in ended]
    assert orphan.wait(timeout=5) == -signal.SIGTERM
    assert live.poll() is None


def test_watchdog_ends_marked_children_when_the_owner_is_killed(tmp_path):
    """An owner starts a marked child under `EngineGuard` and is SIGKILLed."""
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(
            """
            import subprocess, sys, time
            from tir_rl.engine.reaping import EngineGuard

            guard = EngineGuard()
            with guard.starting():
                child = subprocess.Popen(["sleep", "600"])
            print(child.pid, flush=True)
            time.sleep(600)
            """
        )
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    owner_mark = owner_id(owner.pid)
    try:
        child_pid = int(owner.stdout.readline())
        marked = engine_processes(owner=owner_mark)
        assert [p.pid for p in marked] == [child_pid]
        owner.kill()
        owner.wait()
        assert wait_until(lambda: not engine_processes(owner=owner_mark), timeout_s=10)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for process in engine_processes(owner=owner_mark):
            os.kill(process.pid, signal.SIGKILL)


def test_doctor_reports_the_leftovers_it_ended(sleepers):
    orphan = marked_sleeper(dead_owner())
    sleepers.append(orphan)
    assert wait_until(lambda: orphan.pid in [p.pid for p in engine_processes()], 5)

    finding = leftover_engine_finding(reap_leftovers(grace_s=2.0))

    assert finding.verdict is Verdict.WARN and f"{orphan.pid} sleep 600" in finding.detail
    assert orphan.wait(timeout=5) == -signal.SIGTERM
    assert leftover_engine_finding([]).verdict is Verdict.PASS


def test_the_watchdog_module_imports_without_torch():
    """The watchdog starts beside every engine and must be up at once: no torch import (it
    took 6 s on a busy machine, past the owner's death it watches for)."""
    check = "import sys, tir_rl.engine.reaping; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", check], check=True)
