"""Per-token statistics of a policy's logits: logprob of the sampled token, logsumexp, entropy.

The trainer scores every kept position against a full-vocabulary softmax. At a small model's
scale that softmax, not the matrix products, is most of a step (49,152 columns per token for
the bundled tokenizer), so it is computed in float32 `chunk_rows` rows at a time and, with
gradients, by `_TargetLogprob`: one autograd node over the whole [n, V] logits whose
backward writes the gradient chunk by chunk into one buffer. Chunking through autograd
instead (a slice per chunk) gives every chunk's backward a zero-filled [n, V] gradient of
its own; on the lab model that was half the update's time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Statistics of softmax(logits / temperature) for each row of `logits` [n, V].

    Returns:
        [n] float32 logprob of `targets` [n] (differentiable when `logits` requires grad),
        [n] float32 logsumexp of the scaled logits and, when `entropy`, the [n] float32
        entropy in nats (both without gradient). Equal to `log_softmax(logits.float() /
        temperature)` at the targets, values and gradients, whatever the logits' dtype; no
        float32 [n, V] tensor is made, and autograd keeps only the logits themselves.
    """
    if logits.shape[0] == 0:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty + logits.float().sum() * 0, empty, empty if entropy else None
    logprobs, lse, ent = _TargetLogprob.apply(logits, targets, temperature, chunk_rows, entropy)
    return logprobs, lse, ent if entropy else None


def chunked_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] log-softmax of `logits / temperature` [n, V] at `targets` [n], and [n] logsumexp."""
    logprobs, lse, _ = token_stats(logits, targets, temperature=temperature, chunk_rows=chunk_rows)
    return logprobs, lse


@torch.no_grad()
def token_entropy(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_rows: int = 1024
) -> torch.Tensor:
    """[n] entropy (nats) of softmax(logits / temperature) per row of `logits` [n, V].

    The same float32 chunked pass as `token_stats(..., entropy=True)`, without targets.
    """
    targets = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    _, _, entropy = token_stats(
        logits.detach(), targets, temperature=temperature, chunk_rows=chunk_rows, entropy=True
    )
    assert entropy is not None
    return entropy


class _TargetLogprob(torch.autograd.Function):
    """logprob[i] = x[i, t_i] − logsumexp(x[i]) for x = logits / T, in float32 chunks.

    d logprob[i] / d logits[i] = (onehot(t_i) − softmax(x[i])) / T, recomputed per chunk in
    backward from the saved logits and logsumexp.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_rows: int,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        ent = torch.empty_like(logprobs) if entropy else logprobs.new_zeros(0)
        for start in range(0, n, chunk_rows):
            end = min(start + chunk_rows, n)
            rows = _scaled_float(logits[start:end], temperature)
            # torch's log_softmax, as vLLM's sampler computes its logprobs: with the same
            # logits the two agree bit for bit (trainer.kernels vllm_cpu relies on it)
            row_logprobs = torch.log_softmax(rows, dim=-1)
            target = targets[start:end, None]
            logprobs[start:end] = row_logprobs.gather(-1, target)[:, 0]
            lse[start:end] = (rows.gather(-1, target) - row_logprobs.gather(-1, target))[:, 0]
            if entropy:
                ent[start:end] = -(row_logprobs.exp() * row_logprobs).sum(dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.mark_non_differentiable(lse, ent)
        return logprobs, lse, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprobs: torch.Tensor,
        _grad_lse: torch.Tensor,
        _grad_entropy: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows  # type: ignore[attr-defined]
        grad = torch.empty_like(logits)
        scale = grad_logprobs.float() / temperature
        for start in range(0, logits.shape[0], chunk_rows):
            end = min(start + chunk_rows, logits.shape[0])
            rows = _scaled_float(logits[start:end], temperature)
            if grad.dtype == torch.float32:  # write the chunk's gradient in place
                probs = torch.sub(rows, lse[start:end, None], out=grad[start:end])
            else:
                probs = rows - lse[start:end, None]
            probs.exp_().mul_(-scale[start:end, None])
            probs.scatter_add_(-1, targets[start:end, None], scale[start:end, None])
            if probs.data_ptr() != grad[start:end].data_ptr():
                grad[start:end] = probs
        return grad, None, None, None, None


def _scaled_float(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


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
