"""Shared-prefix packing: each group's prefix computed once, with the logprobs, loss and
gradient of computing it for every sample (`Packing.SHARED_PREFIX`)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_group_batch, with_sampler_logprobs

from tir_rl.errors import ConfigError
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing
from tir_rl.trainer.packing import plan_micro_batches

MODELS = ["tiny", "lab-sft"]
"""The tiny random model and the trained lab model (`make train`'s)."""


def computed_tokens(batch, budget: int, packing: Packing) -> int:
    return sum(mb.num_padded_tokens for mb in plan_micro_batches(batch, budget, packing))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", [24, 4096])
def test_shared_prefix_logprobs_equal_the_packed_ones(make_trainer, model, budget):
    batch = make_group_batch()
    assert computed_tokens(batch, 4096, Packing.SHARED_PREFIX) < computed_tokens(
        batch, 4096, Packing.PACKED
    )
    packed = make_trainer(
        model=model, micro_batch_tokens=budget, packing=Packing.PACKED
    ).compute_logprobs(batch)
    shared = make_trainer(
        model=model, micro_batch_tokens=budget, packing=Packing.SHARED_PREFIX
    ).compute_logprobs(batch)
    valid = torch.arange(batch.completion_ids.shape[1])[None] < batch.completion_lens[:, None]
    assert (packed[valid] != 0).all()
    torch.testing.assert_close(shared, packed, atol=1e-5, rtol=0)


def step_with_gradients(trainer: Trainer, batch, advantages):
    """One `train_step`, and the gradients AdamW was handed (normalized and clipped)."""
    grads: list[torch.Tensor] = []

    def keep(optimizer, *_):
        grads.extend(p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"])

    handle = trainer.optimizer.register_step_pre_hook(keep)
    try:
        result = trainer.train_step(batch, advantages)
    finally:
        handle.remove()
    return result, grads


@pytest.mark.parametrize("model", MODELS)
def test_shared_prefix_update_has_the_packed_updates_loss_and_gradient(make_trainer, model):
    batch = make_group_batch(seed=2)
    advantages = torch.linspace(-1.0, 1.0, batch.num_sequences)
    # micro_batch_tokens 40: a group is split into several units, rows hold several units.
    packed, packed_grads = step_with_gradients(
        make_trainer(model=model, micro_batch_tokens=40, packing=Packing.PACKED), batch, advantages
    )
    shared, shared_grads = step_with_gradients(
        make_trainer(model=model, micro_batch_tokens=40, packing=Packing.SHARED_PREFIX),
        batch,
        advantages,
    )
    assert not packed.skipped and not shared.skipped
    assert shared.loss == pytest.approx(packed.loss, rel=1e-5, abs=1e-7)
    assert shared.grad_norm == pytest.approx(packed.grad_norm, rel=1e-5)
    assert len(shared_grads) == len(packed_grads) > 0
    for got, want in zip(shared_grads, packed_grads, strict=True):
        assert (got - want).norm() <= 1e-5 * want.norm() + 1e-9
    # The mismatch metrics and the correction see the same tokens and logprobs.
    assert shared.logprobs is not None and packed.logprobs is not None
    torch.testing.assert_close(shared.logprobs, packed.logprobs, atol=1e-5, rtol=0)
    for key in ("train/num_loss_tokens", "mismatch/num_tokens"):
        if key in packed.metrics:
            assert shared.metrics[key] == packed.metrics[key], key


def test_shared_prefix_is_refused_with_an_attention_that_ignores_its_mask(tiny_model_path):
    with pytest.raises(ConfigError, match="attn_implementation"):
        Trainer.Config(
            model=str(tiny_model_path), packing=Packing.SHARED_PREFIX,
            attn_implementation="eager",
        ).validate()  # fmt: skip


def test_gspo_has_the_same_update_shared_or_packed(make_trainer):
    """GSPO's sequence ratio needs each sequence whole in its micro-batch, which the two layouts
    cut differently (a ratio taken over a micro-batch turns this red). The per-token losses
    (DPPO, CISPO) read the same per-token ratios as GRPO's test above. The ratio is taken
    against the sampler (bypass), so that the sequence clip acts."""
    from tir_rl.mismatch import BypassMode, MismatchCorrection
    from tir_rl.trainer.loss import LossName, PolicyLossConfig, build_policy_loss

    trainers = [
        make_trainer(micro_batch_tokens=40, packing=p)
        for p in (Packing.PACKED, Packing.SHARED_PREFIX)
    ]
    batch = make_group_batch(seed=3)
    exact = trainers[0].compute_logprobs(batch)
    gen = torch.Generator().manual_seed(0)
    sampler = exact + 0.3 * torch.randn(exact.shape, generator=gen)  # a sampler that is off
    batch = with_sampler_logprobs(batch, sampler)
    advantages = torch.linspace(-1.0, 1.0, batch.num_sequences)
    bypass = MismatchCorrection(MismatchCorrection.Config(bypass=BypassMode.PPO_CLIP))
    results = []
    for trainer in trainers:
        trainer.loss_fn = build_policy_loss(PolicyLossConfig(name=LossName.GSPO))
        trainer.correction = bypass
        results.append(step_with_gradients(trainer, batch, advantages))
    (packed, packed_grads), (shared, shared_grads) = results
    assert packed.loss == pytest.approx(shared.loss, rel=1e-5, abs=1e-7)
    for got, want in zip(shared_grads, packed_grads, strict=True):
        assert (got - want).norm() <= 1e-5 * want.norm() + 1e-9
    held = packed.metrics["train/clip_fraction_low"] + packed.metrics["train/clip_fraction_high"]
    assert held > 0  # the sequence clip acted on this batch
