"""CPU core sets: which cores the engine's and the trainer's threads run on.

On a CPU machine the engine and the trainer otherwise share every core. Giving each its own
cores (`engine.local.cpu_cores`, `trainer.cpu_cores`) lets an asynchronous run (k > 0) sample and
train at the same time without the two slowing each other down (docs/async.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tir_rl.errors import ConfigError


def parse_cpu_list(text: str | int, *, setting: str) -> frozenset[int]:
    """`"0"`, `"0-3"` or `"0,2-3"` as a set of core ids.

    Raises:
        ConfigError: the text is not such a list, or names a core this process may not use.
    """
    cores: set[int] = set()
    for part in str(text).split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ConfigError(
                f"{setting}={text!r} is not a CPU list: give core ids like 0, 0-3 or 0,2-3."
            ) from None
        if first < 0 or last < first:
            raise ConfigError(f"{setting}={text!r}: the range {part.strip()} is empty or negative.")
        cores.update(range(first, last + 1))
    usable = available_cores()
    if not cores <= usable:
        raise ConfigError(
            f"{setting}={text!r} names core(s) {sorted(cores - usable)} this process may not "
            f"use; it may use {format_cpu_list(usable)}."
        )
    return frozenset(cores)


def available_cores() -> frozenset[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def format_cpu_list(cores: frozenset[int]) -> str:
    """The inverse of `parse_cpu_list`: `{0, 1, 2, 5}` -> `"0-2,5"`."""
    ordered, parts = sorted(cores), []
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


def pin_process(cores: frozenset[int]) -> None:
    """Run every thread of this process, and those it starts later, on `cores` only.

    `os.sched_setaffinity(0, ...)` moves the calling thread alone; the threads already
    running (an engine's event loop, a rollout producer, torch's pool) are moved one by one.

    Raises:
        ConfigError: the platform cannot pin threads (not Linux).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("CPU pinning needs Linux (os.sched_setaffinity); leave cpu_cores unset.")
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


@contextlib.contextmanager
def restored_affinity() -> Iterator[None]:
    """Give the process back the cores and torch threads it had before the block.

    A run that pins its trainer (`trainer.cpu_cores`) pins the whole process; a later run in
    the same process (a sweep, a test) must start from every core again.
    """
    import torch

    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    cores, threads = frozenset(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        yield
    finally:
        if frozenset(os.sched_getaffinity(0)) != cores:
            pin_process(cores)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
