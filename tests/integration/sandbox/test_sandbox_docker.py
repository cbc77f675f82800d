"""The Docker backend against real containers: hostile suite, state, clean-up, CLI."""

import subprocess
import sys

import pytest

from tir_rl.errors import SetupError
from tir_rl.sandbox.docker import LABEL_OWNER, LABEL_RUN, LABEL_SANDBOX, DockerBackend, owner_id
from tir_rl.sandbox.hostile import CASES, HostContext, canary, run_case
from tir_rl.sandbox.image import ImageBuilder
from tir_rl.sandbox.pool import EpisodeSandbox
from tir_rl.tools import ToolRegistry, tool
from tir_rl.tools.python import NO_OUTPUT, python, run_python, use_sandbox

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def docker_ctx(docker_pool):
    with HostContext(lambda: EpisodeSandbox(docker_pool), grace_s=2.0).baited() as ctx:
        yield ctx


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES],
)
def test_hostile_input_is_contained(case, docker_ctx):
    report = run_case(case, docker_ctx)
    assert report.passed, report.message


def test_state_persists_within_an_episode_only(docker_pool):
    with EpisodeSandbox(docker_pool) as sb:
        sb.run("import numpy as np, sympy\nv = np.arange(4)", timeout_s=30)
        r = sb.run("int(v.sum()), str(sympy.factor(sympy.Symbol('x')**2 - 1))", timeout_s=10)
        assert r.result == "(6, '(x - 1)*(x + 1)')"
        open_file = sb.run("open('/tmp/note', 'w').write('hi')", timeout_s=5)
        assert open_file.ok
    with EpisodeSandbox(docker_pool) as sb:
        r = sb.run("import os\n('v' in globals(), os.listdir('/tmp'))", timeout_s=5)
        assert r.result == "(False, [])"


def test_call_function_round_trips_json(docker_pool):
    with EpisodeSandbox(docker_pool) as sb:
        r = sb.call_function(
            "def stats(xs):\n    return {'n': len(xs), 'mean': sum(xs) / len(xs)}",
            "stats",
            {"xs": [1.0, 2.0, 3.0]},
            timeout_s=5,
        )
    assert r.ok and r.value == {"n": 3, "mean": 2.0}


def test_pool_start_removes_leftovers_of_dead_runs(docker_backend, sandbox_image):
    api = docker_backend.api
    dead = api.create_container(
        docker_backend.config.image,
        command=["true"],
        labels={LABEL_SANDBOX: "1", LABEL_RUN: "crashed-run", LABEL_OWNER: "x:999999:dead"},
    )["Id"]
    alive = api.create_container(
        docker_backend.config.image,
        command=["true"],
        labels={LABEL_SANDBOX: "1", LABEL_RUN: "other-live-run", LABEL_OWNER: owner_id()},
    )["Id"]
    try:
        other = DockerBackend(config=DockerBackend.Config(pool_size=0))
        other.make_pool().close()
        ids = {c["Id"] for c in api.containers(all=True, filters={"label": LABEL_SANDBOX})}
        assert dead not in ids and alive in ids
    finally:
        for cid in (dead, alive):
            try:
                api.remove_container(cid, force=True)
            except Exception:
                pass


def test_missing_image_names_the_build_command(docker_backend):
    backend = DockerBackend(config=DockerBackend.Config(image="tir-rl-sandbox:no-such-tag"))
    with pytest.raises(SetupError, match="tir-rl sandbox build"):
        backend.check_image()


def test_unreachable_engine_names_the_start_command():
    backend = DockerBackend(config=DockerBackend.Config(docker_host="unix:///nonexistent.sock"))
    with pytest.raises(SetupError, match="scripts/docker-engine.sh"):
        backend.api  # noqa: B018 - connecting is the point


def test_build_is_skipped_when_up_to_date(sandbox_image):
    assert ImageBuilder().build() == sandbox_image


def test_cli_check_prints_a_table_and_exits_zero(sandbox_image):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tir_rl.cli",
            "sandbox",
            "check",
            "--case",
            "os_exit",
            "--set",
            "docker.pool_size=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "os_exit" in out.stdout and "1/1 passed" in out.stdout


def test_killed_container_is_replaced_without_blocking_other_episodes(docker_pool, docker_ctx):
    with EpisodeSandbox(docker_pool) as victim, EpisodeSandbox(docker_pool) as bystander:
        bystander.run("x = 1", timeout_s=5)
        victim.run("import os\nos._exit(1)", timeout_s=5)
        r = bystander.run("x + 1", timeout_s=5)
        assert r.result == "2" and r.duration_s < 1.0
    canary(docker_ctx)


@tool(sandbox=True, timeout_s=5)
def mean_and_max(xs: list[float]) -> dict:
    """Mean and maximum of numbers.

    Args:
        xs: the numbers
    """
    import statistics

    return {"mean": statistics.mean(xs), "max": max(xs)}


def test_sandbox_tool_runs_through_the_registry(docker_pool):
    registry = ToolRegistry([mean_and_max])
    with EpisodeSandbox(docker_pool) as sb:
        ok = registry.call("mean_and_max", {"xs": [1, 2, 3.5]}, sandbox=sb)
        bad = registry.call("mean_and_max", {"xs": []}, sandbox=sb)
    assert ok.error is None and ok.value == {"mean": 2.1666666666666665, "max": 3.5}
    assert bad.error is not None and "StatisticsError" in bad.content


def test_python_tool_in_a_docker_episode(docker_pool):
    registry = ToolRegistry([python])
    with EpisodeSandbox(docker_pool) as sb, use_sandbox(sb):
        # The first import of sympy can take longer than the tool's 10 s cell limit on a loaded
        # 2-core machine (a CI run timed out here, and the restarted REPL had no sympy).
        imported = run_python("import sympy", sb, timeout_s=120)
        assert imported == NO_OUTPUT, imported
        r = registry.call("python", {"code": "x = sympy.Symbol('x')\nsympy.solve(x**2 - 4, x)"})
        err = registry.call("python", {"code": "def f():\n    return 1 / 0\nf()"})
    assert r.content == "[-2, 2]"
    assert err.content.startswith("Traceback") and "ZeroDivisionError" in err.content
    assert 'File "<cell-3>", line 2, in f' in err.content
