"""FSDP2 policy trainer: logprob recompute, mismatch correction, GRPO update, weights for sync.

One `train_step` on each rank, on that rank's share of the global batch. Without
`old_logprobs` it makes one forward per micro-batch (the weights that would recompute ℓ^old
are the update's own, so ℓ^old = ℓ^θ detached)::

    micro-batch (packed) ──► forward ℓ_θ ──► ℓ_old := sg(ℓ_θ)
        │ sampler logprobs ℓ_μ ──► correction(ℓ_old, ℓ_μ) of its sequences ──► weights w, mask m′
        │ with a KL term: frozen reference, no-grad forward ──► ℓ_ref
        ▼
    GRPOLoss(ℓ_θ, ℓ_old, A, m′, w, ℓ_ref), summed (not normalized) ──► backward
    ...after the last micro-batch:
    batch ℓ_old ──► mismatch_metrics, correction stats ──► N = Σ m′ (tokens or sequences,
        all ranks) ──► gradients ÷ N
    grad norm (pre-clip, global) ──► non-finite? skip and count ──► guard? ──► clip ──► AdamW

With `old_logprobs` given (several optimizer steps on one batch), or with a correction that
normalizes weights over the batch (`batch_normalize`, recomputed with a no-grad pass first),
the whole batch is corrected before the loop and the micro-batches use its rows. The
correction is per sequence otherwise and a sequence is never split across micro-batches, so
both paths give the same update. Inside the loop nothing is read back to the host (loss,
entropy and loss metrics accumulate on the device), except what a rejecting or
importance-sampling correction needs for its data-dependent shapes.

Precision: parameters, gradients and AdamW state are float32 (master weights); `dtype` is
the compute dtype (autocast on one rank, FSDP2 `MixedPrecisionPolicy` when sharded);
logits are cast to float32 before the log-softmax, entropy and loss.

The trainer's logprob of completion token t comes from the logits at position t − 1 over the
full prompt + completion context (all turns), divided by the sampler's temperature, through
log_softmax in float32 (`token_stats`: rows in chunks, no float32 [n, V]
tensor). lm_head runs only at the positions whose logprob is used (`logits_to_keep`): every
completion token in `compute_logprobs`, the model tokens (loss mask 1) alone in the update
pass, since tool and rendered tokens enter neither the loss nor the mismatch metrics.

Sharding: with a process group of world size > 1, every decoder layer and then the root get
`fully_shard` (FSDP2), and gradients are summed (not averaged) across ranks because the
loss is already divided by the global normalizer. At world size 1 the model stays a plain
module (FSDP2 would only add overhead there). Ranks may hold different numbers of
micro-batches; the shorter ones run empty passes so the collectives stay matched.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from tir_rl import distributed as tdist
from tir_rl.cpu_cores import parse_cpu_list, pin_process
from tir_rl.errors import ConfigError, did_you_mean
from tir_rl.metric import Metric, ReduceOp
from tir_rl.mismatch import (
    BypassMode,
    CorrectionPlan,
    CorrectionResult,
    MismatchCorrection,
    correction,
    mismatch_metrics,
)
from tir_rl.mismatch.guard import CollapseGuard, GuardAction, GuardDecision
from tir_rl.models import resolve_model
from tir_rl.trainer import lora as lora_ops
from tir_rl.trainer.batch import MicroBatch, Packing, TrainBatch
from tir_rl.trainer.lora import LoRAConfig
from tir_rl.trainer.loss import GRPOLoss, PolicyLossMetrics
from tir_rl.trainer.lr_schedule import LRSchedule, check_schedule, lr_factor
from tir_rl.trainer.optimizer import build_adamw, clip_gradients, seed_everything
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.trainer.prefix_attention import register_prefix_attention
from tir_rl.trainer.reference import ReferencePolicy, load_reference
from tir_rl.trainer.token_stats import token_stats

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyLoss(Protocol):
    """What the trainer needs from a loss (`tir_rl.trainer.loss.GRPOLoss` fits)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        *,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        weights: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        num_global_tokens: int | None = None,
        num_global_sequences: int | None = None,
    ) -> tuple[torch.Tensor, PolicyLossMetrics]:
        """Return the globally normalized loss of a micro-batch and its metrics."""
        ...

    @property
    def needs_reference(self) -> bool:
        """Whether the loss takes `ref_logprobs` (a KL term to a frozen reference policy)."""
        ...

    def global_normalizer(self, *, num_tokens: int, num_sequences: int) -> int:
        """The global D the loss divides by, from the global token and sequence counts."""
        ...


@dataclass
class StepResult:
    """What one `train_step` did, or one `score_step` (a batch without learning signal)."""

    loss: float
    """Global loss (sum over micro-batches and ranks of the globally normalized loss); NaN
    for a scoring pass."""
    grad_norm: float
    """Global gradient L2 norm before clipping; NaN for a scoring pass."""
    skipped: bool
    """True when no optimizer step was applied (non-finite values, the guard, or a scoring
    pass, which never updates)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """`train/...` and `mismatch/...` metrics, identical on every rank (a scoring pass has the
    `mismatch/...` ones only)."""
    guard: GuardDecision | None = None
    """The collapse guard's verdict, when a guard was given."""
    logprobs: torch.Tensor | None = None
    """[B, T] float32 (CPU) trainer logprobs ℓ^old the step used: the given `old_logprobs`
    (as given: every completion token when they come from `compute_logprobs`), or, in the
    one-pass path, the update forward's own detached ℓ^θ of the model tokens (loss mask 1)
    only, 0 at tool/rendered tokens and past each completion's end (lm_head runs only where
    the update uses a logprob). Only loss-mask-1 values are meaningful to the mismatch
    metrics, the correction and the loss."""
    correction: CorrectionResult | None = None
    """This rank's rows as the update's correction left them (kept mask, importance weights);
    None for a scoring pass."""

    @property
    def stop(self) -> bool:
        """Whether the guard asked the loop to checkpoint and stop."""
        return self.guard is not None and self.guard.action is GuardAction.STOP


@dataclass
class _UpdatePass:
    """What the micro-batch loop of one step leaves behind."""

    logprobs: torch.Tensor
    """[B, T] float32 CPU, detached ℓ^θ of the model tokens (loss mask 1); 0 elsewhere."""
    sums: torch.Tensor
    """[2] float64 on the device: unnormalized loss sum, entropy sum over model tokens."""
    metric_names: list[str]
    metric_rows: list[torch.Tensor]
    """Per micro-batch, on the device: [1 + len(metric_names)], its loss-token count first."""


def _freeze_all_but(model: nn.Module, patterns: Sequence[str]) -> None:
    """Leave only the parameters whose names match one of `patterns` trainable (all if none)."""
    if not patterns:
        return
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"trainer.train_only pattern {pattern!r} matches no parameter of the model "
                f"(names look like {names[0]!r}).{did_you_mean(pattern, names)}"
            )
    for name, param in model.named_parameters():
        param.requires_grad_(any(fnmatch.fnmatchcase(name, p) for p in patterns))


class Trainer:
    """Holds the policy model and its optimizer on this rank; runs GRPO steps."""

    @dataclass(kw_only=True)
    class Config:
        """Trainer settings."""

        model: str = "tiny"
        """`bundled`, `tiny`, or a local Hugging Face checkpoint folder. In a run config, leave
        it unset: it follows the top-level `model` (another value is refused)."""
        lr: float = 1e-6
        """AdamW learning rate (the peak, when `lr_schedule` or `warmup_steps` shape it)."""
        lr_schedule: LRSchedule = LRSchedule.CONSTANT
        """`constant` or `cosine` (decay to `min_lr_ratio`·lr at `schedule_steps`); both
        start with `warmup_steps` of linear warm-up. Steps count `train_step` calls (RL steps
        with an update to make; see `tir_rl.trainer.lr_schedule`)."""
        warmup_steps: int = 0
        """Linear warm-up: step s < warmup_steps uses lr·(s + 1)/(warmup_steps + 1)."""
        schedule_steps: int = 0
        """cosine only: the step where the decay reaches `min_lr_ratio`·lr (warm-up
        included). 0 in a run config: `run.steps`."""
        min_lr_ratio: float = 0.0
        """cosine only: the final learning rate as a fraction of `lr`."""
        betas: tuple[float, float] = (0.9, 0.999)
        """AdamW betas."""
        eps: float = 1e-8
        """AdamW epsilon."""
        weight_decay: float = 0.0
        """AdamW decoupled weight decay."""
        max_grad_norm: float = 1.0
        """Clip the global gradient norm to this; 0 or less disables clipping."""
        micro_batch_tokens: int = 4096
        """Token budget of one forward/backward pass (padding included when not packed)."""
        temperature: float = 1.0
        """Sampling temperature; must equal the sampler's (logits are divided by it)."""
        dtype: Literal["float32", "bfloat16", "float16"] = "float32"
        """Compute dtype of the forward and backward passes. Parameters, gradients and the
        AdamW state stay float32 (master weights) whatever this is; bfloat16/float16 run the
        matrix products in that dtype (autocast on one rank, FSDP2 `MixedPrecisionPolicy`
        when sharded, gradients reduced in float32). Logprobs, entropy and loss are always
        float32. float16 gets no loss scaling: prefer bfloat16."""
        packing: Packing = Packing.SHARED_PREFIX
        """`shared_prefix` (packed, with each group's common prefix, its G samples' prompt,
        computed once for all of them by sdpa: the same logprobs, loss and gradient, 1.9-2.4x
        faster updates measured in docs/performance.md; needs `attn_implementation: sdpa`),
        `packed` (padding-free rows, every sequence whole), `bucketed` (length-sorted
        padded micro-batches) or `padded` (batch order, for comparison). On the CPU with
        sdpa, packed rows need an explicit mask, which sdpa serves with its math kernel (it
        keeps the L_row² attention probabilities per layer for backward): packing wins on
        the no-grad recompute, `bucketed` can win on the training pass
        (bench/trainer_packing.py, bench/shared_prefix.py)."""
        tf32: bool = False
        """CUDA only: let float32 matrix products use TF32 tensor cores (10-bit mantissa;
        about 2× float32 throughput). Off by default: float32 compute then means IEEE
        float32. Sets the process-wide `torch.set_float32_matmul_precision` ("high" when on,
        "highest" when off); refused on the CPU, which has no TF32."""
        cudnn_attention: bool = False
        """CUDA only: let sdpa use cuDNN's attention kernel. Off by default: cuDNN plans each
        new input shape on first use, and every training step brings new lengths. On an
        H100 (a 0.42B Llama in bfloat16, docs/scale.md) the update pass on fresh shapes ran
        2-3× slower with it than without; on shapes already seen the two were alike. Sets
        the process-wide `torch.backends.cuda.enable_cudnn_sdp`; refused on the CPU."""
        grad_checkpointing: bool = False
        """Recompute activations in backward to save memory."""
        attn_implementation: str = "sdpa"
        """transformers attention kernel; must honour position_ids packing (sdpa, flash)."""
        train_only: tuple[str, ...] = ()
        """Names of the parameters to train, as fnmatch patterns (`model.norm.weight`,
        `model.layers.2.*`); empty trains every parameter. The others stay frozen (no
        gradient, no optimizer state). A pattern that matches no parameter is refused."""
        reference_model: str = ""
        """The frozen reference policy of the KL penalty, loaded only when the loss has one
        (`loss.kl_coef > 0`; a run config refuses this field otherwise). Empty: the policy's
        starting weights (`model`), also on resume. Else `bundled`, `tiny`, `lab` or a local
        checkpoint folder with the policy's vocabulary. Under LoRA (`init: default`) the
        default reference is the policy with its adapters disabled (no second copy in
        memory); otherwise, PiSSA included, it is a frozen float32 copy, sharded like the
        policy under FSDP2."""
        lora: LoRAConfig = field(default_factory=LoRAConfig)
        """LoRA adapters (`peft`, the `tir-rl[lora]` extra): only the adapters train, and the
        engine gets the merged weights. Off unless `trainer.lora.enabled`."""
        seed: int | None = None
        """Seeds python, numpy and torch at construction (plus the rank). None: `run.seed` in
        a run config, 0 for a trainer built alone."""
        device: str = "auto"
        """`auto` (CUDA when available, else CPU), `cpu`, `cuda`, or `cuda:N`."""
        cpu_cores: str | int | None = None
        """On a CPU: the cores the trainer's process runs on, e.g. `1` or `2-3`; its torch
        threads are as many (shared by the node's ranks). Pinned once the engine has
        started, so the engine keeps its own cores (`engine.cpu_cores`; docs/async.md).
        None: every core, `OMP_NUM_THREADS` torch threads. Refused with a CUDA trainer."""

        def validate(self) -> None:
            """Check values a user can get wrong."""
            if self.temperature <= 0:
                raise ConfigError(f"trainer.temperature must be > 0, got {self.temperature}.")
            if self.micro_batch_tokens <= 0:
                raise ConfigError("trainer.micro_batch_tokens must be positive.")
            if self.lr < 0:
                raise ConfigError(f"trainer.lr must be >= 0, got {self.lr}.")
            if self.cpu_cores is not None:
                parse_cpu_list(self.cpu_cores, setting="trainer.cpu_cores")
            if self.packing is Packing.SHARED_PREFIX and self.attn_implementation != "sdpa":
                raise ConfigError(
                    f"trainer.packing shared_prefix computes its attention with sdpa "
                    f"(tir_rl.trainer.prefix_attention); trainer.attn_implementation is "
                    f"{self.attn_implementation!r}. Set trainer.attn_implementation sdpa, or "
                    "another packing."
                )
            self.lora.validate()
            if self.lora.enabled and self.train_only:
                raise ConfigError(
                    "trainer.lora.enabled and trainer.train_only both choose what trains: LoRA "
                    "freezes every base weight and trains its adapters, train_only trains base "
                    "weights in full (which the adapter checkpoint would not hold). Set one."
                )
            check_schedule(
                self.lr_schedule,
                warmup_steps=self.warmup_steps,
                schedule_steps=self.schedule_steps,
                min_lr_ratio=self.min_lr_ratio,
            )

    def __init__(
        self,
        config: Trainer.Config | None = None,
        *,
        loss_fn: PolicyLoss | None = None,
        correction_config: MismatchCorrection.Config | None = None,
    ) -> None:
        """Load the model, shard it when a multi-rank process group exists, build AdamW.

        Args:
            config: trainer settings.
            loss_fn: the policy loss; defaults to `GRPOLoss()` with its default config.
            correction_config: mismatch correction; defaults to metrics only (no correction).
        """
        from transformers import AutoModelForCausalLM

        self.config = config or Trainer.Config()
        self.config.validate()
        self.lr_at(0)  # refuse a schedule that cannot run (cosine without its length) now
        seed_everything((self.config.seed or 0) + tdist.rank())
        self.device = _pick_device(self.config.device)
        if self.config.tf32 and self.device.type != "cuda":
            raise ConfigError(
                f"trainer.tf32 is for CUDA float32 matrix products; the trainer runs on "
                f"{self.device}. Set trainer.tf32 false (or trainer.device cuda)."
            )
        if self.config.cudnn_attention and self.device.type != "cuda":
            raise ConfigError(
                f"trainer.cudnn_attention chooses a CUDA attention kernel; the trainer runs on "
                f"{self.device}. Set trainer.cudnn_attention false (or trainer.device cuda)."
            )
        if self.config.cpu_cores is not None:
            self._pin_to_cores(self.config.cpu_cores)
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high" if self.config.tf32 else "highest")
            torch.backends.cuda.enable_cudnn_sdp(self.config.cudnn_attention)
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
        _freeze_all_but(model, self.config.train_only)
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
            _apply_fsdp2(model, self.compute_dtype)
        self.model: nn.Module = model
        self.reference: ReferencePolicy | None = None
        """The frozen policy of the loss's KL term; None when the loss has none."""
        if reference_record is not None:
            if reference_weights is None:  # LoRA: the base weights, adapters off
                self.reference = ReferencePolicy(model, reference_record)
            else:
                reference_weights.to(self.device)
                if self.sharded:
                    _apply_fsdp2(reference_weights, self.compute_dtype)
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
        self.correction_config = correction_config or MismatchCorrection.Config()
        if self.correction_config.bypass is BypassMode.REINFORCE:  # a run refuses it at load
            raise ConfigError(
                "correction.bypass='reinforce' needs per-micro-batch weights from ℓ^θ, which "
                "Trainer does not implement; use bypass 'off' or 'ppo_clip'."
            )
        self.step = 0
        """Number of train_step calls so far (applied or skipped); the schedule's step."""
        self.num_skipped_nonfinite = 0
        self.num_skipped_guard = 0
        self.num_skipped_rejected = 0
        """Steps whose correction rejected every token (no optimizer step was made)."""

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
            return self._score(batch, self.model)
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
            return self._score(batch, reference)

    def _score(self, batch: TrainBatch, model: nn.Module) -> torch.Tensor:
        """[B, T] float32 CPU logprobs of `batch` under `model` (grad mode as the caller's)."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        micro_batches = self._plan(batch)
        for mb in self._matched(micro_batches):
            if mb is None:
                self._empty_pass(model, backward=False)
                continue
            logprobs = self._forward_token_stats(mb, entropy=False, model=model)[0].float().cpu()
            out[mb.seq_indices[mb.dest_seq], mb.dest_tok] = logprobs
        return out

    def _plan(self, batch: TrainBatch) -> list[MicroBatch]:
        return plan_micro_batches(batch, self.config.micro_batch_tokens, self.config.packing)

    def _matched(self, micro_batches: list[MicroBatch]) -> list[MicroBatch | None]:
        """Pad the list with None so every rank runs the same number of passes."""
        num = tdist.all_reduce_count(len(micro_batches), tdist.ReduceOp.MAX)
        return [*micro_batches, *([None] * (num - len(micro_batches)))]

    def _forward_token_stats(
        self, mb: MicroBatch, *, entropy: bool, model: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[n] token logprobs under `model` (grad if enabled) and, if asked, [n] entropies.

        `model` is the policy (None) or the reference: both run the same code, so the
        reference gets the policy's layout, temperature and compute dtype.
        """
        model = self.model if model is None else model
        keep = torch.unique(mb.pred_pos)  # sorted; the decoder hands lm_head these columns
        column = torch.searchsorted(keep, mb.pred_pos)
        head = model.get_output_embeddings()
        # A shared-prefix layout reaches every attention layer (`prefix_attention`).
        layout = (
            {} if mb.prefix_layout is None else {"prefix_layout": mb.prefix_layout.to(self.device)}
        )
        with self._autocast(), _score_only(head, mb.row.to(self.device), column.to(self.device)):
            output = model(
                input_ids=mb.input_ids.to(self.device),
                position_ids=mb.position_ids.to(self.device),
                logits_to_keep=keep.to(self.device),
                use_cache=False,
                **layout,
            )
        logits = output.logits.squeeze(0)  # [n, V], one row per token, in the micro-batch's order
        token_logprobs, _, token_entropy = token_stats(
            logits, mb.targets.to(self.device), temperature=self.config.temperature,
            entropy=entropy,
        )  # fmt: skip
        return token_logprobs, token_entropy

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """Run the forward in the compute dtype over float32 parameters (one rank only).

        Sharded, FSDP2's `MixedPrecisionPolicy` casts the gathered parameters instead.
        """
        if self.compute_dtype == torch.float32 or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _empty_pass(self, model: nn.Module, *, backward: bool) -> None:
        """A one-token pass of `model` contributing nothing, to keep FSDP collectives matched."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        with self._autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    # ------------------------------------------------------------------ training

    def score_step(self, batch: TrainBatch, *, guard: CollapseGuard | None = None) -> StepResult:
        """Score a batch that carries no learning signal, and let the guard watch it.

        A step whose groups are all degenerate makes no update, but its sampler can be as far
        from the trainer as ever (a sampler so wrong that no rollout scores is the extreme
        case), so the mismatch metrics are measured and checked like an update's. Nothing is
        skipped (there is no update); a guard's `stop` still ends the run.

        Returns:
            A skipped `StepResult` with NaN loss and gradient norm, the global `mismatch/...`
            metrics, the guard's decision, and `compute_logprobs(batch)` as `logprobs`.
        """
        logprobs = self.compute_logprobs(batch)
        metrics = mismatch_metrics(
            logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )
        metrics = tdist.all_reduce_metrics(metrics)
        decision = None
        if guard is not None:
            decision = guard.check(self.step, metrics, batch=batch.tensors(), rank=tdist.rank())
        return StepResult(math.nan, math.nan, True, metrics, decision, logprobs)

    def train_step(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        *,
        old_logprobs: torch.Tensor | None = None,
        guard: CollapseGuard | None = None,
    ) -> StepResult:
        """One optimizer step on this rank's share of the global batch.

        Without `old_logprobs` the step makes one forward per micro-batch: with one optimizer
        step per batch the weights that would recompute ℓ^old are the update's own, so
        ℓ^old = ℓ^θ detached. Each micro-batch's sequences are corrected on their own (the
        correction is per sequence) and their loss is summed unnormalized; the gradient is
        divided by the global normalizer once it is known, after the last micro-batch. A
        correction with `batch_normalize` needs the whole batch's weights first, so it keeps
        the two-pass path (no-grad recompute, then the update).

        Args:
            batch: this rank's sequences.
            advantages: [B] GRPO advantage per sequence.
            old_logprobs: [B, T] trainer logprobs under the weights that sampled the batch;
                pass them to reuse one recompute over several steps on the same batch.
            guard: collapse guard consulted before the update is applied.

        Returns:
            The loss, pre-clip gradient norm, whether the step was skipped, metrics, and the
            ℓ^old used ([B, T] float32 on the CPU; in the one-pass path only the model
            tokens' entries are filled, 0 elsewhere: see `StepResult.logprobs`).
        """
        t_start = time.perf_counter()
        advantages = advantages.detach().float().cpu()
        if advantages.shape != (batch.num_sequences,):
            raise ConfigError(
                f"advantages must have shape [{batch.num_sequences}], got {tuple(advantages.shape)}"
            )
        plan = self.correction_config.plan()
        presplit = None
        if old_logprobs is None and plan.whole_batch_first:
            old_logprobs = self.compute_logprobs(batch)
        if old_logprobs is not None:  # two-pass: correct the whole batch before the loop
            old_logprobs = old_logprobs.detach().float().cpu()
            presplit = self._correct(batch, old_logprobs)
        t_logprobs = time.perf_counter()

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        update = self._update_pass(batch, advantages, old_logprobs, presplit, plan)
        t_backward = time.perf_counter()

        if old_logprobs is None:
            old_logprobs = update.logprobs
        # The batch's metrics and stats, from the same ℓ^old as the micro-batches used.
        metrics = mismatch_metrics(
            old_logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )
        corrected = presplit if presplit is not None else self._correct(batch, old_logprobs)
        mask = corrected.loss_mask.bool()
        metrics.update(corrected.stats.to_dict())
        t_mismatch = time.perf_counter()

        num_tokens = tdist.all_reduce_count(int(mask.sum()))
        num_sequences = tdist.all_reduce_count(int(mask.any(dim=-1).sum()))
        normalizer = self.loss_fn.global_normalizer(
            num_tokens=num_tokens, num_sequences=num_sequences
        )
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(normalizer)
        local = update.sums.tolist()  # the one host read of the loop's device accumulators
        total_loss = tdist.all_reduce_scalar(local[0]) / normalizer
        entropy_sum = tdist.all_reduce_scalar(local[1])
        loss_metrics = _combine_micro_metrics(update.metric_names, update.metric_rows)
        num_model_tokens = tdist.all_reduce_count(int(batch.loss_mask.sum()))
        grad_norm = float(tdist.grad_norm(self.model.parameters()))
        metrics.update(loss_metrics)
        if self.reference is None:
            metrics.pop("train/ref_kl", None)  # no reference: no KL to it (not a KL of 0)
        metrics = tdist.all_reduce_metrics(metrics)
        metrics.pop("train/num_tokens", None)  # the same count as train/num_loss_tokens
        finite = math.isfinite(total_loss) and math.isfinite(grad_norm)
        metrics.update(
            {
                "train/loss": total_loss,
                "train/grad_norm": grad_norm,
                "train/entropy": entropy_sum / num_model_tokens if num_model_tokens else 0.0,
                "train/num_loss_tokens": float(num_tokens),
                "train/num_loss_sequences": float(num_sequences),
                "train/num_masked_by_correction": float(
                    tdist.all_reduce_count(int(batch.loss_mask.sum()) - int(mask.sum()))
                ),
            }
        )

        lr = self.lr_at(self.step)
        decision = None
        if guard is not None:
            decision = guard.check(
                self.step, metrics, batch=batch.tensors() | {"advantages": advantages},
                rank=tdist.rank(),
            )  # fmt: skip
        skipped = True
        if not finite:
            self.num_skipped_nonfinite += 1
            logger.warning("step %d: non-finite loss or gradient; update skipped", self.step)
        elif num_tokens == 0:
            # The correction rejected every token: the gradient is zero, but AdamW would still
            # move the weights (momentum, weight decay). Nothing was learned: no step.
            self.num_skipped_rejected += 1
            logger.warning("step %d: the correction rejected every token; no update", self.step)
        elif decision is not None and not decision.apply_update:
            self.num_skipped_guard += 1
        else:
            self._clip(grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            skipped = False
        self.optimizer.zero_grad(set_to_none=True)
        t_end = time.perf_counter()

        num_tokens_computed = tdist.all_reduce_count(batch.num_tokens)
        metrics.update(
            {
                "train/skipped": float(skipped),
                "train/lr": lr,
                "train/skipped_nonfinite": float(self.num_skipped_nonfinite),
                "train/skipped_guard": float(self.num_skipped_guard),
                "train/skipped_all_rejected": float(self.num_skipped_rejected),
                "train/logprob_s": t_logprobs - t_start,
                "train/backward_s": t_backward - t_logprobs,
                "train/mismatch_s": t_mismatch - t_backward,
                "train/step_s": t_end - t_start,
                "train/tokens_per_s": num_tokens_computed / max(t_end - t_start, 1e-9),
            }
        )
        self.step += 1
        return StepResult(
            total_loss, grad_norm, skipped, metrics, decision, old_logprobs, corrected
        )

    def _pin_to_cores(self, cpu_list: str | int) -> None:
        if self.device.type != "cpu":
            raise ConfigError(
                f"trainer.cpu_cores={cpu_list!r} pins a CPU trainer; this one runs on "
                f"{self.device}. Leave it unset (pin a GPU run's host with taskset or numactl)."
            )
        cores = parse_cpu_list(cpu_list, setting="trainer.cpu_cores")
        pin_process(cores)
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, len(cores) // ranks_here))
        logger.info(
            "trainer pinned to cores %s, %d torch threads", cpu_list, torch.get_num_threads()
        )

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
        return correction(
            old_logprobs,
            batch.sampler_logprobs,
            batch.loss_mask,
            batch.turn_ids,
            self.correction_config,
        )

    def _update_pass(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        presplit: CorrectionResult | None,
        plan: CorrectionPlan,
    ) -> _UpdatePass:
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
        sums = torch.zeros(2, dtype=torch.float64, device=dev)  # loss, entropy of mask-1 tokens
        names: list[str] = []
        rows: list[torch.Tensor] = []
        for mb in self._matched(self._plan(batch)):
            if mb is None:
                if self.reference is not None:
                    with torch.no_grad(), self.reference.forward_model() as reference:
                        self._empty_pass(reference, backward=False)
                self._empty_pass(self.model, backward=True)
                continue
            seqs = mb.seq_indices.to(dev)
            width = int(mb.dest_tok.max()) + 1 if len(mb.dest_tok) else 1
            # The update uses the logprobs of model tokens only: lm_head skips the rest.
            mb = mb.select_tokens(mb.token_mask(batch.loss_mask))
            dest = (mb.dest_seq.to(dev), mb.dest_tok.to(dev))
            ref = None
            if self.reference is not None:
                with torch.no_grad(), self.reference.forward_model() as reference:
                    ref_tokens = self._forward_token_stats(mb, entropy=False, model=reference)[0]
                ref = torch.zeros(len(mb.seq_indices), width, device=dev, dtype=torch.float32)
                ref = ref.index_put(dest, ref_tokens)  # [b, width]
            token_logprobs, entropy = self._forward_token_stats(mb, entropy=True)
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
                weights, mask = plan.weights_and_mask(old, sampler, model_mask, turns)
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
            sums += torch.stack([loss.detach().double(), entropy.sum().double()])
            names, row = _metric_row(loss_metrics)
            weight = (mask > 0).sum().float().reshape(1)
            rows.append(torch.cat([weight, row.float()]))
        return _UpdatePass(logprobs.cpu(), sums, names, rows)

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


@contextlib.contextmanager
def _score_only(head: nn.Module, rows: torch.Tensor, columns: torch.Tensor) -> Iterator[None]:
    """Make `head` (lm_head) score only hidden[rows, columns]: logits [1, n, V].

    `logits_to_keep` keeps the union of the rows' columns, so with several packed rows
    lm_head would score rows × union positions, most of them never read; gathering its input
    first scores exactly the n tokens. A forward pre-hook keeps this inside the model's own
    forward, where FSDP2 has the head's weight gathered, and leaves the state dict unchanged.
    """

    def gather(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0][rows, columns][None], *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def _metric_row(metrics: PolicyLossMetrics) -> tuple[list[str], torch.Tensor]:
    """A loss's metrics as names and one tensor (no host copy)."""
    return metrics.names(), metrics.values


def _combine_micro_metrics(names: list[str], rows: list[torch.Tensor]) -> dict[str, Metric]:
    """The loss metrics of this rank's micro-batches, combined as each declares.

    Each row is [loss-token count, *metrics]; micro-batches without tokens are ignored.
    Means are token-weighted; `train/num_tokens`, this rank's total, weighs its means and
    bounds its extremes across ranks.
    """
    if not rows:
        return {}
    table = torch.stack([row.cpu() for row in rows]).tolist()
    total = sum(row[0] for row in table)
    over = "train/num_tokens"
    out: dict[str, Metric] = {over: Metric.count(total)}
    reductions = PolicyLossMetrics.reductions()
    for column, (key, reduce) in enumerate(zip(names, reductions, strict=True), start=1):
        if reduce is None or reduce is ReduceOp.SUM:  # the loss; the count (above)
            continue
        values = [(row[0], row[column]) for row in table if row[0] > 0]
        if not values:
            continue
        name = _train_key(key)
        if reduce is ReduceOp.MAX:
            out[name] = Metric.max(max(v for _, v in values), over)
        elif reduce is ReduceOp.MIN:
            out[name] = Metric.min(min(v for _, v in values), over)
        else:
            out[name] = Metric.mean(sum(w * v for w, v in values) / max(total, 1e-12), over)
    return out


def _train_key(key: str) -> str:
    return key if key.startswith("train/") else f"train/{key.split('/', 1)[-1]}"


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but CUDA is not available; use 'cpu'.")
    return device


def _apply_fsdp2(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """fully_shard every decoder layer, then the root; gradients summed across ranks.

    Parameters stay float32 shards (the optimizer's masters); they are gathered in
    `compute_dtype` and gradients are reduced in float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(
            f"Cannot find decoder layers of {type(model).__name__} to shard "
            "(its `_no_split_modules` names none of its submodules)."
        )
    for module in [*layers, model]:
        fully_shard(module, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
