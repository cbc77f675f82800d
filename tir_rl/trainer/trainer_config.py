"""The trainer's settings: `Trainer.Config`, the `trainer` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tir_rl.errors import ConfigError
from tir_rl.process.cpu_cores import parse_cpu_list
from tir_rl.trainer.batch import Packing
from tir_rl.trainer.ess_step import ESSStepSize
from tir_rl.trainer.lora import LoRAConfig
from tir_rl.trainer.lr_schedule import LRSchedule, check_schedule


@dataclass(kw_only=True)
class TrainerConfig:
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
    kernels: Literal["torch", "vllm_cpu", "batch_invariant"] = "torch"
    """The ops of the trainer's forward. `torch`: transformers' model as it is. `vllm_cpu`:
    vLLM-CPU's own rotary embedding, attention kernel and oneDNN matrix products
    (`tir_rl.trainer.vllm_cpu_kernels`), with a plain-torch backward, so that the
    trainer's logprobs equal a float32 vLLM-CPU sampler's bit for bit wherever the
    engine's decode steps equal its own prefill (measured on the tiny and the trained lab
    model, not on the bundled one: docs/mismatch.md). CPU, float32, one rank, no LoRA,
    and a packing other than shared_prefix. `batch_invariant`: CUDA, vLLM's batch-invariant
    mode in the trainer and the local engine (`tir_rl.trainer.batch_invariant_kernels`;
    needs vLLM where the trainer runs, eager attention and a packing other than
    shared_prefix). Untested: no GPU with vLLM was available to this project."""
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
    replay_kept_set: bool = True
    """With truncated sampling (`rollout.top_p`, `top_k`, `min_p`), normalize the trainer's
    logprobs over the kept set the sampler drew from, replayed from the trainer's logits.
    false scores the whole vocabulary, so that every ratio carries the position's kept mass:
    a control for measuring that bias (bench/truncated_sampling.py), not a way to train."""
    optimal_baseline: bool = False
    """VCPO's off-policy optimal baseline: each group's advantages (R − b)/σ with b the group's
    rewards weighted by ‖g_i‖²·w_i² (`tir_rl.trainer.optimal_baseline`) instead of the
    advantages rank 0 computed. Costs one extra forward and backward per sequence (the exact
    per-sequence gradient norms); one rank, no `correction.batch_normalize`."""
    ess_step_size: ESSStepSize = field(default_factory=ESSStepSize)
    """VCPO's learning rate scaled by the step's effective sample size (off by default;
    `tir_rl.trainer.ess_step`)."""
    seed: int | None = None
    """Seeds python, numpy and torch at construction (plus the rank). None: `run.seed` in
    a run config, 0 for a trainer built alone."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda`, or `cuda:N`."""
    cpu_cores: str | int | None = None
    """On a CPU: the cores the trainer's process runs on, e.g. `1` or `2-3`; its torch
    threads are as many (shared by the node's ranks). Pinned once the engine has
    started, so the engine keeps its own cores (`engine.local.cpu_cores`; docs/async.md).
    None: every core, `OMP_NUM_THREADS` torch threads. Refused with a CUDA trainer."""

    def _check_vllm_cpu_kernels(self) -> None:
        clashes = {
            "trainer.packing": self.packing is Packing.SHARED_PREFIX and "shared_prefix",
            "trainer.dtype": self.dtype != "float32" and self.dtype,
            "trainer.device": self.device not in ("auto", "cpu") and self.device,
            "trainer.lora.enabled": self.lora.enabled and "true",
        }
        _refuse_clashes(
            clashes,
            "trainer.kernels vllm_cpu computes the forward with vLLM-CPU's float32 ops on one "
            "CPU rank, every sequence whole",
            "trainer.packing packed, trainer.dtype float32, trainer.device cpu and no LoRA, or "
            "trainer.kernels torch.",
        )

    def _check_batch_invariant_kernels(self) -> None:
        clashes = {
            "trainer.packing": self.packing is Packing.SHARED_PREFIX and "shared_prefix",
            "trainer.attn_implementation": self.attn_implementation != "eager"
            and self.attn_implementation,
            "trainer.device": self.device == "cpu" and "cpu",
        }
        _refuse_clashes(
            clashes,
            "trainer.kernels batch_invariant runs attention as batch-invariant matrix products "
            "on CUDA, every sequence whole",
            "trainer.packing packed, trainer.attn_implementation eager and a CUDA device, or "
            "trainer.kernels torch (on a CPU: vllm_cpu).",
        )

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
        if self.kernels == "vllm_cpu":
            self._check_vllm_cpu_kernels()
        if self.kernels == "batch_invariant":
            self._check_batch_invariant_kernels()
        if self.packing is Packing.SHARED_PREFIX and self.attn_implementation != "sdpa":
            raise ConfigError(
                f"trainer.packing shared_prefix computes its attention with sdpa "
                f"(tir_rl.trainer.prefix_attention); trainer.attn_implementation is "
                f"{self.attn_implementation!r}. Set trainer.attn_implementation sdpa, or "
                "another packing."
            )
        self.lora.validate()
        self.ess_step_size.validate()
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


def _refuse_clashes(clashes: dict[str, str | bool], needs: str, fix: str) -> None:
    """Raise `ConfigError` naming every setting in `clashes` whose value is truthy."""
    given = {k: v for k, v in clashes.items() if v}
    if given:
        listed = ", ".join(f"{k} {v}" for k, v in given.items())
        raise ConfigError(f"{needs}; this config has {listed}. Set {fix}")
