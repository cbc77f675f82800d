"""Per-token statistics of a policy's logits: logprob of the sampled token, logsumexp, entropy.

The trainer scores every kept position against a full-vocabulary softmax. At a small model's
scale that softmax, not the matrix products, is most of a step (49,152 columns per token for
the bundled tokenizer), so it is computed in float32 `chunk_rows` rows at a time and, with
gradients, by `_TargetLogprob`: one autograd node over the whole [n, V] logits whose
backward writes the gradient chunk by chunk into one buffer. Chunking through autograd
instead (a slice per chunk) gives every chunk's backward a zero-filled [n, V] gradient of
its own; on the lab model that was half the update's time.

With truncated sampling (`SamplingTruncation`: min-p, top-k, top-p) the softmax runs over the
kept set the sampler drew from, replayed from these logits, so that the trainer's logprob is
normalized as the sampler's processed logprob is; a sampled token the replay leaves out (the
two sides' logits differ at the boundary) is kept anyway and counted (`TokenStats.outside`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from tir_rl.engine.truncation import SamplingTruncation


class TokenStats(NamedTuple):
    """Per-token statistics of n scored positions."""

    logprobs: torch.Tensor
    """[n] float32 logprob of the target, differentiable when the logits are."""
    lse: torch.Tensor
    """[n] float32 logsumexp of the scaled logits over the kept set (no gradient)."""
    entropy: torch.Tensor | None
    """[n] float32 entropy (nats) of the (kept) distribution, when asked."""
    outside: torch.Tensor
    """[n] bool: the target lay outside the replayed kept set (always False untruncated)."""


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    entropy: bool = False,
    truncation: SamplingTruncation | None = None,
) -> TokenStats:
    """Statistics of softmax(logits / temperature) for each row of `logits` [n, V].

    Returns the [n] float32 logprob of `targets` [n] (differentiable when `logits` requires
    grad), the [n] logsumexp of the scaled logits, when `entropy` the [n] entropy in nats, and
    which targets fell outside the kept set. Equal to `log_softmax(logits.float() /
    temperature)` at the targets, values and gradients, whatever the logits' dtype (over the
    kept set of `truncation` when it cuts anything); no float32 [n, V] tensor is made, and
    autograd keeps only the logits themselves.
    """
    cut = truncation if truncation is not None and truncation.active else None
    if logits.shape[0] == 0:
        empty = logits.new_zeros(0, dtype=torch.float32)
        none = torch.zeros(0, dtype=torch.bool, device=logits.device)
        return TokenStats(empty + logits.float().sum() * 0, empty, empty if entropy else None, none)
    logprobs, lse, ent, outside = _TargetLogprob.apply(
        logits, targets, temperature, chunk_rows, entropy, cut
    )
    return TokenStats(logprobs, lse, ent if entropy else None, outside)


def chunked_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] log-softmax of `logits / temperature` [n, V] at `targets` [n], and [n] logsumexp."""
    stats = token_stats(logits, targets, temperature=temperature, chunk_rows=chunk_rows)
    return stats.logprobs, stats.lse


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_rows: int = 1024
) -> torch.Tensor:
    """[n] entropy (nats) of softmax(logits / temperature) per row of `logits` [n, V].

    The same float32 chunked pass as `token_stats(..., entropy=True)`, without targets.
    """
    targets = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    entropy = token_stats(
        logits.detach(), targets, temperature=temperature, chunk_rows=chunk_rows, entropy=True
    ).entropy
    assert entropy is not None
    return entropy


class _TargetLogprob(torch.autograd.Function):
    """logprob[i] = x[i, t_i] − logsumexp(x[i]) for x = logits / T, in float32 chunks.

    d logprob[i] / d logits[i] = (onehot(t_i) − softmax(x[i])) / T, recomputed per chunk in
    backward from the saved logits and logsumexp. With a truncation, x is −inf outside the
    kept set (replayed in backward too), so the softmax and its gradient live on the set.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_rows: int,
        entropy: bool,
        truncation: SamplingTruncation | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        ent = torch.empty_like(logprobs) if entropy else logprobs.new_zeros(0)
        outside = torch.zeros(n, dtype=torch.bool, device=logits.device)
        for start in range(0, n, chunk_rows):
            end = min(start + chunk_rows, n)
            target = targets[start:end, None]
            rows, out = _scaled_rows(logits[start:end], target, temperature, truncation)
            outside[start:end] = out
            # torch's log_softmax, as vLLM's sampler computes its logprobs: with the same
            # logits the two agree bit for bit (trainer.kernels vllm_cpu relies on it)
            row_logprobs = torch.log_softmax(rows, dim=-1)
            logprobs[start:end] = row_logprobs.gather(-1, target)[:, 0]
            lse[start:end] = (rows.gather(-1, target) - row_logprobs.gather(-1, target))[:, 0]
            if entropy:
                terms = row_logprobs.exp() * row_logprobs
                if truncation is not None:  # 0 · −inf outside the kept set
                    terms = torch.nan_to_num(terms, nan=0.0)
                ent[start:end] = -terms.sum(dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.truncation = truncation
        ctx.mark_non_differentiable(lse, ent, outside)
        return logprobs, lse, ent, outside

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprobs: torch.Tensor,
        _grad_lse: torch.Tensor,
        _grad_entropy: torch.Tensor,
        _grad_outside: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        logits, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows  # type: ignore[attr-defined]
        truncation = ctx.truncation  # type: ignore[attr-defined]
        grad = torch.empty_like(logits)
        scale = grad_logprobs.float() / temperature
        for start in range(0, logits.shape[0], chunk_rows):
            end = min(start + chunk_rows, logits.shape[0])
            rows, _ = _scaled_rows(logits[start:end], targets[start:end, None], temperature,
                                   truncation)  # fmt: skip
            if grad.dtype == torch.float32:  # write the chunk's gradient in place
                probs = torch.sub(rows, lse[start:end, None], out=grad[start:end])
            else:
                probs = rows - lse[start:end, None]
            probs.exp_().mul_(-scale[start:end, None])
            probs.scatter_add_(-1, targets[start:end, None], scale[start:end, None])
            if probs.data_ptr() != grad[start:end].data_ptr():
                grad[start:end] = probs
        return grad, None, None, None, None, None


def _scaled_float(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def _scaled_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    temperature: float,
    truncation: SamplingTruncation | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits / T, −inf outside the kept set (the target always kept); [r] outside."""
    rows = _scaled_float(logits, temperature)
    if truncation is None:
        return rows, torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    keep = truncation.kept(rows)
    outside = ~keep.gather(-1, target)[:, 0]
    keep.scatter_(-1, target, True)
    return rows.masked_fill(~keep, -torch.inf), outside


@contextlib.contextmanager
def score_only(head: nn.Module, rows: torch.Tensor, columns: torch.Tensor) -> Iterator[None]:
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
