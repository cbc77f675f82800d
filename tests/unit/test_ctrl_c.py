"""Ctrl-C in a one-process run raises KeyboardInterrupt wherever the main thread is, also
inside `asyncio.run` (whose own handling of Python's default handler can lose it)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tir_rl import distributed as tdist


@pytest.fixture(autouse=True)
def python_s_default_handler():
    """As in a run started from a shell (pytest-xdist workers ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def absorbs_its_cancellation() -> str:
    """Like library code that cleans up on cancellation and returns."""
    os.kill(os.getpid(), signal.SIGINT)
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        return "absorbed"
    return "slept"


def test_python_s_default_handler_loses_ctrl_c_to_such_a_coroutine():
    """Why the run installs its own handler (this documents asyncio.run's behaviour)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert asyncio.run(absorbs_its_cancellation()) == "absorbed"


def test_a_run_s_ctrl_c_is_raised_inside_asyncio_run():
    with tdist.interrupt_handling() as gate:
        assert gate is None  # one process: nothing to defer
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(absorbs_its_cancellation())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "handler restored"


def test_a_handler_the_caller_installed_is_left_alone():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with tdist.interrupt_handling():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_rank_0_s_open_sections_raise_inside_asyncio_run_too():
    gate = tdist.Rank0InterruptGate()
    with gate.installed(), gate.open(), pytest.raises(KeyboardInterrupt):
        asyncio.run(absorbs_its_cancellation())
