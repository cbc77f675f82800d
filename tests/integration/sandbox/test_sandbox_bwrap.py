"""The bubblewrap backend: same hostile suite, same protocol."""

import pytest

from tir_rl.sandbox.bwrap import BwrapBackend
from tir_rl.sandbox.hostile import CASES, HostContext, run_case
from tir_rl.sandbox.pool import EpisodeSandbox

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def bwrap_ctx(bwrap_pool):
    with HostContext(lambda: EpisodeSandbox(bwrap_pool), grace_s=2.0).baited() as ctx:
        yield ctx


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES],
)
def test_hostile_input_is_contained(case, bwrap_ctx):
    report = run_case(case, bwrap_ctx)
    assert report.passed, report.message


def test_numpy_and_sympy_import_in_the_image_root(bwrap_pool):
    with EpisodeSandbox(bwrap_pool) as sb:
        r = sb.run(
            "import numpy, sympy\nint(numpy.arange(5).sum()), str(sympy.sqrt(8))", timeout_s=30
        )
    assert r.result == "(10, '2*sqrt(2)')"


@pytest.mark.slow
def test_rlimit_fallback_without_cgroups_contains_the_suite(sandbox_image):
    """The path taken without root: rlimits instead of cgroups (here: root with cgroups off)."""
    config = BwrapBackend.Config(pool_size=2, cgroups=False)
    pool = BwrapBackend(config=config).make_pool()
    try:
        with HostContext(lambda: EpisodeSandbox(pool)).baited() as ctx:
            for case in CASES:
                if not case.slow:
                    report = run_case(case, ctx)
                    assert report.passed, (case.name, report.message)
    finally:
        pool.close()
