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
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import nn

from tir_rl import distributed as tdist
from tir_rl.cpu_cores import parse_cpu_list, pin_process
from tir_rl.errors import ConfigError, did_you_mean
from tir_rl.metric import Metric
from tir_rl.mismatch import (
    BypassMode,
    CorrectionPlan,
    CorrectionResult,
    MismatchCorrection,
    correction,
    mismatch_metrics,
)
from tir_rl.mismatch.guard import CollapseGuard, GuardDecision
from tir_rl.models import resolve_model
from tir_rl.trainer import lora as lora_ops
from tir_rl.trainer.batch import MicroBatch, Packing, TrainBatch
from tir_rl.trainer.lora import LoRAConfig
from tir_rl.trainer.loss import LOSS_TOKENS, GRPOLoss, PolicyLossMetrics
from tir_rl.trainer.lr_schedule import LRSchedule, check_schedule, lr_factor
from tir_rl.trainer.optimizer import build_adamw, clip_gradients, seed_everything
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.trainer.prefix_attention import register_prefix_attention
from tir_rl.trainer.reference import ReferencePolicy, load_reference
from tir_rl.trainer.step_result import (
    SKIP_COUNTS,
    StepResult,
    UpdateStatus,
    combine_loss_metrics,
    update_columns,
)
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
class _UpdatePass:
    """What the micro-batch loop of one step leaves behind."""

    logprobs: torch.Tensor
    """[B, T] float32 CPU, detached ℓ^θ of the model tokens (loss mask 1); 0 elsewhere."""
    sums: torch.Tensor
    """[2] float64 on the device: unnormalized loss sum, entropy sum over model tokens."""
    metric_rows: list[torch.Tensor]
    """Per micro-batch, on the device: [1 + len(LOSS_METRICS)], its loss-token count first."""


@dataclass
class _Totals:
    """The step's global figures, identical on every rank."""

    loss: float
    grad_norm: float
    num_loss_tokens: int
    num_tokens_computed: int
    """Every token of the ranks' batches (prompt, completion, padding the packer kept)."""
    metrics: dict[str, float]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class _Clock:
    """Seconds since the step started, at the marks of its stages."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        self.marks[stage] = time.perf_counter()

    def metrics(self) -> dict[str, float]:
        """`train/<stage>_s` for each stage (from the previous mark) and `train/step_s`."""
        out, previous = {}, self.start
        for stage, at in self.marks.items():
            out[f"train/{stage}_s"] = at - previous
            previous = at
        out["train/step_s"] = previous - self.start
        return out


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
        temperature: float | None = 1.0
        """The sampler's temperature, which the trainer divides its logits by. In a run
        config it is null and follows `rollout.temperature` (set it there); a value that
        differs is refused."""
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
            if self.temperature is not None and self.temperature <= 0:
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
        if self.config.temperature is None:
            raise ConfigError(
                "trainer.temperature is unset (null follows rollout.temperature in a run "
                "config): give a trainer built alone the sampler's temperature."
            )
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
        self.skip_counts: Counter[UpdateStatus] = Counter()
        """How many steps ended with each `SKIP_COUNTS` status (kept in checkpoints)."""
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
            decision = guard.check(self.step, metrics, batch=batch.tensors(), rank=tdist.rank())
        return StepResult(math.nan, math.nan, UpdateStatus.SCORED, metrics, decision, logprobs)

    def train_step(
        self,
        batch: TrainBatch,
        advantages: torch.Tensor,
        *,
        old_logprobs: torch.Tensor | None = None,
        guard: CollapseGuard | None = None,
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

        Returns:
            Its status, global loss, pre-clip gradient norm, metrics, and the ℓ^old used
            (see `StepResult.logprobs`).
        """
        clock = _Clock()
        advantages = _checked_advantages(batch, advantages)
        plan = self.correction_config.plan()
        old_logprobs, presplit = self._whole_batch_first(batch, old_logprobs, plan)
        clock.mark("logprob")

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        update = self._update_pass(batch, advantages, old_logprobs, presplit, plan)
        clock.mark("backward")

        old_logprobs = old_logprobs if old_logprobs is not None else update.logprobs
        corrected = presplit if presplit is not None else self._correct(batch, old_logprobs)
        local = mismatch_metrics(
            old_logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )
        local.update(corrected.stats.to_dict())
        local.update(combine_loss_metrics(update.metric_rows))
        clock.mark("mismatch")

        totals = self._global_totals(batch, corrected, update, local)
        decision = None
        if guard is not None:
            watched = totals.metrics | update_columns(totals.loss, totals.grad_norm)
            batch_tensors = batch.tensors() | {"advantages": advantages}
            decision = guard.check(self.step, watched, batch=batch_tensors, rank=tdist.rank())
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

    def _step_columns(self, totals: _Totals, clock: _Clock, lr: float) -> dict[str, float]:
        """The step's timings, rate, learning rate and the trainer's skip counts so far."""
        columns = clock.metrics()
        columns["train/lr"] = lr
        columns["train/tokens_per_s"] = totals.num_tokens_computed / max(
            columns["train/step_s"], 1e-9
        )
        for counted in SKIP_COUNTS:
            columns[f"train/{counted}"] = float(self.skip_counts[counted])
        return columns

    def _global_totals(
        self,
        batch: TrainBatch,
        corrected: CorrectionResult,
        update: _UpdatePass,
        local: dict[str, Metric],
    ) -> _Totals:
        """Divide the gradients by the global normalizer; reduce the figures over the ranks.

        The counts and sums go in one collective, the metrics in `all_reduce_metrics`.
        """
        kept = corrected.loss_mask.bool()
        loss_sum, entropy_sum = update.sums.tolist()  # the loop's one host read
        model_tokens = int(batch.loss_mask.sum())
        global_sums = tdist.all_reduce_tensor(
            torch.tensor(
                [
                    int(kept.sum()),
                    int(kept.any(dim=-1).sum()),
                    model_tokens,
                    model_tokens - int(kept.sum()),
                    batch.num_tokens,
                    loss_sum,
                    entropy_sum,
                ],
                dtype=torch.float64,
            )
        ).tolist()
        num_tokens, num_sequences, num_model_tokens, num_masked, num_computed = (
            int(v) for v in global_sums[:5]
        )
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
        metrics.update(
            {
                "train/entropy": global_sums[6] / num_model_tokens if num_model_tokens else 0.0,
                "train/num_loss_tokens": float(num_tokens),
                "train/num_loss_sequences": float(num_sequences),
                "train/num_masked_by_correction": float(num_masked),
            }
        )
        return _Totals(global_sums[5] / normalizer, grad_norm, num_tokens, num_computed, metrics)

    def _apply_or_skip(
        self, totals: _Totals, decision: GuardDecision | None, lr: float
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
                group["lr"] = lr
            self.optimizer.step()
        if status is not UpdateStatus.APPLIED:
            self.skip_counts[status] += 1
        self.optimizer.zero_grad(set_to_none=True)
        return status

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
            weight = (mask > 0).sum().float().reshape(1)
            rows.append(torch.cat([weight, loss_metrics.values.float()]))
        return _UpdatePass(logprobs.cpu(), sums, rows)

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


def _checked_advantages(batch: TrainBatch, advantages: torch.Tensor) -> torch.Tensor:
    advantages = advantages.detach().float().cpu()
    if advantages.shape != (batch.num_sequences,):
        raise ConfigError(
            f"advantages must have shape [{batch.num_sequences}], got {tuple(advantages.shape)}"
        )
    return advantages


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
