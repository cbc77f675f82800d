"""Each new stabilizer beside its reference implementation, on identical float32 tensors.

    python bench/stabilizers/compare_references.py [--mirrors /work/.mirror] \
        > bench/stabilizers/records/compare_references.txt

The references are read from fetched repository snapshots at the commits below (`git show`,
nothing of theirs is kept in this repository) and imported with small stand-ins for the
modules they import but do not use here (verl's package, megatron's process groups). Each
case draws random logprobs, advantages and masks from one seed and compares, per loss, the
loss value, the gradient with respect to the current logprobs, and the fraction of tokens
clipped or masked; per VCPO piece, the ESS ratio and the optimal baseline. A row passes when
the largest difference is within float32 rounding (relative 1e-5 of the value's scale).

References (the authors' code where it exists, verl's otherwise):
- DPPO binary TV / KL: sail-sg/Stable-RL (the authors) `verl/trainer/ppo/core_algos.py`
  (`dppo_binary_tv`, `dppo_binary_kl`, anchor = the rollout logprobs) and verl's `dppo_tv`,
  `dppo_kl` (added by the paper's first author);
- GSPO and CISPO: verl's `compute_policy_loss_gspo` and `compute_policy_loss_cispo`;
- VCPO: mit-han-lab/vcpo `recipe/fully_async_policy/staleness_utils.py` (`compute_is_info`,
  `compute_ess_info`, `compute_opob_baseline`).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import torch

from tir_rl.trainer.ess_step import ess_ratio, sequence_weight_sums
from tir_rl.trainer.loss import (
    Aggregation,
    CISPOLoss,
    DPPOBinaryKLLoss,
    DPPOBinaryTVLoss,
    GSPOLoss,
    LossTerms,
)
from tir_rl.trainer.optimal_baseline import optimal_baseline_advantages

SNAPSHOTS = {
    "stable_rl": (
        "sail-sg+Stable-RL",
        "c6af1d119c0fe30d16dd9a837d35fdf695acd226",
        "verl/trainer/ppo/core_algos.py",
    ),
    "verl": (
        "verl-project+verl",
        "1dda039b9c6311889a9c9a26040677e1254814f9",
        "verl/trainer/ppo/core_algos.py",
    ),
    "vcpo": (
        "mit-han-lab+vcpo",
        "c7f030f0b77237cfb0e75e720669e2917a1bb56e",
        "recipe/fully_async_policy/staleness_utils.py",
    ),
}
TOLERANCE = 1e-5
"""Largest difference allowed, relative to the compared quantity's largest magnitude."""


# ------------------------------------------------------------------ the references' imports


class ActorSettings:
    """What the references read from verl's `ActorConfig`: clip ratios, attributes and get()."""

    def __init__(self, *, clip_ratio: float, clip_ratio_low: float | None = None,
                 clip_ratio_high: float | None = None, clip_ratio_c: float | None = None,
                 loss_mode: str = "vanilla") -> None:  # fmt: skip
        self.clip_ratio = clip_ratio
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        if clip_ratio_c is not None:
            self.clip_ratio_c = clip_ratio_c
        self.policy_loss = {"loss_mode": loss_mode}
        self.global_batch_info: dict[str, object] = {}

    def get(self, key: str, default: object = None) -> object:
        return getattr(self, key, default)


def _sum_where(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """verl's masked sum: the values where the mask is set, times the mask, summed."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _mean_where(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """verl's masked mean: the masked sum over the mask's sum plus 1e-8."""
    return _sum_where(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _stand_ins() -> None:
    """Modules the reference files import at their top, reduced to what they use here."""

    def module(name: str) -> types.ModuleType:
        made = types.ModuleType(name)
        sys.modules[name] = made
        return made

    module("omegaconf").DictConfig = dict
    verl = module("verl")
    verl.DataProto = object
    utils = module("verl.utils")
    utils.as_torch_index = utils.group_mean_std = lambda *a, **k: None
    functional = module("verl.utils.torch_functional")
    functional.masked_sum, functional.masked_mean = _sum_where, _mean_where
    functional.allgather_dict_into_list = lambda local, group=None: list(local)  # one process
    module("verl.utils.import_utils").deprecated = lambda *a, **k: lambda f: f
    module("verl.trainer")
    module("verl.trainer.config").AlgoConfig = type("AlgoConfig", (), {})
    module("verl.workers")
    module("verl.workers.config").ActorConfig = ActorSettings
    module("megatron")
    state = module("megatron.core.parallel_state")
    state.get_data_parallel_group = lambda **k: None
    state.get_tensor_model_parallel_rank = state.get_pipeline_model_parallel_rank = lambda: 0
    module("megatron.core").parallel_state = state


def load_reference(name: str, mirrors: Path, scratch: Path) -> types.ModuleType:
    """The reference file of `SNAPSHOTS[name]`, read from its snapshot and imported."""
    repo, commit, path = SNAPSHOTS[name]
    git_dir = mirrors / repo / "repo"
    text = subprocess.run(
        ["git", "--git-dir", str(git_dir), "show", f"{commit}:{path}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    target = scratch / f"ref_{name}.py"
    target.write_text(text)
    spec = importlib.util.spec_from_file_location(f"ref_{name}", target)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


# ------------------------------------------------------------------ cases


def draw(seed: int, *, rows: int = 6, tokens: int = 40, spread: float = 0.6):
    """Logprobs, old (anchor) logprobs, per-sequence advantages (never 0) and a ragged mask."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(rows, tokens, generator=gen).clamp(min=1e-3))
    new = (old + spread * torch.randn(rows, tokens, generator=gen)).clamp(max=-1e-4)
    adv = torch.randn(rows, generator=gen)
    adv = torch.where(adv.abs() < 0.05, torch.full_like(adv, 0.5), adv)
    lengths = torch.randint(tokens // 3, tokens + 1, (rows,), generator=gen)
    mask = (torch.arange(tokens).unsqueeze(0) < lengths.unsqueeze(1)).float()
    weights = 0.5 + torch.rand(rows, tokens, generator=gen)
    return new, old, adv, mask, weights


def ours(loss_fn, new, old, adv, mask, weights):
    lp = new.clone().requires_grad_(True)
    loss, metrics = loss_fn(lp, old_logprobs=old, advantages=adv, loss_mask=mask, weights=weights)
    loss.backward()
    return loss.detach(), lp.grad, metrics.clip_fraction_low + metrics.clip_fraction_high


def theirs(call: Callable, new, old, adv, mask, weights, **kwargs):
    lp = new.clone().requires_grad_(True)
    per_token_adv = adv.unsqueeze(1).expand_as(new) * mask
    loss, metrics = call(old, lp, per_token_adv, mask, **kwargs, weights=weights)
    loss.backward()
    return loss.detach(), lp.grad, float(metrics["actor/pg_clipfrac"])


def differences(a, b) -> tuple[float, float, float]:
    """(loss, gradient, fraction) differences, each relative to its quantity's scale."""
    loss = abs(float(a[0] - b[0])) / max(abs(float(b[0])), 1e-12)
    grad = float((a[1] - b[1]).abs().max()) / max(float(b[1].abs().max()), 1e-12)
    return loss, grad, abs(a[2] - b[2])


def loss_cases(refs: dict[str, types.ModuleType]) -> list[tuple[str, str, Callable, Callable]]:
    """(loss, reference, ours, theirs) for every compared pair."""
    verl, stable = refs["verl"], refs["stable_rl"]

    def verl_loss(mode: str, settings: ActorSettings, agg: str):
        fn = verl.get_policy_loss_fn(mode)

        def call(old, lp, adv, mask, *, weights):
            return fn(old, lp, adv, mask, agg, settings, rollout_is_weights=weights)

        return call

    def stable_loss(mode: str, settings: ActorSettings):
        fn = stable.get_policy_loss_fn(mode)

        def call(old, lp, adv, mask, *, weights):  # it takes no IS weights: weights of 1 here
            zeros = torch.zeros_like(old)
            return fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                      loss_agg_mode="token-mean", config=settings, rollout_log_prob=old,
                      topk_kl=zeros, entropy=zeros)  # fmt: skip

        return call

    gspo = ActorSettings(clip_ratio=3e-4, clip_ratio_high=4e-4)
    tv = ActorSettings(clip_ratio=0.15, clip_ratio_c=1e4)
    kl = ActorSettings(clip_ratio=0.05, clip_ratio_c=1e4)
    token, seq = LossTerms(), LossTerms(aggregation=Aggregation.SEQUENCE_MEAN)
    tv_ours = DPPOBinaryTVLoss(DPPOBinaryTVLoss.Config(ratio_cap=1e4), token)
    kl_ours = DPPOBinaryKLLoss(DPPOBinaryKLLoss.Config(ratio_cap=1e4), token)
    return [
        ("dppo_tv", "verl dppo_tv", tv_ours, verl_loss("dppo_tv", tv, "token-mean")),
        ("dppo_kl", "verl dppo_kl", kl_ours, verl_loss("dppo_kl", kl, "token-mean")),
        ("dppo_tv", "Stable-RL dppo_binary_tv", tv_ours, stable_loss("dppo_binary_tv", tv)),
        ("dppo_kl", "Stable-RL dppo_binary_kl", kl_ours, stable_loss("dppo_binary_kl", kl)),
        (
            "gspo",
            "verl gspo",
            GSPOLoss(terms=seq),
            verl_loss("gspo", gspo, "seq-mean-token-mean"),
        ),
        (
            "cispo",
            "verl cispo",
            CISPOLoss(terms=token),
            verl_loss("cispo", ActorSettings(clip_ratio=0.2, clip_ratio_low=10.0), "token-mean"),
        ),
    ]  # fmt: skip


def compare_losses(refs: dict[str, types.ModuleType], seeds: list[int]) -> list[str]:
    lines = [
        "| loss | reference | seeds | largest loss diff (rel) | largest gradient diff (rel) | "
        "largest clipped/masked fraction diff | mean fraction | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, reference, our_loss, their_loss in loss_cases(refs):
        worst = [0.0, 0.0, 0.0]
        fractions = []
        for seed in seeds:
            # GSPO's band is 4e-4 wide: small moves so that some sequences fall inside it.
            spread = 2e-4 if name == "gspo" and seed % 2 else 0.6
            new, old, adv, mask, weights = draw(seed, spread=spread)
            if reference.startswith("Stable-RL"):
                weights = torch.ones_like(weights)
            mine = ours(our_loss, new, old, adv, mask, weights)
            ref = theirs(their_loss, new, old, adv, mask, weights)
            worst = [max(w, d) for w, d in zip(worst, differences(mine, ref), strict=True)]
            fractions.append(ref[2])
        ok = max(worst) <= TOLERANCE
        lines.append(
            f"| {name} | {reference} | {len(seeds)} | {worst[0]:.1e} | {worst[1]:.1e} | "
            f"{worst[2]:.1e} | {sum(fractions) / len(fractions):.3f} | {'yes' if ok else 'NO'} |"
        )
    return lines


def compare_vcpo(vcpo: types.ModuleType, seeds: list[int]) -> list[str]:
    lines = [
        "| VCPO piece | reference | seeds | largest difference (rel) | pass |",
        "|---|---|---|---|---|",
    ]
    worst_ess, worst_base = 0.0, 0.0
    for seed in seeds:
        new, old, adv, mask, _ = draw(seed, rows=8, tokens=12, spread=0.15)
        gen = torch.Generator().manual_seed(10_000 + seed)
        rewards = (torch.rand(8, generator=gen) > 0.5).float()
        groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
        norms = 0.5 + torch.rand(8, generator=gen)
        records = []
        for i in range(8):
            record = vcpo.TrajRecord(
                uid=i, group_uid=int(groups[i]), epoch_idx=0, minibatch_idx=0,
                trainer_global_step=0, trainer_local_step=0, param_version_start=0,
                param_version_end=0, trainer_param_version=0,
                response_length=int(mask[i].sum()), prompt_length=None, advantage_scalar=0.0,
                reward_scalar=float(rewards[i]), grad_norm_unscaled=float(norms[i]),
            )  # fmt: skip
            # new = the learner's logprobs (VCPO's "old", the current policy), old = the sampler
            vcpo.compute_is_info(record, old[i], new[i], mask[i], 8.0)
            records.append(record)
        ess_ref = vcpo.compute_ess_info(records, 8.0)["ess_ratio"]
        ess_mine = ess_ratio(*sequence_weight_sums(new, old, mask).tolist())
        worst_ess = max(worst_ess, abs(ess_mine - ess_ref) / abs(ess_ref))
        log_ratios = torch.where(mask > 0, new - old, 0.0).sum(dim=1)
        _, baseline = optimal_baseline_advantages(rewards, groups, norms, log_ratios)
        for i in range(8):
            ref = float(vcpo.compute_opob_baseline(records, int(groups[i])))
            worst_base = max(worst_base, abs(float(baseline[i]) - ref) / max(abs(ref), 1e-12))
    for piece, reference, worst in (
        ("ESS ratio ρ (raw sequence weights)", "compute_is_info + compute_ess_info", worst_ess),
        ("optimal baseline b per group", "compute_opob_baseline (group, mean)", worst_base),
    ):  # fmt: skip
        lines.append(
            f"| {piece} | vcpo {reference} | {len(seeds)} | {worst:.1e} | "
            f"{'yes' if worst <= TOLERANCE else 'NO'} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    _stand_ins()
    with tempfile.TemporaryDirectory() as scratch:
        refs = {name: load_reference(name, args.mirrors, Path(scratch)) for name in SNAPSHOTS}
    print("# Stabilizers against their references (bench/stabilizers/compare_references.py)")
    print()
    for name, (repo, commit, path) in SNAPSHOTS.items():
        print(f"- {name}: {repo.replace('+', '/')} @ {commit}, `{path}`")
    print(f"- torch {torch.__version__}; float32 inputs; tolerance {TOLERANCE:g} relative")
    print()
    loss_lines = compare_losses(refs, seeds)
    vcpo_lines = compare_vcpo(refs["vcpo"], seeds)
    print("\n".join(loss_lines))
    print()
    print("\n".join(vcpo_lines))
    failed = [line for line in loss_lines + vcpo_lines if line.endswith("| NO |")]
    if failed:
        raise SystemExit(f"{len(failed)} comparison(s) outside float32 rounding")


if __name__ == "__main__":
    main()
