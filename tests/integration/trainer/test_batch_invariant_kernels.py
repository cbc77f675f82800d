"""`trainer.kernels: batch_invariant`: a sequence's logprobs do not depend on its batch (CUDA).

vLLM's batch-invariant mode is CUDA-only in the pinned release, so this runs only where CUDA
and vLLM are both present; no machine this project had was both (the GPU machine lent to it
cannot install vLLM), so it has never run. The trainer recomputes one sequence alone and
among others packed and padded around it; under the mode the three must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.types import Trajectory

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="vLLM's batch-invariant mode is CUDA-only"
)


def trajectories(lengths: tuple[int, ...]) -> list[Trajectory]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        completion = torch.randint(5, 900, (n,), generator=gen).tolist()
        out.append(Trajectory([1, 504, 2462, 314], completion, [1] * n, [-1.0] * n, [0] * n))
    return out


def test_a_sequences_logprobs_do_not_depend_on_the_batch_it_is_in(tiny_model_path):
    pytest.importorskip("vllm")
    trainer = Trainer(Trainer.Config(
        model=str(tiny_model_path), device="cuda", temperature=1.0, kernels="batch_invariant",
        packing=Packing.PACKED, attn_implementation="eager",
    ))  # fmt: skip
    crowd = trajectories((48, 9, 30, 17, 5, 40))
    alone = trainer.compute_logprobs(TrainBatch.from_trajectories(crowd[:1]))[0, :48]
    together = trainer.compute_logprobs(TrainBatch.from_trajectories(crowd))[0, :48]
    assert torch.equal(alone, together), (alone - together).abs().max()
