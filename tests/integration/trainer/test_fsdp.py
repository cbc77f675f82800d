"""FSDP2 on the CPU (gloo): two ranks make the update one rank makes on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tir_rl.distributed import free_port
from tir_rl.trainer import Packing

WORKER = Path(__file__).with_name("fsdp_worker.py")


def run_ranks(
    out: Path,
    world_size: int,
    model: Path,
    *,
    kl_coef: float = 0.0,
    packing: Packing = Packing.PACKED,
    batch: str = "plain",
) -> dict:
    out.mkdir()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(out), "", str(world_size), str(port), str(model), str(kl_coef), packing, batch]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args[:1], str(r), *args[2:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return torch.load(out / "result.pt", weights_only=False)


def test_two_ranks_give_the_parameters_of_one_rank(tmp_path, tiny_model_path):
    one = run_ranks(tmp_path / "ws1", 1, tiny_model_path)
    two = run_ranks(tmp_path / "ws2", 2, tiny_model_path)
    assert abs(one["loss"] - two["loss"]) < 1e-6
    assert abs(one["grad_norm"] - two["grad_norm"]) < 1e-4 * one["grad_norm"]
    assert one["metrics"]["train/num_loss_tokens"] == two["metrics"]["train/num_loss_tokens"]
    assert one["state"].keys() == two["state"].keys()
    initial = _initial_state(tiny_model_path)
    for name, p1 in one["state"].items():
        p2 = two["state"][name]
        # Adam's first step moves every weight by about lr = 1e-3 whatever the gradient's size,
        # so float noise on a near-zero gradient can move a weight by up to ~lr; 1% of lr.
        assert torch.allclose(p1, p2, atol=1e-5, rtol=0), name
        assert not torch.equal(p1, initial[name]), f"{name} did not change"
    # The checkpoint written by the sharded run holds the same weights as the plain one.
    from safetensors.torch import load_file

    saved1 = load_file(tmp_path / "ws1" / "ckpt" / "model" / "model.safetensors")
    saved2 = load_file(tmp_path / "ws2" / "ckpt" / "model" / "model.safetensors")
    assert saved1.keys() == saved2.keys()
    for name in saved1:
        assert torch.allclose(saved1[name], saved2[name], atol=1e-5, rtol=0), name


def _initial_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_two_ranks_with_a_kl_penalty_give_one_ranks_update_and_keep_the_reference(
    tmp_path, tiny_model_path
):
    one = run_ranks(tmp_path / "ws1", 1, tiny_model_path, kl_coef=0.5)
    two = run_ranks(tmp_path / "ws2", 2, tiny_model_path, kl_coef=0.5)
    # The second step's KL to the (sharded) reference is the same global token mean.
    assert one["metrics"]["train/ref_kl"] > 0
    assert two["metrics"]["train/ref_kl"] == pytest.approx(one["metrics"]["train/ref_kl"], rel=1e-4)
    assert abs(one["loss"] - two["loss"]) < 1e-6
    initial = _initial_state(tiny_model_path)
    for name, p1 in one["state"].items():
        assert torch.allclose(p1, two["state"][name], atol=1e-5, rtol=0), name
    for run in (one, two):  # the reference is still the starting weights, bit for bit
        assert run["reference_state"].keys() == initial.keys()
        for name, tensor in run["reference_state"].items():
            assert torch.equal(tensor, initial[name]), name


def test_two_ranks_sharing_prefixes_give_one_unshared_ranks_update(tmp_path, tiny_model_path):
    """Shared prefixes under FSDP2, with a group split across the ranks, change nothing."""
    one = run_ranks(tmp_path / "ws1", 1, tiny_model_path, packing=Packing.PACKED, batch="groups")
    two = run_ranks(
        tmp_path / "ws2", 2, tiny_model_path, packing=Packing.SHARED_PREFIX, batch="groups"
    )
    assert abs(one["loss"] - two["loss"]) < 1e-6
    assert abs(one["grad_norm"] - two["grad_norm"]) < 1e-4 * one["grad_norm"]
    for name, p1 in one["state"].items():
        # As above: Adam's first step moves a near-zero-gradient weight by up to ~lr.
        assert torch.allclose(p1, two["state"][name], atol=1e-5, rtol=0), name
