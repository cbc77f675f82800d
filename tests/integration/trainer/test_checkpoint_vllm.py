"""A trainer checkpoint loads in vLLM and gives the trainer's logprobs."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_batch

from tir_rl.trainer import checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_loads_the_saved_model_and_agrees_with_the_trainer(
    make_trainer, tmp_path, monkeypatch
):
    # vLLM in this process, for this test only (the worker's later engines keep their own)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm = pytest.importorskip("vllm")
    trainer = make_trainer(lr=1e-2)
    batch = make_batch()
    trainer.train_step(batch, torch.ones(batch.num_sequences))
    path = checkpoint.save(tmp_path / "ckpt", trainer)
    llm = vllm.LLM(
        model=str(path / checkpoint.MODEL_DIR),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=False,
        kv_cache_memory_bytes=256 * 2**20,  # a fixed size, not a fraction of the host's free memory
    )
    try:
        prompt = batch.prompt_ids[0].tolist()
        params = vllm.SamplingParams(temperature=1.0, max_tokens=4, logprobs=0, seed=1)
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        sampled = list(out.token_ids)
        sampler = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, sampled, strict=True)])
        from tir_rl.trainer.batch import TrainBatch
        from tir_rl.types import Trajectory

        probe = TrainBatch.from_trajectories(
            [Trajectory(prompt, sampled, [1] * len(sampled), sampler.tolist(), [0] * len(sampled))]
        )
        ours = trainer.compute_logprobs(probe)[0]
        assert torch.allclose(ours, sampler, atol=1e-3), (ours, sampler)
    finally:
        # In-process vLLM initialises torch.distributed; leave no group behind for later tests.
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        del llm
        destroy_model_parallel()
        destroy_distributed_environment()
