"""The REPL server's semantics, run as a plain subprocess (the unsafe-local backend)."""

import pytest

from tir_rl.sandbox.bwrap import BwrapBackend
from tir_rl.sandbox.pool import EpisodeSandbox


@pytest.fixture(scope="module")
def pool():
    config = BwrapBackend.Config(pool_size=1, max_output_bytes=200, hard_grace_s=1.0)
    pool = BwrapBackend(config=config, isolated=False).make_pool()
    yield pool
    pool.close()


def test_state_persists_within_an_episode_and_not_across(pool):
    with EpisodeSandbox(pool) as sb:
        assert sb.run("x = 41", timeout_s=5).ok
        r = sb.run("print(x + 1)\nx", timeout_s=5)
        assert (r.stdout, r.result) == ("42\n", "41")
    with EpisodeSandbox(pool) as sb:
        assert "NameError" in sb.run("x", timeout_s=5).error


def test_none_result_is_not_shown_and_statements_have_no_result(pool):
    with EpisodeSandbox(pool) as sb:
        assert sb.run("None", timeout_s=5).result is None
        assert sb.run("y = 2", timeout_s=5).result is None


def test_traceback_keeps_only_the_users_frames(pool):
    with EpisodeSandbox(pool) as sb:
        r = sb.run("import json\ndef f():\n    return json.loads('{')\nf()", timeout_s=5)
    assert r.error.startswith("Traceback") and "JSONDecodeError" in r.error
    assert '"<cell-' in r.error and "json/decoder.py" not in r.error
    assert "repl_server" not in r.error and '"<string>"' not in r.error


def test_syntax_error_is_reported(pool):
    with EpisodeSandbox(pool) as sb:
        r = sb.run("def (", timeout_s=5)
    assert "SyntaxError" in r.error and not r.state_lost


def test_output_is_capped_with_a_visible_marker(pool):
    with EpisodeSandbox(pool) as sb:
        r = sb.run("print('a' * 1000)\n'b' * 1000", timeout_s=5)
    assert len(r.stdout) < 300 and "truncated: 801 more bytes of stdout" in r.stdout
    assert "more characters of the result" in r.result


def test_output_of_one_cell_never_spills_into_the_next(pool):
    with EpisodeSandbox(pool) as sb:
        for i in range(50):
            assert sb.run(f"print({i})", timeout_s=5).stdout == f"{i}\n"


def test_soft_timeout_interrupts_python_and_keeps_state(pool):
    with EpisodeSandbox(pool) as sb:
        sb.run("kept = 1", timeout_s=5)
        r = sb.run("while True:\n    pass", timeout_s=0.3)
        assert r.timed_out and not r.state_lost
        assert sb.run("kept", timeout_s=5).result == "1"


def test_exit_is_ignored_and_the_interpreter_survives(pool):
    with EpisodeSandbox(pool) as sb:
        r = sb.run("exit(3)", timeout_s=5)
        assert "SystemExit" in r.error and not r.state_lost
        assert sb.run("1 + 1", timeout_s=5).result == "2"


def test_forked_child_never_answers_for_the_parent(pool):
    with EpisodeSandbox(pool) as sb:
        r = sb.run(
            "import os\npid = os.fork()\nif pid == 0:\n    print('child')\nelse:\n"
            "    os.waitpid(pid, 0)\n'parent'",
            timeout_s=5,
        )
        assert r.result == "'parent'" and "child" in r.stdout
        assert sb.run("2 * 3", timeout_s=5).result == "6"


def test_call_function_returns_json_and_rejects_non_json(pool):
    with EpisodeSandbox(pool) as sb:
        ok = sb.call_function(
            "def f(a, b):\n    return {'sum': a + b}", "f", {"a": 1, "b": 2}, timeout_s=5
        )
        bad = sb.call_function("def g():\n    return object()", "g", {}, timeout_s=5)
        missing = sb.call_function("x = 1", "h", {}, timeout_s=5)
    assert ok.ok and ok.value == {"sum": 3}
    assert not bad.ok and "not JSON" in bad.error
    assert not missing.ok and "does not define a function 'h'" in missing.error


def test_interpreter_exit_is_a_lost_state_result_and_the_episode_goes_on(pool):
    with EpisodeSandbox(pool) as sb:
        r = sb.run("import os\nos._exit(5)", timeout_s=5)
        assert r.state_lost and "status 5" in r.error
        assert sb.run("6 * 7", timeout_s=5).result == "42"
