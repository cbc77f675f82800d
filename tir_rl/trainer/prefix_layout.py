"""Where a shared-prefix micro-batch put each prefix and branch: what its attention reads.

Indices are *flat*: column c of row r of an [R, W] micro-batch is r·W + c. The layout is
built by `tir_rl.trainer.prefix_sharing` and read by `tir_rl.trainer.prefix_attention`;
`dense_mask` spells out, as an [R, 1, W, W] boolean mask, the attention the two compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixBlock:
    """One copy of a prefix and the k branches that continue it, all in one row."""

    prefix_start: int
    """Flat index of the prefix's first token (the prefix is contiguous)."""
    prefix_len: int
    """L, the prefix's length (0 when the branches share nothing)."""
    branch_index: torch.Tensor
    """[k, n] long; flat index of each branch's tokens, right-padded to the longest branch n
    (padding points at a real column; its query is never written back)."""
    branch_valid: torch.Tensor
    """[k, n] bool; False at the padding of `branch_index`."""
    branch_mask: torch.Tensor
    """[k, 1, n, L + n] bool; what a branch query attends among the prefix (all of it) and
    its own branch's keys (those at or before it). Padding queries see at least themselves."""

    def to(self, device: torch.device) -> PrefixBlock:
        """The same block with its tensors on `device`."""
        return PrefixBlock(
            self.prefix_start,
            self.prefix_len,
            self.branch_index.to(device),
            self.branch_valid.to(device),
            self.branch_mask.to(device),
        )


@dataclass(frozen=True)
class PrefixLayout:
    """Every prefix block of one micro-batch of `num_rows` rows of `width` columns."""

    num_rows: int
    width: int
    blocks: tuple[PrefixBlock, ...]

    def to(self, device: torch.device) -> PrefixLayout:
        """The same layout with its tensors on `device`."""
        return PrefixLayout(self.num_rows, self.width, tuple(b.to(device) for b in self.blocks))

    def dense_mask(self) -> torch.Tensor:
        """[R, 1, W, W] bool, [row, ·, query column, key column]: True where query sees key.

        A column outside every block (row padding) attends itself only.
        """
        size = self.num_rows * self.width
        mask = torch.eye(size, dtype=torch.bool)
        for block in self.blocks:
            prefix = torch.arange(block.prefix_start, block.prefix_start + block.prefix_len)
            mask[prefix[:, None], prefix[None, :]] = torch.ones(
                len(prefix), len(prefix), dtype=torch.bool
            ).tril()
            for index, valid in zip(
                block.branch_index.cpu(), block.branch_valid.cpu(), strict=True
            ):
                branch = index[valid]
                mask[branch[:, None], prefix[None, :]] = True
                mask[branch[:, None], branch[None, :]] = torch.ones(
                    len(branch), len(branch), dtype=torch.bool
                ).tril()
        rows = torch.arange(self.num_rows)
        per_row = mask.view(self.num_rows, self.width, self.num_rows, self.width)
        return per_row[rows, :, rows, :][:, None]  # the diagonal row blocks
