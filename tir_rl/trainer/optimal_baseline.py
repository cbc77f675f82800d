"""VCPO's off-policy optimal baseline: a group baseline weighted by gradient size and IS weight.

For lagged or mismatched samples the group mean is no longer the variance-minimising baseline.
VCPO (arXiv 2602.17616) derives the closed form for the score-function estimator: sequence i
of a group contributes with weight

    W_i = ‖g_i‖² · w_i²,    g_i = Σ_t w̃_t ∇ℓ^θ_t (the sequence's gradient as the update weighs
                             it), w_i = exp(Σ_t (ℓ^old_t − ℓ^μ_t)) (its raw sequence ratio),

the baseline is b = Σ_i W_i R_i / (Σ_i W_i + 1e-8), and the advantage (R_i − b)/σ with σ the
group's population standard deviation of the rewards (R_i − b when σ ≤ 1e-8). This follows
the authors' code (mit-han-lab/vcpo `compute_opob_baseline`), whose g_i already carries the
truncated weight w̃, so W_i holds it as well as w_i² (their README writes w_i² alone).

‖g_i‖ is exact: one extra forward and backward per sequence (`Trainer`), as in the authors'
implementation, on one rank (a sequence's gradient under FSDP2 would be summed over ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from tir_rl import distributed as tdist

if TYPE_CHECKING:
    from tir_rl.mismatch import MismatchCorrection
    from tir_rl.trainer.batch import TrainBatch
    from tir_rl.trainer.forward import TrainerForward

_EPS = 1e-8
"""VCPO's guard of the weighted mean and of a tied group's standard deviation."""


def optimal_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, grad_norms: Tensor, sequence_log_ratios: Tensor
) -> tuple[Tensor, Tensor]:
    """VCPO's advantages and each sequence's baseline (the module docstring).

    Args:
        rewards: [N] rewards.
        group_ids: [N] ids; sequences with the same id are samples of one task.
        grad_norms: [N] ‖g_i‖, each sequence's weighted score gradient norm.
        sequence_log_ratios: [N] log w_i = Σ_t (ℓ^old_t − ℓ^μ_t).

    Returns:
        ([N] advantages, [N] the baseline of each sequence's group), float64.
    """
    r = rewards.double()
    log_w = sequence_log_ratios.double().clamp(max=300.0)  # w² finite in float64
    weight = grad_norms.double().square() * torch.exp(2 * log_w)
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64)
    weighted = zeros.index_add(0, group, weight * r)
    total = zeros.index_add(0, group, weight)
    baseline = (weighted / (total + _EPS))[group]
    count = zeros.index_add(0, group, torch.ones_like(r))
    mean = zeros.index_add(0, group, r) / count
    var = zeros.index_add(0, group, (r - mean[group]).square()) / count
    std = var.sqrt()[group]
    centered = r - baseline
    advantages = torch.where(std > _EPS, centered / std, centered)
    return advantages, baseline


def sequence_gradient_norms(
    batch: TrainBatch,
    forward: TrainerForward,
    model: nn.Module,
    correction: MismatchCorrection,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """([B] ‖g_i‖, [B] log w_i): each sequence's weighted score gradient norm, one backward each.

    g_i = Σ_t w̃_t ∇ℓ^θ_t with w̃ the correction's weights of the sequence alone (by the training
    forward); log w_i = Σ_t (ℓ^θ_t − ℓ^μ_t) over its model tokens. Leaves gradients in `model`:
    the caller clears them.
    """
    norms, log_ratios = [], []
    for i in range(batch.num_sequences):
        one = batch.select([i])
        model.zero_grad(set_to_none=True)
        sampler, mask = one.sampler_logprobs.to(device), one.loss_mask.to(device)
        log_ratio = 0.0
        for mb in forward.plan(one):
            mb = mb.select_tokens(mb.token_mask(one.loss_mask))
            token_logprobs = forward.token_stats(model, mb, entropy=False).logprobs
            theta = torch.zeros(sampler.shape, device=device, dtype=torch.float32)
            theta = theta.index_put((mb.dest_seq.to(device), mb.dest_tok.to(device)),
                                    token_logprobs)  # fmt: skip
            fixed = correction(theta.detach(), sampler, mask, one.turn_ids.to(device))
            (-(fixed.weights * theta).sum()).backward()
            delta = torch.where(mask, theta.detach() - sampler, torch.zeros_like(theta))
            log_ratio += float(delta.sum())
        log_ratios.append(log_ratio)
        norms.append(float(tdist.grad_norm(model.parameters())))
    return torch.tensor(norms), torch.tensor(log_ratios)


def baseline_gap(batch: TrainBatch, baseline: Tensor) -> float:
    """Mean |b − the group's mean reward| over the batch's sequences."""
    _, group = torch.unique(batch.group_ids, return_inverse=True)
    means = torch.zeros(int(group.max()) + 1).index_add(0, group, batch.rewards.float())
    means = means / torch.bincount(group).float()
    return float((baseline - means[group].double()).abs().mean())
