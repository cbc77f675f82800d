"""WarmPool and EpisodeSandbox logic, with fake workers (no processes)."""

import threading
import time

import pytest

from tir_rl.errors import SandboxError, SetupError
from tir_rl.sandbox.base import CellLimits
from tir_rl.sandbox.pool import EpisodeSandbox, WarmPool
from tir_rl.sandbox.protocol import LineReader, WorkerDied, WorkerTimeout, response_to_result


class FakeWorker:
    """Answers from a script: a dict, or an exception class to raise."""

    def __init__(self, name, script=None):
        self.name = name
        self.script = list(script or [])
        self.killed = threading.Event()
        self.requests = []

    def request(self, payload, *, timeout_s):
        self.requests.append((payload, timeout_s))
        if payload["op"] == "ping":
            return {"pong": 1}
        step = self.script.pop(0) if self.script else {"result": "ok"}
        if isinstance(step, type) and issubclass(step, Exception):
            raise step("scripted")
        return step

    def death_reason(self):
        return "the interpreter was killed by SIGSEGV (segmentation fault)"

    def kill(self):
        self.killed.set()


class FakeFactory:
    def __init__(self, scripts=()):
        self.scripts = list(scripts)
        self.started = []
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            script = self.scripts.pop(0) if self.scripts else []
            worker = FakeWorker(f"w{len(self.started)}", script)
            self.started.append(worker)
            return worker


def make_pool(factory, size=2, **limits):
    return WarmPool(
        factory, size=size, max_parallel_starts=1, limits=CellLimits(**limits), acquire_timeout_s=5
    )


def test_worker_is_acquired_lazily_and_killed_when_the_episode_ends():
    factory = FakeFactory()
    pool = make_pool(factory)
    try:
        with EpisodeSandbox(pool) as sb:
            assert all(not w.requests for w in factory.started)
            assert sb.run("1", timeout_s=1).result == "ok"
            used = [w for w in factory.started if len(w.requests) > 1]
            assert len(used) == 1
        assert used[0].killed.wait(2)
    finally:
        pool.close()


def test_each_acquire_schedules_a_replacement_so_the_pool_stays_warm():
    factory = FakeFactory()
    pool = make_pool(factory, size=3)
    try:
        for _ in range(5):
            with EpisodeSandbox(pool) as sb:
                sb.run("1", timeout_s=1)
        deadline = time.monotonic() + 5
        while len(factory.started) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(factory.started) == 3 + 5
        assert len({id(w) for w in factory.started}) == 8  # never reused
    finally:
        pool.close()


def test_hard_timeout_kills_the_worker_and_the_next_call_gets_a_fresh_one():
    factory = FakeFactory(scripts=[[WorkerTimeout], [WorkerTimeout]])
    pool = make_pool(factory, size=1, hard_grace_s=0.5)
    try:
        with EpisodeSandbox(pool) as sb:
            first = sb.run("while True: pass", timeout_s=1)
            second = sb.run("1", timeout_s=1)
        assert first.timed_out and first.state_lost and "killed" in first.error
        assert second.ok or second.state_lost
        payload, waited = factory.started[0].requests[-1]
        assert payload["timeout_s"] == 1.0 and waited == pytest.approx(1.5)
        assert factory.started[0].killed.wait(2)
    finally:
        pool.close()


def test_interpreter_death_is_reported_with_its_reason():
    factory = FakeFactory(scripts=[[WorkerDied]])
    pool = make_pool(factory, size=1)
    try:
        with EpisodeSandbox(pool) as sb:
            r = sb.run("import ctypes; ctypes.string_at(0)", timeout_s=1)
            assert r.state_lost and not r.timed_out
            assert "SIGSEGV" in r.error and "fresh interpreter" in r.error
            assert sb.num_restarts == 1
    finally:
        pool.close()


def test_name_error_after_a_restart_explains_that_state_was_lost():
    factory = FakeFactory(scripts=[[WorkerDied], [{"error": "NameError: name 'x' is not defined"}]])
    pool = make_pool(factory, size=2)
    try:
        with EpisodeSandbox(pool) as sb:
            sb.run("boom", timeout_s=1)
            r = sb.run("x", timeout_s=1)
        assert "restarted earlier in this episode" in r.error
    finally:
        pool.close()


def test_oversized_code_is_refused_without_touching_a_worker():
    factory = FakeFactory()
    pool = make_pool(factory, size=1, max_code_bytes=10)
    try:
        with EpisodeSandbox(pool) as sb:
            r = sb.run("x = '" + "a" * 100 + "'", timeout_s=1)
        assert not r.ok and "limit is 10 bytes" in r.error
        assert all(len(w.requests) == 0 for w in factory.started)
    finally:
        pool.close()


def test_non_json_arguments_are_an_error_result():
    pool = make_pool(FakeFactory(), size=1)
    try:
        with EpisodeSandbox(pool) as sb:
            r = sb.call_function("def f(x):\n    return x", "f", {"x": object()}, timeout_s=1)
        assert not r.ok and "not JSON" in r.error
    finally:
        pool.close()


def test_setup_problem_is_raised_at_once():
    calls = []

    def broken():
        calls.append(1)
        raise SetupError("image missing: run `tir-rl sandbox build`")

    pool = make_pool(broken, size=1)
    try:
        with pytest.raises(SetupError, match="tir-rl sandbox build"):
            EpisodeSandbox(pool).run("1", timeout_s=1)
    finally:
        pool.close()


def test_transient_start_failures_are_retried():
    factory = FakeFactory()
    failures = [SandboxError("fork failed"), SandboxError("fork failed")]

    def flaky():
        if failures:
            raise failures.pop()
        return factory()

    pool = make_pool(flaky, size=2)
    try:
        with EpisodeSandbox(pool) as sb:
            assert sb.run("1", timeout_s=1).result == "ok"
    finally:
        pool.close()


def test_persistent_start_failure_gives_up_with_sandbox_error():
    def broken():
        raise SandboxError("engine busy")

    pool = make_pool(broken, size=1)
    pool.max_attempts = 2
    try:
        with pytest.raises(SandboxError, match="engine busy"):
            EpisodeSandbox(pool).run("1", timeout_s=1)
    finally:
        pool.close()


def test_closed_episode_refuses_more_calls():
    pool = make_pool(FakeFactory(), size=1)
    try:
        sb = EpisodeSandbox(pool)
        sb.close()
        with pytest.raises(SandboxError):
            sb.run("1", timeout_s=1)
    finally:
        pool.close()


def test_line_reader_joins_chunks_and_enforces_size_and_eof():
    chunks = [b'{"a"', b': 1}\n{"b": 2}\n']
    reader = LineReader(lambda n, t: chunks.pop(0) if chunks else b"", max_line_bytes=100)
    assert reader.read_line(deadline=1e18) == b'{"a": 1}'
    assert reader.read_line(deadline=1e18) == b'{"b": 2}'
    with pytest.raises(WorkerDied):
        reader.read_line(deadline=1e18)
    flood = LineReader(lambda n, t: b"x" * 64, max_line_bytes=100)
    with pytest.raises(WorkerDied, match="over 100 bytes"):
        flood.read_line(deadline=1e18)

    def silent(n, t):
        raise TimeoutError()

    with pytest.raises(WorkerTimeout):
        LineReader(silent, max_line_bytes=10).read_line(deadline=1e18)


def test_response_decodes_function_values_and_cleans_surrogates():
    r = response_to_result({"value_json": '{"a": [1, 2]}', "stdout": "bad \udcff"}, duration_s=0.1)
    assert r.value == {"a": [1, 2]}
    r.stdout.encode("utf-8")
    assert r.duration_s == 0.1
