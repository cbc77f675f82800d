"""The attention of a shared-prefix micro-batch: each prefix once, each branch against it.

A transformers attention function (registered as `ATTENTION_NAME`) that the trainer's model
runs when `trainer.packing` is `shared_prefix`. Given the micro-batch's `PrefixLayout` (the
`prefix_layout` keyword of the model's forward, handed down to every attention layer), it
computes, per prefix block of L tokens and k branches of up to n tokens, with sdpa:

- the prefix's causal self-attention, once: [1, H, L, D];
- every branch's queries against the prefix's keys and values followed by its own, in one
  padded call: [k, H, n, D] queries, [k, H, L + n, D] keys, the block's [k, 1, n, L + n] mask.

That is L² + k·n·(L + n) query-key pairs where one masked row would cost (L + k·n)², and
the result equals sdpa over that row with `PrefixLayout.dense_mask`. Row padding outside
every block gets a zero output (nothing reads it). Without a layout (a forward that is not
a shared-prefix micro-batch) the function is transformers' sdpa attention, mask and all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tir_rl.trainer.prefix_layout import PrefixLayout

ATTENTION_NAME = "tir_rl_shared_prefix_sdpa"
"""The name the function is registered under (a model's `attn_implementation`)."""


def register_prefix_attention() -> str:
    """Register the attention (and sdpa's mask for it) with transformers; its name.

    Idempotent. Call it before loading a model with `attn_implementation=ATTENTION_NAME`.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTENTION_NAME


def shared_prefix_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    prefix_layout: PrefixLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention output [R, W, H, D] of query [R, H, W, D], key/value [R, H_kv, W, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if prefix_layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, width, dim = query.shape
    repeat = heads // key.shape[1]
    q = query.transpose(1, 2).reshape(rows * width, heads, dim)  # [R·W, H, D], flat columns
    k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    outputs: list[torch.Tensor] = []
    written: list[torch.Tensor] = []
    for block in prefix_layout.blocks:
        start, length = block.prefix_start, block.prefix_len
        prefix_k, prefix_v = k[start : start + length], v[start : start + length]  # [L, H_kv, D]
        if length:
            out = F.scaled_dot_product_attention(
                q[start : start + length].transpose(0, 1)[None],
                _heads(prefix_k.transpose(0, 1)[None], repeat),
                _heads(prefix_v.transpose(0, 1)[None], repeat),
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
            )  # [1, H, L, D]
            outputs.append(out[0].transpose(0, 1))
            written.append(torch.arange(start, start + length, device=query.device))
        index = block.branch_index  # [k, n]
        if index.shape[1] == 0:
            continue
        out = F.scaled_dot_product_attention(
            q[index].transpose(1, 2),  # [k, H, n, D]
            _after_prefix(prefix_k, k[index], repeat),
            _after_prefix(prefix_v, v[index], repeat),
            attn_mask=block.branch_mask,
            dropout_p=dropout,
            scale=scaling,
        ).transpose(1, 2)  # [k, n, H, D]
        outputs.append(out[block.branch_valid])
        written.append(index[block.branch_valid])
    values = torch.cat(outputs)  # in sdpa's output dtype (autocast's, when on)
    flat = values.new_zeros(rows * width, heads, dim).index_put((torch.cat(written),), values)
    return flat.view(rows, width, heads, dim), None


def _after_prefix(prefix: torch.Tensor, own: torch.Tensor, repeat: int) -> torch.Tensor:
    """[k, H, L + n, D]: the prefix's keys (or values) [L, H_kv, D], then each branch's own.

    `own` is [k, n, H_kv, D].
    """
    keys = torch.cat([prefix[None].expand(own.shape[0], -1, -1, -1), own], dim=1)
    return _heads(keys.transpose(1, 2), repeat)


def _heads(states: torch.Tensor, repeat: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H, S, D]: each key/value head serves `repeat` query heads."""
    return states if repeat == 1 else states.repeat_interleave(repeat, dim=1)
