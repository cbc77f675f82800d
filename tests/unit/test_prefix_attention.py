"""The shared-prefix attention equals sdpa over the layout's dense mask, values and gradients."""

from __future__ import annotations

import pytest
import torch
from group_trajectories import group_batch
from torch import nn
from torch.nn import functional as F

from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.trainer.prefix_attention import shared_prefix_attention


@pytest.mark.parametrize("budget", [12, 1000])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shared_prefix_attention_equals_sdpa_over_the_dense_mask(budget, kv_heads):
    batch = TrainBatch.from_trajectories(
        group_batch(5, [[1, 2, 3], [1, 2], [4, 5, 6, 7], [1]], group_id=0)
        + group_batch(3, [[8, 9], [8, 9]], group_id=1)  # alike: one branch all prefix
        + group_batch(2, [[3, 3, 3, 3, 3]], group_id=2)  # a lone sequence
    )
    generator = torch.Generator().manual_seed(0)
    for mb in plan_micro_batches(batch, budget, Packing.SHARED_PREFIX):
        assert mb.prefix_layout is not None
        rows, width = mb.input_ids.shape
        q = torch.randn(rows, 4, width, 8, generator=generator, requires_grad=True)
        k = torch.randn(rows, kv_heads, width, 8, generator=generator, requires_grad=True)
        v = torch.randn(rows, kv_heads, width, 8, generator=generator, requires_grad=True)
        got, _ = shared_prefix_attention(nn.Module(), q, k, v, None, scaling=0.3,
                                         prefix_layout=mb.prefix_layout)  # fmt: skip
        repeat = 4 // kv_heads
        want = F.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
            attn_mask=mb.prefix_layout.dense_mask(), scale=0.3,
        ).transpose(1, 2)  # fmt: skip
        real = mb.input_ids != 0  # row padding: zero output, read by nothing
        torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-5)
        weights = torch.randn(want[real].shape, generator=generator)
        grads_got = torch.autograd.grad((got[real] * weights).sum(), (q, k, v))
        grads_want = torch.autograd.grad((want[real] * weights).sum(), (q, k, v))
        for g, w in zip(grads_got, grads_want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
