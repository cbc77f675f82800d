"""Rank 0 handing out per-rank work and gathering results back: a real 2-process gloo group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tir_rl.distributed import (
    even_split,
    free_port,
    rank0_gather_object,
    rank0_gather_rows,
    rank0_run,
    rank0_share,
    scatter_object,
)

RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from tir_rl import distributed as tdist

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    tdist.init_process_group(rank=rank, world_size=2, master_port=port, timeout_s=60)
    parts = [{"rank": r, "x": torch.arange(3) + 10 * r} for r in range(2)] if rank == 0 else None
    mine = tdist.scatter_object(parts)
    assert mine["rank"] == rank, mine
    assert torch.equal(mine["x"], torch.arange(3) + 10 * rank), mine
    gathered = tdist.rank0_gather_object(mine["x"] * 2)
    if rank == 0:
        assert [g.tolist() for g in gathered] == [[0, 2, 4], [20, 22, 24]], gathered
    else:
        assert gathered == [], gathered
    assert tdist.broadcast_object((True, rank)) == (True, 0)

    # rank0_gather_rows: rows 0-1 on rank 0 (width 4), row 2 on rank 1 (width 2); a second
    # tensor alongside, and one that no rank has
    local = torch.full((2, 4), 1.0) if rank == 0 else torch.full((1, 2), 2.0)
    rows, doubled, absent = tdist.rank0_gather_rows(
        (local, local * 2, None), num_rows=3, shape=(3, 4)
    )
    if rank == 0:
        assert rows.tolist() == [[1.0] * 4, [1.0] * 4, [2.0, 2.0, 0.0, 0.0]], rows
        assert torch.equal(doubled, rows * 2), doubled
    else:
        assert rows is None and doubled is None
    assert absent is None

    # rank0_run: the work runs on rank 0 only and its value stays there
    ran = []
    value = tdist.rank0_run(lambda: ran.append(1) or "rank 0's")
    assert value == ("rank 0's" if rank == 0 else None), value
    assert ran == ([1] if rank == 0 else [])

    # rank0_share: the work runs on rank 0 only, each rank gets its part
    ran = []
    kept, part = tdist.rank0_share(lambda: (ran.append(1) or "kept", ["p0", "p1"]))
    assert (kept, part) == (("kept", "p0") if rank == 0 else (None, "p1")), (kept, part)
    assert ran == ([1] if rank == 0 else [])

    # ... and a failure on rank 0 is raised as its kind on every rank
    from tir_rl.errors import ParityError

    def fail():
        raise ParityError("probe drifted")

    told = []
    try:
        tdist.rank0_share(fail, on_shared_failure=lambda: told.append(rank))
    except ParityError as exc:
        assert "probe drifted" in str(exc), exc
    else:
        raise AssertionError("rank0_share swallowed the failure")
    assert told == [rank], told
    tdist.destroy_process_group()
    print("ok", rank)
    """
)


def test_scatter_and_gather_between_two_gloo_ranks():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0 and f"ok {r}" in log, log[-3000:]


def test_without_a_process_group_scatter_and_gather_are_local():
    assert scatter_object(["only"]) == "only"
    assert rank0_gather_object(7) == [7]
    local = torch.ones(2, 3)
    assert rank0_gather_rows((local, None), num_rows=2, shape=(2, 3)) == (local, None)
    assert rank0_run(lambda: "mine") == "mine"
    assert rank0_share(lambda: ("kept", ["mine"])) == ("kept", "mine")


@pytest.mark.parametrize(
    ("n", "parts", "sizes"),
    [(8, 2, [4, 4]), (5, 2, [3, 2]), (1, 2, [1, 0]), (0, 3, [0, 0, 0]), (7, 1, [7])],
)
def test_even_split_is_contiguous_and_balanced(n, parts, sizes):
    pieces = even_split(n, parts)
    assert [len(p) for p in pieces] == sizes
    assert [i for p in pieces for i in p] == list(range(n))


def test_nproc_per_node_reruns_train_under_torchrun(monkeypatch):
    from tir_rl.rl_loop import loop as train

    seen = []

    def fake_execv(path, command):
        seen.append(command)
        raise SystemExit(0)

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(train.os, "execv", fake_execv)
    with pytest.raises(SystemExit):
        train.exec_under_torchrun(2, "configs/fsdp2_cpu.yaml", ["model=tiny"])
    (command,) = seen
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", "-m"]  # fmt: skip
    assert command[6:] == ["tir_rl.cli", "train", "--config", "configs/fsdp2_cpu.yaml",
                           "--set", "model=tiny"]  # fmt: skip


def test_nproc_per_node_refuses_to_nest_under_torchrun(monkeypatch):
    from tir_rl import rl_loop as train
    from tir_rl.errors import ConfigError

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="torchrun"):
        train.exec_under_torchrun(2, "configs/fsdp2_cpu.yaml", [])
