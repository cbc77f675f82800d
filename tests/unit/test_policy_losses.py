"""DPPO, GSPO and CISPO against their papers' formulas on hand-worked values, and `loss.name`."""

from __future__ import annotations

import math

import pytest
import torch

from tir_rl.config import load
from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig
from tir_rl.trainer.loss import (
    Aggregation,
    CISPOLoss,
    DPPOBinaryKLLoss,
    DPPOBinaryTVLoss,
    GRPOLoss,
    GSPOLoss,
    LossName,
    LossTerms,
    PolicyLossConfig,
    build_policy_loss,
)

NAN, INF = float("nan"), float("inf")


def loss_and_grad(loss_fn, logprobs, **kwargs):
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = loss_fn(lp, **kwargs)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def logs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


# ------------------------------------------------------------------------------ DPPO


def test_dppo_tv_masks_tokens_that_left_the_region_in_the_advantages_direction():
    old = logs(0.5, 0.5, 0.1, 0.9)  # q
    new = logs(0.7, 0.6, 0.05, 0.6)  # p: p − q = 0.2, 0.1, −0.05, −0.3
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, grad, metrics = loss_and_grad(
        DPPOBinaryTVLoss(), new, old_logprobs=old, advantages=adv, loss_mask=torch.ones(1, 4)
    )
    # Kept: token 1 (risen 0.1 <= 0.15) and token 2 (fallen 0.05 <= 0.15); L = −A·r·ℓ.
    expected = (-1.0 * 1.2 * math.log(0.6) + 1.0 * 0.5 * math.log(0.05)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert grad.tolist()[0] == pytest.approx([0.0, -1.2 / 4, 0.5 / 4, 0.0], rel=1e-6)
    assert metrics.clip_fraction_high == 0.25 and metrics.clip_fraction_low == 0.25


def test_dppo_tv_keeps_a_token_that_moved_against_its_advantage():
    old, new = logs(0.5, 0.5), logs(0.1, 0.9)  # fell 0.4 with A > 0, rose 0.4 with A < 0
    adv = torch.tensor([[1.0, -1.0]])
    _, grad, metrics = loss_and_grad(
        DPPOBinaryTVLoss(), new, old_logprobs=old, advantages=adv, loss_mask=torch.ones(1, 2)
    )
    assert grad.tolist()[0] == pytest.approx([-0.2 / 2, 1.8 / 2], rel=1e-6)
    assert metrics.clip_fraction_high == metrics.clip_fraction_low == 0


def binary_kl(q: float, p: float) -> float:
    return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))


def test_dppo_kl_masks_by_the_binary_kl_and_the_direction():
    q = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    p = [0.7, 0.55, 0.3, 0.45, 0.3, 0.7]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]])
    kls = [binary_kl(a, b) for a, b in zip(q, p, strict=True)]
    assert [k > 0.05 for k in kls] == [True, False, True, False, True, True]
    # Masked: 0 (rose too far, A > 0) and 2 (fell too far, A < 0). Tokens 4 and 5 moved as far
    # but against their advantage, so the update brings them back: kept.
    loss, grad, metrics = loss_and_grad(
        DPPOBinaryKLLoss(), logs(*p), old_logprobs=logs(*q), advantages=adv,
        loss_mask=torch.ones(1, 6),
    )  # fmt: skip
    r = [b / a for a, b in zip(q, p, strict=True)]
    keep = [0, 1, 0, 1, 1, 1]
    a = adv[0].tolist()
    want = [-a[i] * r[i] * keep[i] / 6 for i in range(6)]
    assert grad.tolist()[0] == pytest.approx(want, rel=1e-5)
    expected = sum(-a[i] * r[i] * keep[i] * math.log(p[i]) for i in range(6)) / 6
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics.clip_fraction_high == metrics.clip_fraction_low == pytest.approx(1 / 6)


def test_dppo_ratio_cap_truncates_the_weight_not_the_mask():
    old, new = logs(0.01), logs(0.1)  # r = 10, p − q = 0.09 inside the region
    kwargs = {"old_logprobs": old, "advantages": torch.tensor([1.0]), "loss_mask": torch.ones(1, 1)}
    _, free, _ = loss_and_grad(DPPOBinaryTVLoss(), new, **kwargs)
    capped = DPPOBinaryTVLoss(DPPOBinaryTVLoss.Config(ratio_cap=4.0))
    _, grad, _ = loss_and_grad(capped, new, **kwargs)
    assert free.item() == pytest.approx(-10.0, rel=1e-5) and grad.item() == pytest.approx(-4.0)


# ------------------------------------------------------------------------------ GSPO


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.4]]))
    new = torch.log(torch.tensor([[0.6, 0.5], [0.5, 0.4]]))  # s = √1.2 (clipped), 1 (inside)
    adv = torch.tensor([1.0, -2.0])
    loss, grad, metrics = loss_and_grad(
        GSPOLoss(), new, old_logprobs=old, advantages=adv, loss_mask=torch.ones(2, 2)
    )
    # Sequence mean of token means: seq 0 holds −A·(1 + 4e-4) per token, seq 1 −A·1.
    assert loss.item() == pytest.approx((-(1 + 4e-4) + 2.0) / 2, rel=1e-6)
    # Seq 0 is clipped (no gradient); seq 1: −A·s/|y| / num_sequences on each token.
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.5, 0.5], rel=1e-6)
    assert metrics.clip_fraction_high == 0.5 and metrics.clip_fraction_low == 0


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_score():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = old + torch.tensor([[1e-5, -3e-5, 1e-5]])  # s inside the band
    s = math.exp((1e-5 - 3e-5 + 1e-5) / 3)
    adv = torch.tensor([0.7])
    _, grad, _ = loss_and_grad(
        GSPOLoss(), new, old_logprobs=old, advantages=adv, loss_mask=torch.ones(1, 3)
    )
    assert grad.tolist()[0] == pytest.approx([-0.7 * s / 3] * 3, rel=1e-6)


def test_gspo_uses_the_tokens_in_the_loss_for_the_length():
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.0, 0.0, 1.4e-3, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 4th token was rejected
    _, _, metrics = loss_and_grad(
        GSPOLoss(), new, old_logprobs=old, advantages=torch.tensor([1.0]), loss_mask=mask
    )
    # s = exp(1.4e-3 / 3) ≈ 1 + 4.7e-4: clipped (1 + 4e-4); over 4 tokens it would not be.
    assert metrics.clip_fraction_high == 1


# ------------------------------------------------------------------------------ CISPO


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient():
    old = logs(0.2, 0.4, 0.5)
    new = logs(0.3, 0.2, 0.5)  # r = 1.5, 0.5, 1
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, grad, metrics = loss_and_grad(
        CISPOLoss(), new, old_logprobs=old, advantages=adv, loss_mask=torch.ones(1, 3)
    )
    expected = (-1.2 * math.log(0.3) - 0.5 * math.log(0.2) + math.log(0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert grad.tolist()[0] == pytest.approx([-1.2 / 3, -0.5 / 3, 1 / 3], rel=1e-6)
    assert metrics.clip_fraction_high == pytest.approx(1 / 3) and metrics.clip_fraction_low == 0
    lower = CISPOLoss(CISPOLoss.Config(clip_low=0.2))
    _, grad, metrics = loss_and_grad(
        lower, new, old_logprobs=old, advantages=adv, loss_mask=torch.ones(1, 3)
    )
    assert grad.tolist()[0] == pytest.approx([-1.2 / 3, -0.8 / 3, 1 / 3], rel=1e-6)
    assert metrics.clip_fraction_low == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------ every loss

EVERY_LOSS = [GRPOLoss, DPPOBinaryTVLoss, DPPOBinaryKLLoss, GSPOLoss, CISPOLoss]


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1]]).float()
    old = -torch.rand(3, 6, generator=gen) * 2 - 0.05
    new = old + 0.05 * torch.randn(3, 6, generator=gen)
    return new, old, torch.tensor([1.0, -0.5, 0.8]), mask


@pytest.mark.parametrize("loss_cls", EVERY_LOSS)
def test_masked_garbage_changes_neither_loss_nor_gradient(loss_cls):
    new, old, adv, mask = batch()
    dirty_new, dirty_old = new.clone(), old.clone()
    dirty_new[mask == 0] = torch.tensor([NAN, INF, -INF, 5.0, NAN])
    dirty_old[mask == 0] = NAN
    clean = loss_and_grad(loss_cls(), new, old_logprobs=old, advantages=adv, loss_mask=mask)
    dirty = loss_and_grad(
        loss_cls(), dirty_new, old_logprobs=dirty_old, advantages=adv, loss_mask=mask
    )
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1][mask > 0], dirty[1][mask > 0])


@pytest.mark.parametrize("loss_cls", EVERY_LOSS)
def test_correction_weights_scale_each_tokens_gradient(loss_cls):
    new, old, adv, mask = batch(1)
    weights = torch.rand(3, 6, generator=torch.Generator().manual_seed(2)) + 0.5
    common = {"old_logprobs": old, "advantages": adv, "loss_mask": mask}
    _, plain, _ = loss_and_grad(loss_cls(), new, **common)
    _, weighted, _ = loss_and_grad(loss_cls(), new, weights=weights, **common)
    assert torch.allclose(weighted, weights * plain, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("loss_cls", EVERY_LOSS)
def test_at_ratio_one_every_loss_is_the_policy_gradient(loss_cls):
    """One optimizer step on the recompute (r = 1): no loss clips or masks anything."""
    _, old, adv, mask = batch(3)
    terms = LossTerms(aggregation=Aggregation.TOKEN_MEAN)
    _, grad, metrics = loss_and_grad(
        loss_cls(terms=terms), old, old_logprobs=old, advantages=adv, loss_mask=mask
    )
    expected = -adv.unsqueeze(1) * mask / mask.sum()
    assert torch.allclose(grad, expected, rtol=1e-6, atol=1e-9)
    assert metrics.clip_fraction_low == metrics.clip_fraction_high == 0


@pytest.mark.parametrize("loss_cls", EVERY_LOSS)
def test_kl_term_needs_a_reference(loss_cls):
    new, old, adv, mask = batch()
    loss_fn = loss_cls(terms=LossTerms(kl_coef=0.1))
    assert loss_fn.needs_reference and not loss_cls().needs_reference
    with pytest.raises(ConfigError, match="ref_logprobs"):
        loss_fn(new, old_logprobs=old, advantages=adv, loss_mask=mask)


# ------------------------------------------------------------------------------ loss.name


def config(*overrides: str) -> RunConfig:
    return load(RunConfig, None, ["model=tiny", *overrides])


@pytest.mark.parametrize(
    ("name", "cls"),
    [("grpo", GRPOLoss), ("dppo_tv", DPPOBinaryTVLoss), ("dppo_kl", DPPOBinaryKLLoss),
     ("gspo", GSPOLoss), ("cispo", CISPOLoss)],
)  # fmt: skip
def test_loss_name_builds_its_loss_with_its_own_settings(name, cls):
    loss = build_policy_loss(config(f"loss.name={name}").loss)
    assert type(loss) is cls
    assert loss.config == getattr(PolicyLossConfig(), name)


def test_gspo_defaults_to_its_papers_aggregation_and_honours_another():
    assert build_policy_loss(config("loss.name=gspo").loss).terms.aggregation == (
        Aggregation.SEQUENCE_MEAN
    )
    given = config("loss.name=gspo", "loss.aggregation=token_mean").loss
    assert build_policy_loss(given).terms.aggregation == Aggregation.TOKEN_MEAN
    assert config().loss.terms.aggregation == Aggregation.TOKEN_MEAN


def test_an_unknown_loss_name_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="dppo_tv"):
        config("loss.name=dppo")


def test_a_setting_of_another_loss_is_refused():
    with pytest.raises(ConfigError, match=r"loss\.gspo\.clip_low.*'grpo'"):
        config("loss.gspo.clip_low=0.001")
    with pytest.raises(ConfigError, match=r"loss\.grpo\.clip_high"):
        config("loss.name=dppo_kl", "loss.grpo.clip_high=0.3")
    assert config("loss.name=cispo", "loss.cispo.clip_high=0.3").loss.cispo.clip_high == 0.3


def test_the_old_top_level_clip_keys_load_where_they_went(caplog):
    assert config("loss.clip_high=0.3").loss.grpo.clip_high == 0.3
    assert "loss.clip_high is now loss.grpo.clip_high" in caplog.text
    with pytest.raises(ConfigError, match=r"loss\.clip_high=0\.3 and loss\.grpo\.clip_high=0\.4"):
        config("loss.clip_high=0.3", "loss.grpo.clip_high=0.4")
    with pytest.raises(ConfigError, match=r"loss\.grpo\.clip_low"):
        config("loss.name=gspo", "loss.clip_low=0.1")  # moved, then refused as GRPO's


def test_bad_values_are_refused_at_load():
    with pytest.raises(ConfigError, match="delta_low"):
        config("loss.name=dppo_tv", "loss.dppo_tv.delta_low=0")
    with pytest.raises(ConfigError, match="clip_high"):
        config("loss.name=cispo", "loss.cispo.clip_high=-1")
    with pytest.raises(ConfigError, match="kl_coef"):
        config("loss.kl_coef=-1")


def test_every_loss_name_is_built():
    assert {type(build_policy_loss(PolicyLossConfig(name=n))) for n in LossName} == set(EVERY_LOSS)
