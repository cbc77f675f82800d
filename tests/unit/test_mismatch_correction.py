import math

import pytest
import torch

from tir_rl.errors import ConfigError
from tir_rl.mismatch import (
    PRESET_NAMES,
    BypassMode,
    ISLevel,
    MismatchCorrection,
    correction,
    mismatch_metrics,
)
from tir_rl.trainer.loss import Aggregation, GRPOLoss, LossTerms

Config = MismatchCorrection.Config
NAN, INF = float("nan"), float("inf")


def make_batch(*, seed: int = 0, noise: float = 0.05):
    """Four multi-turn sequences; tool and pad positions (mask 0) hold garbage."""
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.tensor(
        [
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1],
            [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1, 0],
            [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.float32,
    )
    turn_ids = torch.tensor(
        [
            [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2],
            [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
        ]
    )
    old = -torch.rand(4, 12, generator=gen) * 3
    sampler = old + noise * torch.randn(4, 12, generator=gen)
    logprobs = old + 0.1 * torch.randn(4, 12, generator=gen)
    junk = torch.tensor([NAN, INF, -INF, 0.0]).repeat(12)
    holes = loss_mask == 0
    sampler[holes] = junk[: int(holes.sum())]
    old[holes] = junk[1 : int(holes.sum()) + 1]
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    return logprobs, old, sampler, advantages, loss_mask, turn_ids


def loss_and_grad(loss_fn, logprobs, **kwargs):
    lp = logprobs.clone().requires_grad_(True)
    out = loss_fn(lp, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), lp.grad


def all_modes():
    modes = [(name, Config.preset(name)) for name in PRESET_NAMES]
    modes += [
        ("token_tis_norm", Config.preset("token_tis", batch_normalize=True)),
        ("turn_tis_norm", Config.preset("turn_tis", batch_normalize=True)),
        ("seq_mis_norm", Config.preset("seq_mis", batch_normalize=True, is_cap_low=0.5)),
        ("vetoes", Config(veto_threshold=1e-4, seq_max_k2=0.5, seq_mean_k3=0.01)),
        (
            "everything",
            Config(
                is_level=ISLevel.TURN,
                token_mask=(0.5, 2),
                turn_mask=(0.5, 2),
                seq_mask=(0.5, 2),
                geo_mask=(0.999, 1.001),
                veto_threshold=1e-4,
            ),
        ),
    ]
    return modes


@pytest.mark.parametrize(("name", "config"), all_modes(), ids=[n for n, _ in all_modes()])
@pytest.mark.parametrize("aggregation", list(Aggregation))
def test_identity_gives_plain_grpo_bitwise(name, config, aggregation):
    logprobs, old, _, adv, mask, turns = make_batch()
    sampler = old.clone()  # ℓ^μ = ℓ^old bit for bit (garbage included)
    result = correction(old, sampler, mask, turns, config)
    assert torch.equal(result.loss_mask, mask)
    assert torch.equal(result.weights, mask)  # w = 1 exactly on model tokens
    assert result.stats.masked_token_fraction == 0 and result.stats.weight_std == 0
    loss_fn = GRPOLoss(terms=LossTerms(aggregation=aggregation))
    common = {"old_logprobs": old, "advantages": adv}
    plain = loss_and_grad(loss_fn, logprobs, loss_mask=mask, **common)
    corrected = loss_and_grad(
        loss_fn, logprobs, loss_mask=result.loss_mask, weights=result.weights, **common
    )
    assert torch.equal(plain[0], corrected[0])
    assert torch.equal(plain[1], corrected[1])


def test_identity_in_bypass_mode_gives_plain_loss_bitwise():
    logprobs, _, _, adv, mask, turns = make_batch()
    config = Config.preset("geo_rs_token_tis", bypass=BypassMode.PPO_CLIP, veto_threshold=1e-4)
    lp = logprobs.clone().requires_grad_(True)
    result = correction(lp, logprobs.clone(), mask, turns, config)  # ℓ^μ = ℓ^θ
    assert torch.equal(result.weights, mask) and torch.equal(result.loss_mask, mask)
    loss_fn, common = GRPOLoss(), {"old_logprobs": logprobs, "advantages": adv}
    plain = loss_and_grad(loss_fn, logprobs, loss_mask=mask, **common)
    corrected = loss_and_grad(
        loss_fn, logprobs, loss_mask=result.loss_mask, weights=result.weights, **common
    )
    assert torch.equal(plain[0], corrected[0]) and torch.equal(plain[1], corrected[1])


def test_identity_metrics_are_exactly_neutral():
    _, old, _, _, mask, turns = make_batch()
    got = mismatch_metrics(old, old.clone(), mask, turns)
    assert got["mismatch/kl"] == got["mismatch/k3_kl"] == got["mismatch/chi2_token"] == 0
    assert got["mismatch/chi2_seq"] == 0
    assert got["mismatch/ppl_ratio"] == got["mismatch/is_token_ess"] == 1
    assert got["mismatch/is_seq_ess"] == 1


def test_weights_are_detached_and_scale_each_token_gradient():
    logprobs, old, sampler, adv, mask, turns = make_batch(noise=0.5)
    trainer = old.clone().requires_grad_(True)  # even a grad-carrying input gives no-grad w
    result = correction(trainer, sampler, mask, turns, Config.preset("token_tis"))
    assert not result.weights.requires_grad
    assert (result.weights[mask > 0] != 1).any()
    common = {"old_logprobs": old, "advantages": adv, "loss_mask": mask}
    _, grad_plain = loss_and_grad(GRPOLoss(), logprobs, **common)
    _, grad_w = loss_and_grad(GRPOLoss(), logprobs, weights=result.weights, **common)
    assert torch.allclose(grad_w, result.weights * grad_plain, rtol=1e-6, atol=1e-9)
    # Decoupled: the weights come from ℓ^old and ℓ^μ only; moving ℓ^θ changes nothing.
    again = correction(old, sampler, mask, turns, Config.preset("token_tis"))
    assert torch.equal(again.weights, result.weights)


def test_token_tis_truncates_at_the_cap_with_optional_lower_cap():
    rho = torch.tensor([[0.1, 0.5, 1.0, 1.5, 2.0, 3.0, 100.0]])
    sampler = torch.full_like(rho, -3.0)
    trainer = sampler + rho.log()
    mask, turns = torch.ones_like(rho), torch.zeros_like(rho).long()
    ratio = torch.exp(trainer - sampler)
    w = correction(trainer, sampler, mask, turns, Config.preset("token_tis")).weights
    assert torch.equal(w, ratio.clamp(max=2.0))
    assert torch.all(w[rho > 2.0] == 2.0) and w.min() == ratio.min()  # no lower cap (verl)
    w_low = correction(
        trainer, sampler, mask, turns, Config.preset("token_tis", is_cap_low=0.5)
    ).weights
    assert w_low.min() == 0.5 and torch.equal(w_low[:, 2:], w[:, 2:])


def test_token_mask_rejects_only_out_of_range_tokens():
    logprobs, old, sampler, adv, mask, turns = make_batch()
    sampler[0, 1] = old[0, 1] - 3.0  # ρ = e^3 > 5
    sampler[3, 7] = old[3, 7] + 1.0  # ρ = e^-1 < 0.5
    result = correction(old, sampler, mask, turns, Config.preset("icepop"))
    expected = mask.clone()
    expected[0, 1] = expected[3, 7] = 0
    assert torch.equal(result.loss_mask, expected)
    assert result.stats.masked_token_fraction == pytest.approx(2 / mask.sum().item())
    assert result.stats.masked_seq_fraction == pytest.approx(2 / 4)


def test_one_bad_token_makes_seq_mask_remove_its_whole_sequence_only():
    _, old, sampler, _, mask, turns = make_batch()
    sampler[2, 5] = old[2, 5] - 5.0  # δ = +5
    result = correction(old, sampler, mask, turns, Config.preset("seq_mis"))
    expected = mask.clone()
    expected[2] = 0
    assert torch.equal(result.loss_mask, expected)
    assert result.stats.masked_seq_fraction == 0.25
    assert torch.equal(result.weights[2], torch.zeros(12))


def test_seq_mask_bounds_are_inclusive():
    sampler = torch.full((4, 1), -2.0)
    deltas = torch.tensor([[0.1], [0.1001], [-0.2], [-0.2001]])
    trainer = sampler + deltas
    delta = trainer - sampler
    lo, hi = torch.exp(delta[2]).item(), torch.exp(delta[0]).item()
    mask, turns = torch.ones(4, 1), torch.zeros(4, 1).long()
    result = correction(trainer, sampler, mask, turns, Config(seq_mask=(lo, hi)))
    assert result.loss_mask.flatten().tolist() == [1.0, 0.0, 1.0, 0.0]


def test_turn_mask_rejects_only_the_bad_turn():
    _, old, sampler, _, mask, turns = make_batch()
    sampler[0, 6] = old[0, 6] - 5.0  # turn 1 of sequence 0
    result = correction(old, sampler, mask, turns, Config.preset("turn_mis"))
    expected = mask.clone()
    expected[0, 5:10] = 0
    assert torch.equal(result.loss_mask, expected)
    num_turns = 3 + 1 + 3 + 2
    assert result.stats.masked_turn_fraction == pytest.approx(1 / num_turns)
    assert result.stats.masked_seq_fraction == 0.25


def test_turn_weights_are_the_truncated_product_over_the_turn():
    _, old, sampler, _, mask, turns = make_batch(noise=0.3)
    result = correction(old, sampler, mask, turns, Config.preset("turn_tis"))
    delta = torch.where(mask > 0, old - sampler, torch.zeros_like(old))
    for b, t in ((0, 5), (2, 8), (3, 0)):
        same = (turns[b] == turns[b, t]) & (mask[b] > 0)
        expected = min(math.exp(delta[b][same].sum().item()), 2.0)
        assert result.weights[b][same].tolist() == pytest.approx([expected] * int(same.sum()))


def test_rejections_combine_with_and():
    _, old, sampler, _, mask, turns = make_batch()
    sampler[0, 1] = old[0, 1] + 1.0  # token ρ = e^-1 out of [0.5, 5] ...
    sampler[0, 2] = old[0, 2] - 0.9  # ... while the sequence product stays in [0.5, 2]
    sampler[1, 2] = old[1, 2] - 1.0  # sequence product out of [0.5, 2]
    both = Config(token_mask=(0.5, 5.0), seq_mask=(0.5, 2.0))
    result = correction(old, sampler, mask, turns, both)
    token_only = correction(old, sampler, mask, turns, Config(token_mask=(0.5, 5.0)))
    seq_only = correction(old, sampler, mask, turns, Config(seq_mask=(0.5, 2.0)))
    assert torch.equal(result.loss_mask, token_only.loss_mask * seq_only.loss_mask)
    assert result.loss_mask[0].sum() == mask[0].sum() - 1 and result.loss_mask[1].sum() == 0


def test_geometric_mask_is_length_invariant_while_the_product_is_not():
    for c, geo_keeps in ((0.0009, True), (0.002, False)):
        lengths = (10, 1000)
        sampler = torch.full((2, 1000), -1.0)
        mask = torch.zeros(2, 1000)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        trainer = sampler + c
        turns = torch.zeros(2, 1000).long()
        geo = correction(trainer, sampler, mask, turns, Config.preset("geo_rs"))
        assert geo.loss_mask.any(dim=1).tolist() == [geo_keeps, geo_keeps]
        seq = correction(trainer, sampler, mask, turns, Config(seq_mask=(0.5, 2.0)))
        assert seq.loss_mask.any(dim=1).tolist() == [True, False]


def _delete_masked(*tensors, mask):
    """The same trajectories with every mask-0 token removed (rows left-aligned, 0-padded)."""
    out = []
    for x in tensors:
        rows = [x[b][mask[b] > 0] for b in range(x.shape[0])]
        padded = torch.zeros_like(x)
        for b, row in enumerate(rows):
            padded[b, : row.numel()] = row
            if x.dtype == torch.long and row.numel():
                padded[b, row.numel() :] = row[-1]
        out.append(padded)
    return out


@pytest.mark.parametrize(("name", "config"), all_modes(), ids=[n for n, _ in all_modes()])
def test_garbage_on_masked_tokens_equals_deleting_them(name, config):
    logprobs, old, sampler, adv, mask, turns = make_batch(noise=0.4)
    logprobs[mask == 0] = NAN
    dirty = correction(old, sampler, mask, turns, config)
    c_lp, c_old, c_sampler, c_turns = _delete_masked(logprobs, old, sampler, turns, mask=mask)
    c_mask = _delete_masked(mask, mask=mask)[0]
    clean = correction(c_old, c_sampler, c_mask, c_turns, config)
    # Same values; a sum over a row with interleaved zeros may round in another order.
    assert torch.allclose(dirty.weights[mask > 0], clean.weights[c_mask > 0], rtol=1e-6)
    assert torch.equal(dirty.loss_mask[mask > 0], clean.loss_mask[c_mask > 0])
    for field, value in dirty.stats.to_dict().items():
        assert clean.stats.to_dict()[field] == pytest.approx(value, rel=1e-6, abs=1e-7), field
    loss_fn = GRPOLoss()
    d_loss, d_grad = loss_and_grad(
        loss_fn,
        logprobs,
        old_logprobs=old,
        advantages=adv,
        loss_mask=dirty.loss_mask,
        weights=dirty.weights,
    )
    c_loss, c_grad = loss_and_grad(
        loss_fn,
        c_lp,
        old_logprobs=c_old,
        advantages=adv,
        loss_mask=clean.loss_mask,
        weights=clean.weights,
    )
    assert d_loss.item() == pytest.approx(c_loss.item(), rel=1e-6)
    assert torch.allclose(d_grad[mask > 0], c_grad[c_mask > 0], rtol=1e-6, atol=1e-9)
    assert torch.all(d_grad[mask == 0] == 0)


@pytest.mark.parametrize("aggregation", list(Aggregation))
def test_rejected_and_empty_sequences_leave_the_normalizer(aggregation):
    logprobs, old, sampler, adv, mask, turns = make_batch()
    mask[1] = 0  # an empty sequence (all garbage)
    sampler[2, 5] = old[2, 5] - 5.0  # sequence 2 gets rejected
    result = correction(old, sampler, mask, turns, Config.preset("seq_mis"))
    assert result.loss_mask[2].sum() == 0
    assert result.stats.masked_seq_fraction == pytest.approx(1 / 3)  # the empty one is left out
    assert all(math.isfinite(v) for v in result.stats.to_dict().values())
    loss_fn = GRPOLoss(terms=LossTerms(aggregation=aggregation))
    loss, grad = loss_and_grad(
        loss_fn,
        logprobs,
        old_logprobs=old,
        advantages=adv,
        loss_mask=result.loss_mask,
        weights=result.weights,
    )
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # verl semantics: rejected tokens count in neither numerator nor denominator, so the loss
    # is that of the batch without the rejected and empty sequences.
    kept = [0, 3]
    subset, _ = loss_fn(
        logprobs[kept],
        old_logprobs=old[kept],
        advantages=adv[kept],
        loss_mask=result.loss_mask[kept],
        weights=result.weights[kept],
    )
    assert loss.item() == pytest.approx(subset.item(), rel=1e-6)
    if aggregation is Aggregation.TOKEN_MEAN:
        per_token = loss_and_grad(
            loss_fn,
            logprobs,
            old_logprobs=old,
            advantages=adv,
            loss_mask=result.loss_mask,
            weights=result.weights,
            num_global_tokens=int(result.loss_mask.sum()),
        )[0]
        assert per_token == loss


def test_fully_rejected_batch_gives_zero_loss_not_nan():
    logprobs, old, sampler, adv, mask, turns = make_batch()
    sampler = sampler - 5.0
    result = correction(old, sampler, mask, turns, Config.preset("seq_mis"))
    assert result.loss_mask.sum() == 0 and result.stats.masked_seq_fraction == 1
    loss, grad = loss_and_grad(
        GRPOLoss(),
        logprobs,
        old_logprobs=old,
        advantages=adv,
        loss_mask=result.loss_mask,
        weights=result.weights,
    )
    assert loss.item() == 0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(math.isfinite(v) for v in result.stats.to_dict().values())


def test_overflowing_sums_give_finite_weights_clamped_at_exp_20():
    sampler = torch.full((2, 10), -5.0)
    trainer = sampler.clone()
    trainer[0] += 50.0  # S = +500
    trainer[1] -= 50.0  # S = -500
    mask, turns = torch.ones(2, 10), torch.zeros(2, 10).long()
    for level in (ISLevel.TOKEN, ISLevel.TURN, ISLevel.SEQUENCE):
        w = correction(trainer, sampler, mask, turns, Config(is_level=level, is_cap=1e30)).weights
        assert torch.isfinite(w).all()
        assert w[0, 0].item() == pytest.approx(math.exp(20), rel=1e-5)
        assert w[1, 0].item() == pytest.approx(math.exp(-20), rel=1e-5)


def test_bypass_ppo_clip_is_vanilla_ppo_against_the_sampler_without_weights():
    logprobs, _, sampler, adv, mask, turns = make_batch(noise=0.3)
    config = Config.preset("token_mis", bypass=BypassMode.PPO_CLIP)
    result = correction(logprobs, sampler, mask, turns, config)
    assert torch.equal(result.weights, result.loss_mask)  # RS applies, no extra w
    assert result.loss_mask.sum() < mask.sum() or torch.equal(result.loss_mask, mask)
    common = {"old_logprobs": sampler, "advantages": adv, "loss_mask": result.loss_mask}
    vanilla = loss_and_grad(GRPOLoss(), logprobs, **common)
    bypass = loss_and_grad(GRPOLoss(), logprobs, weights=result.weights, **common)
    assert torch.equal(vanilla[0], bypass[0]) and torch.equal(vanilla[1], bypass[1])


@pytest.mark.parametrize("kind", ["ratio", "k2"])
def test_a_single_catastrophic_token_vetoes_its_sequence(kind):
    _, old, sampler, _, mask, turns = make_batch()
    sampler[3, 8] = old[3, 8] + 12.0  # ρ = e^-12 < 1e-4, ½δ² = 72
    config = Config(veto_threshold=1e-4) if kind == "ratio" else Config(seq_max_k2=2.0)
    result = correction(old, sampler, mask, turns, config)
    expected = mask.clone()
    expected[3] = 0
    assert torch.equal(result.loss_mask, expected)
    assert result.stats.masked_seq_fraction == 1 / 4
    assert result.stats.veto_fraction == (1 / 4 if kind == "ratio" else 0)


@pytest.mark.parametrize("name", ["token_tis", "turn_tis", "seq_tis"])
def test_batch_normalization_makes_the_mean_valid_weight_one(name):
    _, old, sampler, _, mask, turns = make_batch(noise=0.5)
    result = correction(old, sampler, mask, turns, Config.preset(name, batch_normalize=True))
    w, keep = result.weights, result.loss_mask > 0
    if name == "token_tis":
        unit_weights = w[keep]
    elif name == "seq_tis":
        unit_weights = torch.stack([w[b][keep[b]][0] for b in range(4)])
    else:
        unit_weights = torch.tensor(
            [
                w[b][keep[b] & (turns[b] == k)][0]
                for b in range(4)
                for k in range(3)
                if (keep[b] & (turns[b] == k)).any()
            ]
        )
    assert unit_weights.mean().item() == pytest.approx(1.0, abs=1e-6)
    assert unit_weights.std() > 0


def test_sign_trainer_above_sampler_gives_ratio_above_one():
    sampler = torch.full((1, 3), -2.0)
    result = correction(
        sampler + 0.1,
        sampler,
        torch.ones(1, 3),
        torch.zeros(1, 3).long(),
        Config(is_level=ISLevel.TOKEN, is_cap=10.0),
    )
    assert torch.all(result.weights > 1)


def test_presets_and_config_errors():
    assert Config.preset("icepop") == Config.preset("token_mis")
    assert Config.preset("none") == Config()
    assert Config.preset("token_tis", is_cap=3.0).is_cap == 3.0
    assert Config.preset("geo_rs_token_tis").rejects and not Config().rejects
    with pytest.raises(ConfigError, match="geo_rs_token_tis"):
        Config.preset("geo_rs_tis")
    with pytest.raises(ConfigError, match="seq_mask"):
        MismatchCorrection(Config(seq_mask=(2.0, 0.5)))
    with pytest.raises(ConfigError, match="is_cap_low"):
        MismatchCorrection(Config(is_cap=2.0, is_cap_low=3.0))


def test_default_config_only_measures():
    _, old, sampler, _, mask, turns = make_batch(noise=1.0)
    result = correction(old, sampler, mask, turns)
    assert torch.equal(result.loss_mask, mask) and torch.equal(result.weights, mask)


def test_veto_preset_rejects_only_sequences_with_a_catastrophic_token() -> None:
    cfg = Config.preset("veto")
    sampler = torch.zeros(2, 3)
    trainer = torch.zeros(2, 3)
    trainer[1, 2] = -12.0  # ρ = e^-12 ≈ 6e-6 < 1e-4
    mask = torch.ones(2, 3)
    result = MismatchCorrection(cfg)(trainer, sampler, mask, torch.zeros(2, 3, dtype=torch.long))
    assert result.loss_mask[0].tolist() == [1.0, 1.0, 1.0]
    assert result.loss_mask[1].tolist() == [0.0, 0.0, 0.0]
    assert result.stats.veto_fraction == 0.5


def test_the_plan_tells_the_trainer_what_each_correction_needs():
    def plan(name, **overrides):
        return MismatchCorrection.Config.preset(name, **overrides).plan()

    assert not plan("none").proximal_is_sampler
    bypass = plan("token_tis", bypass=BypassMode.PPO_CLIP)
    assert bypass.proximal_is_sampler
    assert plan("seq_tis", batch_normalize=True).whole_batch_first
    assert not plan("seq_tis").whole_batch_first
    old, sampler = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]])
    assert torch.equal(bypass.proximal(old, sampler), sampler)
    assert torch.equal(plan("none").proximal(old, sampler), old)


@pytest.mark.parametrize(
    ("name", "overrides", "weighs", "rejects"),
    [
        ("none", {}, False, False),
        ("token_tis", {}, True, False),
        ("geo_rs", {}, False, True),
        ("geo_rs_token_tis", {}, True, True),
        ("veto", {}, False, True),
        ("token_tis", {"bypass": BypassMode.PPO_CLIP}, False, False),  # ppo_clip weighs nothing
        ("none", {"is_cap_low": 0.5}, False, False),  # a floor without a level changes nothing
        ("none", {"seq_mean_k3": 0.01}, False, True),
        ("none", {"seq_max_k2": 2.0}, False, True),
        ("none", {"turn_mask": (0.5, 2.0)}, False, True),
        ("turn_tis", {}, True, False),
    ],
)
def test_what_a_correction_does_is_read_from_its_effect(name, overrides, weighs, rejects):
    config = Config.preset(name, **overrides)
    assert (config.weighs, config.rejects) == (weighs, rejects)
