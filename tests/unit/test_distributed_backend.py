"""The process-group backend must match the trainer's device (gloo + CUDA crashes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tir_rl import distributed as tdist
from tir_rl.errors import ConfigError


def test_backend_follows_the_device():
    assert tdist.backend_for(torch.device("cpu")) == "gloo"
    assert tdist.backend_for(torch.device("cuda", 0)) == "nccl"


def test_a_gloo_group_is_refused_for_a_cuda_trainer_and_accepted_for_a_cpu_one(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        tdist.check_backend(torch.device("cpu"))
        with pytest.raises(ConfigError, match="needs 'nccl'"):
            tdist.check_backend(torch.device("cuda", 0))
        with pytest.raises(ConfigError, match="backend 'gloo'"):
            tdist.init_process_group(device=torch.device("cuda", 0))
    finally:
        dist.destroy_process_group()


def test_no_group_means_nothing_to_check():
    assert not tdist.is_initialized()
    tdist.check_backend(torch.device("cuda", 0))


def test_a_lost_peer_is_told_from_other_errors():
    is_lost_peer = tdist.is_lost_peer
    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"
    assert is_lost_peer(RuntimeError(gloo))
    assert is_lost_peer(dist.DistNetworkError("the store went away"))
    assert not is_lost_peer(RuntimeError("shape mismatch: [2, 3] and [3, 2]"))
    assert not is_lost_peer(ValueError("connection reset by peer"))  # not from a collective
