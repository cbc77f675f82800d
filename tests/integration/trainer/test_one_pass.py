"""One forward per update (ℓ^old = ℓ^θ detached) gives the two-pass step's update and metrics."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_batch, with_sampler_logprobs

from tir_rl.mismatch import MismatchCorrection
from tir_rl.trainer import Trainer
from tir_rl.trainer.loss import Aggregation, GRPOLoss, LossTerms

CASES = [
    ("token_mean", Aggregation.TOKEN_MEAN, "none"),
    ("sequence_mean", Aggregation.SEQUENCE_MEAN, "none"),
    ("geo_rs", Aggregation.TOKEN_MEAN, "geo_rs"),
    ("seq_mis", Aggregation.SEQUENCE_MEAN, "seq_mis"),
]


def build(tiny_model_path, device, aggregation, preset) -> Trainer:
    # ℓ^old differs from ℓ^θ by fp32 rounding in the two-pass step (its recompute runs lm_head
    # on more columns). AdamW's first step is ±lr per element with a small eps, which turns
    # the rounding of a near-0 gradient element into an O(lr) move; with eps = 1 the update
    # is about lr·g, linear in the gradient, so the parameters compare the gradients.
    config = Trainer.Config(
        model=str(tiny_model_path), lr=1.0, eps=1.0, micro_batch_tokens=24, max_grad_norm=0.0
    )
    config.device = device
    return Trainer(
        config,
        loss_fn=GRPOLoss(terms=LossTerms(aggregation=aggregation)),
        correction_config=MismatchCorrection.Config.preset(preset),
    )


@pytest.mark.parametrize(("name", "aggregation", "preset"), CASES, ids=[c[0] for c in CASES])
def test_one_pass_step_equals_the_two_pass_step(tiny_model_path, device, name, aggregation, preset):
    one = build(tiny_model_path, device, aggregation, preset)
    two = build(tiny_model_path, device, aggregation, preset)
    batch = make_batch()
    # A sampler that differs per sequence: geo_rs / seq_mis reject some sequences, not all.
    exact = two.compute_logprobs(batch)
    shift = torch.tensor([0.0, 2e-4, 3e-3, 1.0])[:, None]
    batch = with_sampler_logprobs(batch, exact + shift)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    two_pass = two.train_step(batch, adv, old_logprobs=two.compute_logprobs(batch))
    one_pass = one.train_step(batch, adv)

    assert not one_pass.skipped and not two_pass.skipped
    if preset != "none":
        assert 0 < one_pass.metrics["train/num_masked_by_correction"] < batch.loss_mask.sum()
    assert one_pass.logprobs is not None
    # The one-pass step computes the model tokens' logprobs only (lm_head skips the others).
    model = batch.loss_mask  # [B, T] bool
    torch.testing.assert_close(
        one_pass.logprobs[model], two_pass.logprobs[model], atol=1e-5, rtol=0
    )
    assert (one_pass.logprobs[~model] == 0).all()
    assert one_pass.loss == pytest.approx(two_pass.loss, rel=1e-5, abs=1e-7)
    assert one_pass.grad_norm == pytest.approx(two_pass.grad_norm, rel=1e-5)
    timing = ("_s", "tokens_per_s")
    keys = {k for k in two_pass.metrics if not k.endswith(timing)}
    assert keys == {k for k in one_pass.metrics if not k.endswith(timing)}
    for key in sorted(keys):
        assert one_pass.metrics[key] == pytest.approx(two_pass.metrics[key], rel=1e-4, abs=1e-6), (
            key
        )
    for (n, p1), p2 in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-7, msg=n)
