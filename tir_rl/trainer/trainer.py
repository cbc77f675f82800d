"""FSDP2 policy trainer: logprob recompute, mismatch correction, policy update, weights for sync.

One `train_step` on each rank, on that rank's share of the global batch. Without
`old_logprobs` it makes one forward per micro-batch (the weights that would recompute ℓ^old
are the update's own, so ℓ^old = ℓ^θ detached)::

    micro-batch (packed) ──► forward ℓ_θ ──► ℓ_old := sg(ℓ_θ)
        │ sampler logprobs ℓ_μ ──► correction(ℓ_old, ℓ_μ) of its sequences ──► weights w, mask m′
        │ with a KL term: frozen reference, no-grad forward ──► ℓ_ref
        ▼
    policy loss (ℓ_θ, ℓ_old, A, m′, w, ℓ_ref), summed (not normalized) ──► backward
    ...after the last micro-batch, from the micro-batches' corrections (computed once):
    mismatch metrics, correction stats, N = Σ m′ (tokens or sequences, all ranks), ESS
        ──► gradients ÷ N ──► grad norm (pre-clip) ──► non-finite? skip ──► guard? ──► clip
        ──► AdamW at the scheduled rate (× VCPO's ESS factor when on)

With `old_logprobs` given (several optimizer steps on one batch), or with a correction that
normalizes weights over the batch (`batch_normalize`, recomputed with a no-grad pass first),
the whole batch is corrected before the loop and the micro-batches use its rows; a sequence
is never split across micro-batches, so both paths give the same update. Inside the loop
nothing is read back to the host, except what a correction needs for data-dependent shapes.

The trainer's logprob of completion token t comes from the logits at position t − 1 over the
full prompt + completion context (all turns), divided by the sampler's temperature, through
log_softmax in float32 (`token_stats`). lm_head runs only where a logprob is used
(`logits_to_keep`): every completion token in `compute_logprobs`, the model tokens alone in
the update pass. Ranks may hold different numbers of micro-batches; the shorter ones run
empty passes so the collectives stay matched.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from tir_rl import distributed as tdist
from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.errors import ConfigError
from tir_rl.metric import Metric
from tir_rl.mismatch import (
    CorrectionPlan,
    CorrectionResult,
    MismatchCorrection,
    mismatch_metrics,
)
from tir_rl.mismatch.failure_tilt import failure_tilt
from tir_rl.mismatch.guard import CollapseGuard, GuardDecision
from tir_rl.models import resolve_model
from tir_rl.trainer import lora as lora_ops
from tir_rl.trainer import placement
from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.trainer.ess_step import ESS_KEY, SCALE_KEY, ess_ratio, sequence_weight_sums
from tir_rl.trainer.forward import TrainerForward
from tir_rl.trainer.loss.base import LOSS_TOKENS, PolicyLoss
from tir_rl.trainer.loss.grpo import GRPOLoss
from tir_rl.trainer.lr_schedule import lr_factor
from tir_rl.trainer.optimal_baseline import (
    baseline_gap,
    optimal_baseline_advantages,
    sequence_gradient_norms,
)
from tir_rl.trainer.optimizer import build_adamw, clip_gradients, seed_everything
from tir_rl.trainer.prefix_attention import register_prefix_attention
from tir_rl.trainer.reference import ReferencePolicy, load_reference
from tir_rl.trainer.step_result import (
    SKIP_COUNTS,
    StepClock,
    StepResult,
    StepTotals,
    UpdatePass,
    UpdateStatus,
    combine_loss_metrics,
    update_columns,
)
from tir_rl.trainer.trainer_config import TrainerConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Trainer:
    """Holds the policy model and its optimizer on this rank; runs GRPO steps."""

    Config = TrainerConfig
    """The trainer's settings (`tir_rl.trainer.trainer_config`)."""

    def __init__(
        self,
        config: Trainer.Config | None = None,
        *,
        loss_fn: PolicyLoss | None = None,
        correction_config: MismatchCorrection.Config | None = None,
        truncation: SamplingTruncation | None = None,
    ) -> None:
        """Load the model, shard it when a multi-rank process group exists, build AdamW.

        Args:
            config: trainer settings.
            loss_fn: the policy loss; defaults to `GRPOLoss()` with its default config.
            correction_config: mismatch correction; defaults to metrics only (no correction).
            truncation: the sampler's min-p, top-k and top-p (a run's rollout section): every
                logprob the trainer computes is normalized over the kept set they leave.
        """
        from transformers import AutoModelForCausalLM

        from tir_rl.trainer.batch_invariant_kernels import use_batch_invariant_kernels
        from tir_rl.trainer.vllm_cpu_kernels import use_vllm_cpu_kernels

        self.config = config or Trainer.Config()
        self.config.validate()
        if self.config.temperature is None:
            raise ConfigError(
                "trainer.temperature is unset (null follows rollout.temperature in a run "
                "config): give a trainer built alone the sampler's temperature."
            )
        self.lr_at(0)  # refuse a schedule that cannot run (cosine without its length) now
        seed_everything((self.config.seed or 0) + tdist.rank())
        self.device = placement.prepare_device(self.config)
        if self.config.kernels == "batch_invariant":
            use_batch_invariant_kernels()  # before the model: its ops are replaced process-wide
        self.lora_enabled = self.config.lora.enabled
        if self.lora_enabled:
            lora_ops.import_peft()  # refuse a missing extra before loading anything
            if tdist.world_size() > 1:
                raise ConfigError(
                    f"trainer.lora.enabled runs on one rank only (world size is "
                    f"{tdist.world_size()}): the merged weights for the engine are computed "
                    "from unsharded adapters, which FSDP2 does not hold. Train on one rank, "
                    "or without LoRA."
                )
        self.loss_fn: PolicyLoss = loss_fn if loss_fn is not None else GRPOLoss()
        self.model_path = resolve_model(self.config.model)
        self.compute_dtype = _DTYPES[self.config.dtype]
        attention = self.config.attn_implementation
        if self.config.packing is Packing.SHARED_PREFIX:
            attention = register_prefix_attention()  # sdpa, each shared prefix once
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            dtype=torch.float32,  # master weights; the compute dtype is applied per pass
            attn_implementation=attention,
        )
        model.config.use_cache = False
        if self.config.kernels == "vllm_cpu":
            use_vllm_cpu_kernels(model, world_size=tdist.world_size())
        reference_weights, reference_record = None, None
        if self.loss_fn.needs_reference:  # before any change to `model`: its start is copied
            reference_weights, reference_record = load_reference(
                model,
                policy_model=self.config.model,
                policy_path=self.model_path,
                reference_model=self.config.reference_model,
                adapters_off_is_start=(
                    self.lora_enabled and self.config.lora.adapters_off_is_start
                ),
                attn_implementation=attention,
            )
        placement.freeze_all_but(model, self.config.train_only)
        if self.config.grad_checkpointing:
            model.gradient_checkpointing_enable()
        if self.lora_enabled:
            if self.config.grad_checkpointing:
                model.enable_input_require_grads()  # frozen embeddings: keep the graph alive
            model = lora_ops.wrap(model, self.config.lora)
        model.to(self.device)
        tdist.check_backend(self.device)
        self.sharded = tdist.world_size() > 1
        if self.sharded:
            placement.apply_fsdp2(model, self.compute_dtype)
        self.model: nn.Module = model
        self.forward = TrainerForward(
            device=self.device,
            compute_dtype=self.compute_dtype,
            sharded=self.sharded,
            temperature=self.config.temperature,
            micro_batch_tokens=self.config.micro_batch_tokens,
            packing=self.config.packing,
            truncation=truncation,
        )
        """The one forward the trainer scores tokens with (`tir_rl.trainer.forward`)."""
        self.reference: ReferencePolicy | None = None
        """The frozen policy of the loss's KL term; None when the loss has none."""
        if reference_record is not None:
            if reference_weights is None:  # LoRA: the base weights, adapters off
                self.reference = ReferencePolicy(model, reference_record)
            else:
                reference_weights.to(self.device)
                if self.sharded:
                    placement.apply_fsdp2(reference_weights, self.compute_dtype)
                self.reference = ReferencePolicy.frozen_copy(reference_weights, reference_record)
            logger.info(
                "KL reference policy: %s, %s", reference_record.path,
                "the LoRA policy with its adapters disabled" if reference_weights is None
                else "a frozen copy",
            )  # fmt: skip
        self.optimizer = build_adamw(
            model.parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.correction = MismatchCorrection(correction_config)
        """Corrects a batch's sequences: each micro-batch's once in the update pass, or the
        whole batch first when its weights are normalized over it. Whatever it rejects
        leaves the loss and its normalizer alike (both read its result)."""
        normalized = self.correction.config.batch_normalize
        if self.config.optimal_baseline and (self.sharded or normalized):
            raise ConfigError(
                "trainer.optimal_baseline needs each sequence's own gradient norm: it runs on one "
                f"rank (world size is {tdist.world_size()}) and with weights corrected per "
                f"sequence (correction.batch_normalize is {normalized}). Turn one of them off."
            )
        self.step = 0
        """Number of train_step calls so far (applied or skipped); the schedule's step."""
        self.skip_counts: Counter[UpdateStatus] = Counter()
        """How many steps ended with each `SKIP_COUNTS` status (kept in checkpoints)."""

    # ------------------------------------------------------------------ logprobs

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Trainer logprobs of every completion token, without gradients.

        Returns:
            [B, T] float32 on the CPU, aligned with `batch.completion_ids`; 0 past each
            completion's end. Tool/rendered tokens get their logprob too (the mask decides).
        """
        was_training = self.model.training
        self.model.eval()
        try:
            return self.forward.score(batch, self.model)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def sequence_logprobs(
        self, token_ids: Sequence[int], *, temperature: float = 1.0
    ) -> torch.Tensor:
        """[T − 1] teacher-forced logprobs of `token_ids[1:]` by the training forward.

        The parity probe after a weight sync and `tir-rl doctor` score with this: the same
        forward, packing, compute dtype and kernels as training (`TrainerForward.sequence`).
        """
        was_training = self.model.training
        self.model.eval()
        try:
            return self.forward.sequence(self.model, token_ids, temperature=temperature)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def compute_reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference policy's logprobs of every completion token (as `compute_logprobs`).

        Raises:
            ConfigError: the trainer has no reference (its loss has no KL term).
        """
        if self.reference is None:
            raise ConfigError(
                "This trainer has no reference policy: its loss has no KL term (loss.kl_coef 0)."
            )
        with self.reference.forward_model() as reference:
            return self.forward.score(batch, reference)

    # ------------------------------------------------------------------ training

    def score_step(
        self, batch: TrainBatch, *, guard: CollapseGuard | None = None, run_step: int | None = None
    ) -> StepResult:
        """Score a batch that carries no learning signal, and let the guard watch it.

        A step whose groups are all degenerate makes no update, but its sampler can be as far
        from the trainer as ever (a sampler so wrong that no rollout scores is the extreme
        case), so the mismatch metrics are measured and checked like an update's. Nothing is
        skipped (there is no update); a guard's `stop` still ends the run.

        Returns:
            A `SCORED` result with NaN loss and gradient norm, the global `mismatch/...`
            metrics, the guard's decision, and `compute_logprobs(batch)` as `logprobs`.
        """
        logprobs = self.compute_logprobs(batch)
        metrics = mismatch_metrics(
            logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )
        metrics = tdist.all_reduce_metrics(metrics)
        decision = None
        if guard is not None:
            at = self.step if run_step is None else run_step  # see train_step
            decision = guard.check(at, metrics, batch=batch.tensors(), rank=tdist.rank())
        return StepResult(math.nan, math.nan, UpdateStatus.SCORED, metrics, decision, logprobs)

    def train_step(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        *,
        old_logprobs: torch.Tensor | None = None,
        guard: CollapseGuard | None = None,
        run_step: int | None = None,
    ) -> StepResult:
        """One optimizer step on this rank's share of the global batch (the module's diagram).

        One forward per micro-batch (ℓ^old = ℓ^θ detached) unless `old_logprobs` are given or
        the correction normalizes over the whole batch: then the whole batch is corrected
        first. The gradient is divided by the global normalizer after the last micro-batch.

        Args:
            batch: this rank's sequences.
            advantages: [B] GRPO advantage per sequence.
            old_logprobs: [B, T] trainer logprobs under the weights that sampled the batch;
                pass them to reuse one recompute over several steps on the same batch.
            guard: collapse guard consulted before the update is applied.
            run_step: the run's step, naming the guard's alerts (None: `step`, which lags).

        Returns:
            Its status, global loss, pre-clip gradient norm, metrics, and the ℓ^old used
            (see `StepResult.logprobs`).
        """
        clock = StepClock()
        advantages = batch.checked_advantages(advantages)
        baseline_row: dict[str, float] = {}
        if self.config.optimal_baseline:
            advantages, baseline_row = self.optimal_baseline(batch)
            clock.mark("baseline")
        plan = self.correction.config.plan()
        old_logprobs, presplit = self._whole_batch_first(batch, old_logprobs, plan)
        clock.mark("logprob")

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        update = self._update_pass(batch, advantages, old_logprobs, presplit, plan)
        clock.mark("backward")

        old_logprobs = old_logprobs if old_logprobs is not None else update.logprobs
        corrected = presplit if presplit is not None else update.corrected
        assert corrected is not None
        local = mismatch_metrics(
            old_logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )
        local.update(corrected.stats.to_dict())
        local |= failure_tilt(
            old_logprobs, batch.sampler_logprobs, batch.loss_mask, advantages, corrected.weights
        )
        local.update(combine_loss_metrics(update.metric_rows))
        local.update({k: Metric.mean(v, LOSS_TOKENS) for k, v in baseline_row.items()})
        clock.mark("mismatch")

        totals = self._global_totals(batch, old_logprobs, corrected, update, local)
        decision = None
        if guard is not None:
            watched = totals.metrics | update_columns(totals.loss, totals.grad_norm)
            batch_tensors = batch.tensors() | {"advantages": advantages}
            at = self.step if run_step is None else run_step
            decision = guard.check(at, watched, batch=batch_tensors, rank=tdist.rank())
        lr = self.lr_at(self.step)
        status = self._apply_or_skip(totals, decision, lr)
        clock.mark("apply")
        totals.metrics.update(self._step_columns(totals, clock, lr))
        self.step += 1
        return StepResult(
            totals.loss, totals.grad_norm, status, totals.metrics, decision, old_logprobs, corrected
        )

    def _whole_batch_first(
        self, batch: TrainBatch, old_logprobs: torch.Tensor | None, plan: CorrectionPlan
    ) -> tuple[torch.Tensor | None, CorrectionResult | None]:
        """The two-pass path's ℓ^old and whole-batch correction; (None, None) in one pass."""
        if old_logprobs is None and plan.whole_batch_first:
            old_logprobs = self.compute_logprobs(batch)
        if old_logprobs is None:
            return None, None
        old_logprobs = old_logprobs.detach().float().cpu()
        return old_logprobs, self._correct(batch, old_logprobs)

    def _step_columns(self, totals: StepTotals, clock: StepClock, lr: float) -> dict[str, float]:
        """The step's timings, rate, learning rate and the trainer's skip counts so far."""
        columns = clock.metrics()
        columns["train/lr"] = lr
        if self.config.ess_step_size.enabled:
            columns[SCALE_KEY] = self.config.ess_step_size.scale(totals.ess_ratio)
        columns["train/tokens_per_s"] = totals.num_tokens_computed / max(
            columns["train/step_s"], 1e-9
        )
        for counted in SKIP_COUNTS:
            columns[f"train/{counted}"] = float(self.skip_counts[counted])
        return columns

    def _global_totals(
        self, batch: TrainBatch, old_logprobs: torch.Tensor, corrected: CorrectionResult,
        update: UpdatePass, local: dict[str, Metric],
    ) -> StepTotals:  # fmt: skip
        """Divide the gradients by the global normalizer; reduce the figures over the ranks.

        The counts and sums go in one collective, the metrics in `all_reduce_metrics`.
        """
        kept = corrected.loss_mask.bool()
        counts = [kept.sum(), kept.any(dim=-1).sum(), batch.loss_mask.sum(), batch.num_tokens]
        weight_sums = sequence_weight_sums(old_logprobs, batch.sampler_logprobs, batch.loss_mask)
        counted = torch.tensor([float(c) for c in counts], dtype=torch.float64)
        local_figures = torch.cat([counted, update.sums.cpu(), weight_sums])
        *global_counts, loss_sum, entropy_sum, outside, sum_w, sum_w2, num_weighted = (
            tdist.all_reduce_tensor(local_figures).tolist()
        )
        num_tokens, num_sequences, num_model_tokens, num_computed = map(int, global_counts)
        num_masked = num_model_tokens - num_tokens  # the model's tokens the correction masked
        normalizer = self.loss_fn.global_normalizer(
            num_tokens=num_tokens, num_sequences=num_sequences
        )
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(normalizer)
        grad_norm = float(tdist.grad_norm(self.model.parameters()))
        if self.reference is None:
            local.pop("train/ref_kl", None)  # no reference: no KL to it (not a KL of 0)
        metrics = tdist.all_reduce_metrics(local)
        metrics.pop(LOSS_TOKENS, None)  # the same count as train/num_loss_tokens
        ess = ess_ratio(sum_w, sum_w2, num_weighted)
        metrics.update(
            {
                ESS_KEY: ess,
                "train/entropy": entropy_sum / num_model_tokens if num_model_tokens else 0.0,
                "mismatch/outside_kept_set": outside / max(num_model_tokens, 1),
                "train/num_loss_tokens": float(num_tokens),
                "train/num_loss_sequences": float(num_sequences),
                "train/num_masked_by_correction": float(num_masked),
            }
        )
        return StepTotals(
            loss_sum / normalizer, grad_norm, num_tokens, num_computed, metrics, ess_ratio=ess
        )

    def _apply_or_skip(
        self, totals: StepTotals, decision: GuardDecision | None, lr: float
    ) -> UpdateStatus:
        """Step the optimizer unless the figures or the guard say not to; clear the gradients."""
        status = UpdateStatus.APPLIED
        if not totals.finite:
            status = UpdateStatus.NONFINITE
            logger.warning("step %d: non-finite loss or gradient; update skipped", self.step)
        elif totals.num_loss_tokens == 0:
            status = UpdateStatus.ALL_REJECTED
            logger.warning("step %d: the correction rejected every token; no update", self.step)
        elif decision is not None and not decision.apply_update:
            status = UpdateStatus.GUARD
        else:
            self._clip(totals.grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * self.config.ess_step_size.scale(totals.ess_ratio)
            self.optimizer.step()
        if status is not UpdateStatus.APPLIED:
            self.skip_counts[status] += 1
        self.optimizer.zero_grad(set_to_none=True)
        return status

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` under the configured schedule."""
        c = self.config
        return c.lr * lr_factor(
            step,
            c.lr_schedule,
            warmup_steps=c.warmup_steps,
            schedule_steps=c.schedule_steps,
            min_lr_ratio=c.min_lr_ratio,
        )

    def _correct(self, batch: TrainBatch, old_logprobs: torch.Tensor) -> CorrectionResult:
        return self.correction(
            old_logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )

    def _update_pass(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        presplit: CorrectionResult | None,
        plan: CorrectionPlan,
    ) -> UpdatePass:
        """Forward, correction, unnormalized loss and backward of every micro-batch.

        Nothing here reads a device value on the host (except what a rejecting or
        importance-sampling correction needs for its data-dependent shapes): the loss sum,
        entropy sum and loss metrics accumulate on the device and are read once after.
        """
        dev = self.device
        on_device = {
            "sampler": batch.sampler_logprobs.to(dev),
            "loss_mask": batch.loss_mask.to(dev),
            "turn_ids": batch.turn_ids.to(dev),
            "advantages": advantages.to(dev),
        }
        if old_logprobs is not None:
            on_device["old"] = old_logprobs.to(dev)
        if presplit is not None:
            on_device["weights"] = presplit.weights.detach().float().to(dev)
            on_device["mask"] = presplit.loss_mask.to(dev)
        logprobs = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=dev)
        # loss, entropy and outside-the-kept-set count of the model tokens
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        rows: list[torch.Tensor] = []
        parts: list[tuple[torch.Tensor, CorrectionResult]] = []
        for mb in self.forward.matched(self.forward.plan(batch)):
            if mb is None:
                if self.reference is not None:
                    with torch.no_grad(), self.reference.forward_model() as reference:
                        self.forward.empty_pass(reference, backward=False)
                self.forward.empty_pass(self.model, backward=True)
                continue
            seqs = mb.seq_indices.to(dev)
            width = int(mb.dest_tok.max()) + 1 if len(mb.dest_tok) else 1
            # The update uses the logprobs of model tokens only: lm_head skips the rest.
            mb = mb.select_tokens(mb.token_mask(batch.loss_mask))
            dest = (mb.dest_seq.to(dev), mb.dest_tok.to(dev))
            ref = None
            if self.reference is not None:
                with torch.no_grad(), self.reference.forward_model() as reference:
                    ref_tokens = self.forward.token_stats(reference, mb, entropy=False).logprobs
                ref = torch.zeros(len(mb.seq_indices), width, device=dev, dtype=torch.float32)
                ref = ref.index_put(dest, ref_tokens)  # [b, width]
            stats = self.forward.token_stats(self.model, mb, entropy=True)
            token_logprobs, entropy = stats.logprobs, stats.entropy
            assert entropy is not None
            theta = torch.zeros(len(mb.seq_indices), width, device=dev, dtype=torch.float32)
            theta = theta.index_put(dest, token_logprobs)  # [b, width], carries grad
            logprobs[seqs[dest[0]], dest[1]] = token_logprobs.detach()
            sampler = on_device["sampler"][seqs, :width]
            model_mask = on_device["loss_mask"][seqs, :width]
            old = on_device["old"][seqs, :width] if old_logprobs is not None else theta.detach()
            if presplit is not None:
                weights, mask = on_device["weights"][seqs, :width], on_device["mask"][seqs, :width]
            else:
                turns = on_device["turn_ids"][seqs, :width]
                fixed = self.correction(old, sampler, model_mask, turns)
                parts.append((seqs, fixed))
                weights, mask = fixed.weights.detach(), fixed.loss_mask
            loss, loss_metrics = self.loss_fn(
                theta,
                old_logprobs=plan.proximal(old, sampler),
                advantages=on_device["advantages"][seqs],
                loss_mask=mask,
                weights=weights,
                ref_logprobs=ref,
                num_global_tokens=1,  # summed here; the gradient is divided after the loop
                num_global_sequences=1,
            )
            loss.backward()
            sums += torch.stack(
                [loss.detach().double(), entropy.sum().double(), stats.outside.sum().double()]
            )
            weight = (mask > 0).sum().float().reshape(1)
            rows.append(torch.cat([weight, loss_metrics.values.float()]))
        corrected = None
        if presplit is None:
            corrected = CorrectionResult.assemble(parts, batch.loss_mask, batch.turn_ids)
        return UpdatePass(logprobs.cpu(), sums, rows, corrected)

    def optimal_baseline(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """VCPO's advantages from each sequence's own weighted score gradient (one pass each).

        Returns the [B] advantages and the mean gap between a group's optimal baseline and its
        mean reward (`train/opob_baseline_gap`).
        """
        self.model.train()
        norms, log_ratios = sequence_gradient_norms(
            batch, self.forward, self.model, self.correction, self.device
        )
        self.optimizer.zero_grad(set_to_none=True)
        advantages, baseline = optimal_baseline_advantages(
            batch.rewards, batch.group_ids, norms, log_ratios
        )
        return advantages.float(), {"train/opob_baseline_gap": baseline_gap(batch, baseline)}

    def _clip(self, grad_norm: float) -> None:
        clip_gradients(self.model.parameters(), self.config.max_grad_norm, grad_norm)

    # ------------------------------------------------------------------ weights

    def rank0_full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded HF-named state dict (CPU) on rank 0, for the engine; `{}` elsewhere.

        Every rank must call it (it gathers shards). With LoRA it holds the merged weights
        W + scale·B A under the base model's names (`tir_rl.trainer.lora.merged_state_dict`):
        what the engine runs equals the trainer's effective weights.
        """
        if self.lora_enabled:
            return lora_ops.merged_state_dict(self.model)
        return tdist.full_model_state_dict(self.model)

    def hf_model(self) -> nn.Module:
        """The transformers model inside (under a `PeftModel` with LoRA).

        Its config and `save_pretrained` describe the base architecture.
        """
        return self.model.get_base_model() if self.lora_enabled else self.model
