"""`trainer.kernels: vllm_cpu`: the trainer's logprobs equal vLLM-CPU's bit for bit.

Real vLLM-CPU (float32) samples from the tiny model, alone and four at a time; the trainer
recomputes the logprobs of what it sampled. With vLLM's kernels they are equal bit for bit;
with transformers' own (the default) they are not, which is what makes this test able to
fail. The gradient through the kernels is the model's up to float rounding.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tir_rl.engine import VLLMLocalEngine
from tir_rl.engine.base import GenerateRequest
from tir_rl.errors import ConfigError
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.types import Trajectory

PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]


def sampled_trajectories(model_path) -> list[Trajectory]:
    config = VLLMLocalEngine.Config(
        model_path=str(model_path), max_model_len=256, kv_cache_gib=0.0625, max_num_seqs=8
    )

    def request(seed: int) -> GenerateRequest:
        return GenerateRequest(prompt_token_ids=PROMPT, max_tokens=16, temperature=1.0, seed=seed)

    async def sample(engine) -> list:
        alone = [await engine.generate(request(seed)) for seed in range(2)]
        together = await asyncio.gather(*(engine.generate(request(seed)) for seed in range(2, 6)))
        return [*alone, *together]

    with VLLMLocalEngine(config) as engine:
        results = asyncio.run(sample(engine))
    return [
        Trajectory(PROMPT, r.token_ids, [1] * len(r.token_ids), list(r.logprobs),
                   [0] * len(r.token_ids))
        for r in results
    ]  # fmt: skip


@pytest.mark.vllm
def test_the_trainers_logprobs_equal_the_samplers_bit_for_bit(tiny_model_path):
    batch = TrainBatch.from_trajectories(sampled_trajectories(tiny_model_path))
    mask = batch.loss_mask.bool()

    def recomputed(kernels: str) -> torch.Tensor:
        trainer = Trainer(Trainer.Config(
            model=str(tiny_model_path), device="cpu", temperature=1.0, kernels=kernels,
            packing=Packing.PACKED,
        ))  # fmt: skip
        return trainer.compute_logprobs(batch)

    ours = recomputed("vllm_cpu")
    assert torch.equal(ours[mask], batch.sampler_logprobs[mask]), (
        (ours - batch.sampler_logprobs)[mask].abs().max()
    )
    default = recomputed("torch")
    assert not torch.equal(default[mask], batch.sampler_logprobs[mask])


def test_the_gradient_through_vllms_kernels_is_the_models(tiny_model_path):
    """Two sequences packed in one row, a fixed random cotangent on the logits."""
    from transformers import AutoModelForCausalLM

    from tir_rl.trainer.vllm_cpu_kernels import use_vllm_cpu_kernels

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (1, 40), generator=gen)
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None]
    grads, logits = {}, {}
    for kernels in ("torch", "vllm_cpu"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        if kernels == "vllm_cpu":
            use_vllm_cpu_kernels(model)
        else:  # the same packing for transformers' sdpa: one sequence after the other
            model.set_attn_implementation("sdpa")
        out = model(ids, position_ids=positions, use_cache=False).logits
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * cotangent).sum().backward()
        logits[kernels] = out.detach()
        grads[kernels] = {n: p.grad for n, p in model.named_parameters()}
    assert torch.allclose(logits["vllm_cpu"], logits["torch"], atol=1e-5)
    for name, want in grads["torch"].items():
        got = grads["vllm_cpu"][name]
        assert (got - want).norm() <= 1e-4 * want.norm(), name


def test_vllm_cpu_kernels_refuse_what_they_cannot_compute():
    with pytest.raises(ConfigError, match="trainer.packing shared_prefix"):
        Trainer.Config(kernels="vllm_cpu").validate()
    with pytest.raises(ConfigError, match="trainer.dtype bfloat16"):
        Trainer.Config(kernels="vllm_cpu", packing=Packing.PACKED, dtype="bfloat16").validate()


def test_two_models_on_vllms_kernels_each_keep_their_own_rotary_base(tiny_model_path):
    """The attention function transformers holds is global: it reads each module's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tir_rl.trainer.vllm_cpu_kernels import use_vllm_cpu_kernels

    ids = torch.arange(5, 45)[None]
    first = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    use_vllm_cpu_kernels(first)
    with torch.no_grad():
        before = first(ids, use_cache=False).logits
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 500000.0}
    other = AutoModelForCausalLM.from_pretrained(tiny_model_path, config=config)
    use_vllm_cpu_kernels(other)
    with torch.no_grad():
        assert torch.equal(first(ids, use_cache=False).logits, before)
        assert not torch.equal(other(ids, use_cache=False).logits, before)
