"""The trainer's forward on vLLM-CPU's own kernels: `trainer.kernels: vllm_cpu`.

The parity localizer (`tir-rl doctor --localize`) runs the same tokens through the engine
and the trainer and compares each stage on the engine's own input to it. On vLLM-CPU in
float32 every stage of transformers' Llama matched vLLM's bit for bit except three ops:

- the rotary embedding: vLLM's C++ `rotary_embedding` against transformers'
  `q * cos + rotate_half(q) * sin`;
- the attention kernel: vLLM's C++ `cpu_attention_with_kv_cache` against torch's SDPA;
- the matrix products of larger layers: vLLM's oneDNN GEMM (`onednn_mm`) against torch's
  (equal at the tiny model's sizes, not at a 512-wide MLP).

Here the trainer's forward calls those three ops of vLLM's. The model's rotary module is
replaced by one that leaves q and k unchanged (cos 1, sin 0: exact); the attention function
rotates them with vLLM's op and the cos/sin cache vLLM computes, then runs vLLM's kernel
the way its CPU backend runs an encoder (a scratch KV cache filled by
`cpu_attn_reshape_and_cache`, one "request" per packed sequence, read from where
`position_ids` restart at 0); every `nn.Linear` multiplies with a oneDNN handle of its
current weight. The backward is autograd through the same computation in plain torch (the
ops have none): the forward is the sampler's, the gradient that of the model up to float
rounding (`tests/integration/trainer/test_vllm_cpu_kernels.py`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    import torch

NAME = "vllm_cpu"
"""The attention implementation registered with transformers."""
BLOCK_SIZE = 32
"""Block size of the scratch KV cache (the kernel's result does not depend on it: 16, 32,
64 and 128 were measured bitwise equal, as were packed and lone sequences)."""


def use_vllm_cpu_kernels(model: Any, *, world_size: int = 1) -> None:
    """Make `model` (a transformers Llama causal LM) run vLLM-CPU's rotary, attention, GEMM.

    Raises:
        ConfigError: several ranks, a rotary embedding other than the default one, or a
            sliding window.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    if world_size > 1:
        raise ConfigError(
            f"trainer.kernels vllm_cpu runs on one rank (world size is {world_size}): its "
            "matrix products take whole weights, which FSDP2 shards. Train on one rank, or "
            "with trainer.kernels torch."
        )
    head_dim, _ = _rotary_of(model.config)
    AttentionInterface.register(NAME, _attention)  # reads each module's own config
    AttentionMaskInterface.register(NAME, _no_mask)
    model.set_attn_implementation(NAME)
    model.model.rotary_emb = _unrotated(head_dim)
    _use_onednn_linear(model)


def _rotary_of(config: Any) -> tuple[int, float]:
    """The head size and rotary base of a model config; refuses what vLLM's op cannot do."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or getattr(config, "sliding_window", None):
        raise ConfigError(
            f"trainer.kernels vllm_cpu supports the default rotary embedding without a "
            f"sliding window; this model has rope {rope or 'unset'} and sliding window "
            f"{getattr(config, 'sliding_window', None)}. Use trainer.kernels torch."
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim, float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> Any:  # fmt: skip
    """Transformers' attention interface: `[B, H, T, d]` q, k, v (unrotated) -> `[B, T, H, d]`."""
    import torch

    if dropout:
        raise ConfigError("trainer.kernels vllm_cpu has no attention dropout")
    head_dim, base = _rotary_of(module.config)
    scale = scaling if scaling is not None else head_dim**-0.5
    batch, _, length, _ = query.shape
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length).expand(batch, length)
    positions = positions.reshape(-1).to(torch.int64)
    cache = rotary_cache(base, head_dim, int(positions.max()) + 1, query.dtype)
    lengths = _segments(positions, batch, length)
    out = _attention_function().apply(query, key, value, positions, cache, lengths, scale)
    return out.reshape(batch, length, *out.shape[1:]), None


def rotary_cache(base: float, head_dim: int, positions: int, dtype: torch.dtype) -> torch.Tensor:
    """VLLM's cos/sin cache `[positions, head_dim]` (its `RotaryEmbedding`'s formula)."""
    import torch

    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    t = torch.arange(positions, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _unrotated(head_dim: int) -> Any:
    """A module in place of the model's rotary one: cos 1 and sin 0, q and k unchanged.

    q * 1 + rotate_half(q) * 0 is q exactly; the attention function rotates them.
    """
    import torch

    class Unrotated(torch.nn.Module):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
            shape = (*position_ids.shape, head_dim)
            return torch.ones(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)

    return Unrotated()


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    """The kernel takes sequences, not a mask: they come from `position_ids`."""
    return None


def _segments(positions: torch.Tensor, batch: int, length: int) -> list[int]:
    """Lengths of the packed sequences, row after row, from where positions restart at 0."""
    import torch

    lengths: list[int] = []
    for row in positions.reshape(batch, length).cpu():
        starts = torch.nonzero(row == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, length]
        lengths += [b - a for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return lengths


def rotate(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """VLLM's rotary embedding (neox style) of packed `[N, H, d]` q and k, as new tensors."""
    from vllm import _custom_ops as ops

    head_dim = query.shape[-1]
    q = query.reshape(query.shape[0], -1).clone()
    k = key.reshape(key.shape[0], -1).clone()
    ops.rotary_embedding(positions, q, k, head_dim, cache, True)  # in place
    return q.view_as(query), k.view_as(key)


def rotate_reference(positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The same rotation in plain torch (differentiable), packed `[N, H, d]`."""
    import torch

    half = x.shape[-1] // 2
    cos, sin = cache[positions, :half][:, None], cache[positions, half:][:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def kernel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
    scale: float, block_size: int = BLOCK_SIZE,
) -> torch.Tensor:  # fmt: skip
    """vLLM-CPU's causal attention of packed sequences.

    Args:
        query: `[N, H, d]` for the N tokens of all sequences, one after another.
        key: `[N, Hkv, d]`.
        value: `[N, Hkv, d]`.
        lengths: each sequence's length (they sum to N).
        scale: the softmax scale.
        block_size: the scratch KV cache's block size.

    Returns:
        `[N, H, d]`.
    """
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    blocks = [-(-n // block_size) for n in lengths]
    cache = torch.zeros(
        sum(blocks), num_kv_heads, 2 * block_size, head_dim, dtype=query.dtype
    )  # the layout vLLM's CPU backend views its cache as: keys, then values, per block
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    slots = torch.empty(num_tokens, dtype=torch.int64)
    first_block, start = 0, 0
    for i, (n, b) in enumerate(zip(lengths, blocks, strict=True)):
        table[i, :b] = torch.arange(first_block, first_block + b, dtype=torch.int32)
        slots[start : start + n] = first_block * block_size + torch.arange(n)
        first_block, start = first_block + b, start + n
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    query_start = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(seq_lens, 0)
    isa = _get_attn_isa(query.dtype, block_size, head_dim, "auto")
    ops.cpu_attn_reshape_and_cache(
        key.contiguous(), value.contiguous(), key_cache, value_cache, slots, isa
    )
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(lengths), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, seq_lens=seq_lens, dtype=query.dtype, query_start_loc=query_start,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start, seq_lens=seq_lens, scale=scale, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
        scheduler_metadata=metadata, s_aux=None,
    )  # fmt: skip
    return output


def reference_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """The same attention in plain torch (differentiable): `[N, H, d]` from packed inputs."""
    import torch

    outputs, start = [], 0
    groups = query.shape[1] // key.shape[1]
    for n in lengths:
        q = query[start : start + n].transpose(0, 1)  # [H, n, d]
        k = key[start : start + n].transpose(0, 1).repeat_interleave(groups, 0)
        v = value[start : start + n].transpose(0, 1).repeat_interleave(groups, 0)
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale
            ).transpose(0, 1)
        )
        start += n
    return torch.cat(outputs)


@functools.cache
def _attention_function() -> Any:
    """The attention's autograd function, made once.

    Forward: vLLM's rotary op and attention kernel. Backward: autograd through
    `rotate_reference` and `reference_attention`.
    """
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, positions: Any, cache: Any,
                    lengths: list[int], scale: float) -> Any:  # fmt: skip
            ctx.save_for_backward(q, k, v, positions, cache)
            ctx.lengths, ctx.scale = lengths, scale
            q_rot, k_rot = rotate(positions, _packed(q), _packed(k), cache)
            return kernel_attention(q_rot, k_rot, _packed(v), lengths, scale)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            q, k, v, positions, cache = ctx.saved_tensors
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            with torch.enable_grad():
                q_rot = rotate_reference(positions, _packed(q), cache)
                k_rot = rotate_reference(positions, _packed(k), cache)
                out = reference_attention(q_rot, k_rot, _packed(v), ctx.lengths, ctx.scale)
                grads = torch.autograd.grad(out, (q, k, v), grad)
            return (*grads, None, None, None, None)

    return Attention


def _packed(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, T, d]` -> `[B * T, H, d]` (the tokens of every row, one after another)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()


def _use_onednn_linear(model: Any) -> None:
    """Every `nn.Linear` of `model` multiplies with vLLM-CPU's GEMM.

    A oneDNN handle of its weight is made at each call (the weight changes every step). The
    backward is the plain linear's (grad_x = grad @ W, grad_W = grad^T @ x).
    """
    import types

    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_onednn_forward, module)


def _onednn_forward(self: Any, x: Any) -> Any:
    return _onednn_linear_function().apply(x, self.weight, self.bias)


@functools.cache
def _onednn_linear_function() -> Any:
    """The autograd function (made once) of a linear layer on vLLM-CPU's oneDNN GEMM."""
    import torch
    from vllm import _custom_ops as ops

    class OneDnnLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any) -> Any:
            ctx.save_for_backward(x, weight)
            ctx.has_bias = bias is not None
            handler = ops.create_onednn_mm(weight.detach().t(), 32)
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return ops.onednn_mm(handler, flat, bias).reshape(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, weight = ctx.saved_tensors
            flat_grad = grad.reshape(-1, grad.shape[-1])
            grad_x = (flat_grad @ weight).reshape(x.shape)
            grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1])
            grad_b = flat_grad.sum(0) if ctx.has_bias else None
            return grad_x, grad_w, grad_b

    return OneDnnLinear
