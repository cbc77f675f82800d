import math

import pytest
import torch

from tir_rl.errors import ConfigError
from tir_rl.trainer.loss import Aggregation, GRPOLoss, LossTerms, group_advantages


def make_batch(*, seed: int = 0):
    """Three sequences with tool tokens (mask 0) in the middle and padding at the end."""
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.tensor(
        [
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 1, 1],
        ],
        dtype=torch.float32,
    )
    old = -torch.rand(3, 10, generator=gen) * 3
    logprobs = old + 0.3 * torch.randn(3, 10, generator=gen)
    advantages = torch.tensor([1.0, -0.5, 0.7])
    return logprobs, old, advantages, loss_mask


def loss_and_grad(loss_fn, logprobs, **kwargs):
    lp = logprobs.clone().requires_grad_(True)
    out = loss_fn(lp, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), lp.grad


def test_group_advantages_subtract_group_mean_and_divide_by_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 3])
    plain = group_advantages(rewards, groups, normalize_std=False)
    assert torch.allclose(plain.advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 0.0, 1.0]))
    scaled = group_advantages(rewards, groups, normalize_std=True, eps=0.0)
    std_a = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert scaled.advantages[0].item() == pytest.approx((2 / 3) / std_a, rel=1e-6)
    assert scaled.advantages[5].item() == pytest.approx(1.0, rel=1e-6)
    assert scaled.num_groups == 2 and scaled.num_degenerate_groups == 0


def test_degenerate_groups_get_exactly_zero_advantage_and_are_counted():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    for normalize_std in (False, True):
        result = group_advantages(rewards, groups, normalize_std=normalize_std)
        assert torch.equal(result.advantages[:3], torch.zeros(3))
        assert result.advantages[5].item() == 0.0  # a group of one is degenerate too
        assert result.advantages[3] < 0 < result.advantages[4]
        assert result.num_degenerate_groups == 2
        assert result.degenerate.tolist() == [True, True, True, False, False, True]


def test_token_mean_loss_matches_the_formula_written_out():
    logprobs, old, adv, mask = make_batch()
    loss, metrics = GRPOLoss()(logprobs, old_logprobs=old, advantages=adv, loss_mask=mask)
    expected, n = 0.0, 0
    for b in range(3):
        for t in range(10):
            if mask[b, t]:
                r = math.exp(logprobs[b, t].item() - old[b, t].item())
                a = adv[b].item()
                expected += max(-a * r, -a * min(max(r, 0.8), 1.28))
                n += 1
    assert loss.item() == pytest.approx(expected / n, rel=1e-5)
    assert metrics.num_tokens == n


def test_sequence_mean_averages_each_sequence_then_over_sequences():
    logprobs, old, adv, mask = make_batch()
    cfg = LossTerms(aggregation=Aggregation.SEQUENCE_MEAN)
    loss, _ = GRPOLoss(terms=cfg)(logprobs, old_logprobs=old, advantages=adv, loss_mask=mask)
    token_loss = GRPOLoss()
    per_seq = [
        token_loss(
            logprobs[b : b + 1],
            old_logprobs=old[b : b + 1],
            advantages=adv[b : b + 1],
            loss_mask=mask[b : b + 1],
        )[0]
        for b in range(3)
    ]
    assert loss.item() == pytest.approx(sum(x.item() for x in per_seq) / 3, rel=1e-6)


def test_asymmetric_clip_stops_gradient_only_outside_its_own_bound():
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[1.25, 1.3, 0.85, 0.75]])
    mask = torch.ones(1, 4)
    cfg = GRPOLoss.Config(clip_low=0.2, clip_high=0.28)
    # A > 0: r = 1.25 is inside the upper bound 1.28 (gradient), 1.3 is clipped (none).
    _, grad = loss_and_grad(
        GRPOLoss(cfg),
        ratios.log(),
        old_logprobs=old,
        advantages=torch.tensor([1.0]),
        loss_mask=mask,
    )
    assert grad[0, 0] != 0 and grad[0, 1] == 0 and grad[0, 2] != 0 and grad[0, 3] != 0
    # A < 0: r = 0.85 is above the lower bound 0.8 (gradient), 0.75 is clipped (none).
    loss_fn = GRPOLoss(cfg)
    _, grad = loss_and_grad(
        loss_fn, ratios.log(), old_logprobs=old, advantages=torch.tensor([-1.0]), loss_mask=mask
    )
    assert grad[0, 0] != 0 and grad[0, 1] != 0 and grad[0, 2] != 0 and grad[0, 3] == 0
    _, m = loss_fn(ratios.log(), old_logprobs=old, advantages=torch.tensor([-1.0]), loss_mask=mask)
    assert m.clip_fraction_low == 0.25 and m.clip_fraction_high == 0.0
    _, m = loss_fn(ratios.log(), old_logprobs=old, advantages=torch.tensor([1.0]), loss_mask=mask)
    assert m.clip_fraction_high == 0.25 and m.clip_fraction_low == 0.0
    assert m.ratio_max == pytest.approx(1.3) and m.ratio_min == pytest.approx(0.75)


@pytest.mark.parametrize("aggregation", list(Aggregation))
def test_two_micro_batches_with_global_normalizer_equal_one_batch(aggregation):
    logprobs, old, adv, mask = make_batch(seed=3)
    loss_fn = GRPOLoss(terms=LossTerms(aggregation=aggregation))
    full_loss, full_grad = loss_and_grad(
        loss_fn, logprobs, old_logprobs=old, advantages=adv, loss_mask=mask
    )
    counts = {"num_global_tokens": int(mask.sum()), "num_global_sequences": 3}
    total, grads = 0.0, []
    for rows in (slice(0, 1), slice(1, 3)):
        loss, grad = loss_and_grad(
            loss_fn,
            logprobs[rows],
            old_logprobs=old[rows],
            advantages=adv[rows],
            loss_mask=mask[rows],
            **counts,
        )
        total += loss.item()
        grads.append(grad)
    assert total == pytest.approx(full_loss.item(), rel=1e-6)
    assert torch.allclose(torch.cat(grads), full_grad, atol=1e-7)


def test_garbage_at_masked_positions_changes_neither_loss_nor_gradient():
    logprobs, old, adv, mask = make_batch()
    dirty_lp, dirty_old = logprobs.clone(), old.clone()
    holes = mask == 0
    dirty_lp[holes] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(9)[
        : int(holes.sum())
    ]
    dirty_old[holes] = float("nan")
    clean = loss_and_grad(GRPOLoss(), logprobs, old_logprobs=old, advantages=adv, loss_mask=mask)
    dirty = loss_and_grad(
        GRPOLoss(), dirty_lp, old_logprobs=dirty_old, advantages=adv, loss_mask=mask
    )
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(clean[1], dirty[1])
    assert torch.all(dirty[1][holes] == 0)


def test_kl_to_reference_is_k3_added_unweighted():
    logprobs, old, adv, mask = make_batch()
    ref = old - 0.2
    weights = torch.full_like(mask, 0.5)
    base = GRPOLoss()
    with_kl = GRPOLoss(terms=LossTerms(kl_coef=0.1))
    kwargs = {"old_logprobs": old, "advantages": adv, "loss_mask": mask}
    loss_w, _ = base(logprobs, weights=weights, **kwargs)
    loss_kl, metrics = with_kl(logprobs, weights=weights, ref_logprobs=ref, **kwargs)
    x = (ref - logprobs)[mask > 0]
    k3 = (x.exp() - x - 1).mean()
    assert loss_kl.item() == pytest.approx(loss_w.item() + 0.1 * k3.item(), rel=1e-5)
    assert metrics.ref_kl == pytest.approx(k3.item(), rel=1e-5)
    with pytest.raises(ConfigError, match="ref_logprobs"):
        with_kl(logprobs, **kwargs)
    assert with_kl.needs_reference and not base.needs_reference  # the trainer loads one or not


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[math.log(10.0), math.log(2.0)]])
    loss_fn = GRPOLoss(GRPOLoss.Config(dual_clip=3.0))
    loss, grad = loss_and_grad(
        loss_fn, lp, old_logprobs=old, advantages=torch.tensor([-1.0]), loss_mask=torch.ones(1, 2)
    )
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2, rel=1e-6)
    assert grad[0, 0] == 0 and grad[0, 1] != 0


def test_invalid_loss_config_raises_config_error():
    with pytest.raises(ConfigError, match="clip_low"):
        GRPOLoss(GRPOLoss.Config(clip_low=1.5))
    with pytest.raises(ConfigError, match="dual_clip"):
        GRPOLoss(GRPOLoss.Config(dual_clip=0.5))
