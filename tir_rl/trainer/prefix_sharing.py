"""Shared-prefix micro-batches: a group's common prefix computed once (`Packing.SHARED_PREFIX`).

The G samples of one task share their prompt, and an agent episode's samples share their
history up to where they part. Packed one sequence after another, that prefix is computed
G times, forward and backward. Here the sequences of one group (`TrainBatch.group_ids`)
become one *unit*: the longest prefix common to all of them, once, then each sequence's
remainder (its *branch*)::

    row:        [ prefix (L tokens) | branch 1 (n₁) | branch 2 (n₂) | … ]
    positions:    0 … L-1             L … L+n₁-1      L … L+n₂-1

A prefix token attends the prefix tokens before it, a branch token the whole prefix and
the tokens before it in its own branch, and nothing else (no other branch, no other unit of
the row): the `PrefixLayout` built here tells `tir_rl.trainer.prefix_attention` where each
lies, and `PrefixLayout.dense_mask` spells that attention out. It is exactly the attention
each sequence gets alone, at the positions it has alone, so every logit, and with it every
logprob, loss term and gradient, equals the unshared computation's up to float32 rounding.
The gradient reaching a prefix token sums what every branch sends it, as the G copies'
would. The attention costs L² + Σ nᵢ(L + nᵢ) query-key pairs, not the G(L + n)² of G
separate rows nor the (L + Σ nᵢ)² of one masked row.

A completion token whose predicting position lies in the prefix (the first completion token
of every branch, and any completion tokens the whole group sampled alike) reads its logit
there: one logit serves several sequences, and the loss's gradient through it sums theirs.

Rows are filled first-fit-decreasing as in `packed`, at most the longest unit long; a unit
longer than the budget is split into several, each with its own copy of the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tir_rl.trainer.batch import MicroBatch, TrainBatch
from tir_rl.trainer.prefix_layout import PrefixBlock, PrefixLayout
from tir_rl.trainer.rows import (
    TokenGather,
    finish_micro_batch,
    first_fit_decreasing,
    sequence_tokens,
)


@dataclass(frozen=True)
class PrefixUnit:
    """One copy of a prefix and the branches that continue it, laid out contiguously."""

    prefix_len: int
    """L: tokens every member starts with (a lone member's prefix is its whole sequence)."""
    members: tuple[int, ...]
    """Indices into the `TrainBatch` of the sequences that branch from the prefix."""
    tokens: tuple[torch.Tensor, ...]
    """Each member's prompt + completion ids."""

    @property
    def length(self) -> int:
        """Tokens the unit occupies in a row: the prefix once, then every branch."""
        return self.prefix_len + sum(len(t) - self.prefix_len for t in self.tokens)


def common_prefix_length(sequences: list[torch.Tensor]) -> int:
    """The number of leading tokens every sequence has in common."""
    shortest = min(len(s) for s in sequences)
    stacked = torch.stack([s[:shortest] for s in sequences])  # [k, shortest]
    differs = (stacked != stacked[0]).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else shortest


def prefix_units(batch: TrainBatch, max_tokens: int) -> list[PrefixUnit]:
    """One unit per group of `batch`, split where a unit would exceed `max_tokens`."""
    groups: dict[int, list[int]] = {}
    for i, group_id in enumerate(batch.group_ids.tolist()):
        groups.setdefault(int(group_id), []).append(i)
    units: list[PrefixUnit] = []
    for members in groups.values():
        tokens = {i: sequence_tokens(batch, i)[0] for i in members}
        prefix_len = common_prefix_length(list(tokens.values()))
        chunk: list[int] = []
        size = prefix_len
        for i in sorted(members, key=lambda i: -len(tokens[i])):
            branch = len(tokens[i]) - prefix_len
            if chunk and size + branch > max_tokens:
                units.append(_unit(prefix_len, chunk, tokens))
                chunk, size = [], prefix_len
            chunk.append(i)
            size += branch
        units.append(_unit(prefix_len, chunk, tokens))
    return units


def _unit(prefix_len: int, members: list[int], tokens: dict[int, torch.Tensor]) -> PrefixUnit:
    return PrefixUnit(prefix_len, tuple(members), tuple(tokens[i] for i in members))


def plan_shared_prefix_micro_batches(batch: TrainBatch, max_tokens: int) -> list[MicroBatch]:
    """The shared-prefix plan of `batch` under a budget of `max_tokens` per pass."""
    units = prefix_units(batch, max_tokens)
    lens = [u.length for u in units]
    order = sorted(range(len(units)), key=lambda k: -lens[k])
    row_cap = max(1, min(max_tokens, max(lens)))
    rows = first_fit_decreasing(order, lens, row_cap)
    rows_per_pass = max(1, max_tokens // row_cap)
    return [
        _micro_batch(batch, [[units[u] for u in row] for row in rows[k : k + rows_per_pass]])
        for k in range(0, len(rows), rows_per_pass)
    ]


def _micro_batch(batch: TrainBatch, rows: list[list[PrefixUnit]]) -> MicroBatch:
    width = max(sum(u.length for u in row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.arange(width).expand(len(rows), width).clone()
    group: list[int] = []
    gather: list[TokenGather] = []
    blocks: list[PrefixBlock] = []
    for r, row in enumerate(rows):
        col = 0
        for unit in row:
            prefix_len, prefix_col = unit.prefix_len, col
            col += prefix_len
            input_ids[r, prefix_col:col] = unit.tokens[0][:prefix_len]
            position_ids[r, prefix_col:col] = torch.arange(prefix_len)
            branch_cols: list[int] = []
            for i, tokens in zip(unit.members, unit.tokens, strict=True):
                end = col + len(tokens) - prefix_len
                input_ids[r, col:end] = tokens[prefix_len:]
                position_ids[r, col:end] = prefix_len + torch.arange(end - col)
                # Token j of the completion is predicted at sequence index P - 1 + j: in the
                # prefix copy or in the branch, whichever holds that index.
                predicting = (
                    len(batch.prompt_ids[i]) - 1 + torch.arange(int(batch.completion_lens[i]))
                )
                columns = torch.where(
                    predicting < prefix_len,
                    prefix_col + predicting,
                    col + predicting - prefix_len,
                )
                gather.append((r, columns, len(group)))
                group.append(i)
                branch_cols.append(col)
                col = end
            lens = [len(t) - prefix_len for t in unit.tokens]
            blocks.append(_block(r * width, prefix_col, prefix_len, branch_cols, lens))
        position_ids[r, col:] = torch.arange(width - col)  # padding: nothing attends to it
    layout = PrefixLayout(len(rows), width, tuple(blocks))
    return finish_micro_batch(batch, input_ids, position_ids, group, gather, layout)


def _block(
    row_start: int, prefix_col: int, prefix_len: int, branch_cols: list[int], lens: list[int]
) -> PrefixBlock:
    """The prefix block of a unit whose branches start at `branch_cols` (row columns)."""
    longest = max(lens)
    steps = torch.arange(longest)
    starts = torch.tensor(branch_cols)[:, None]
    branch_lens = torch.tensor(lens)[:, None]
    valid = steps[None, :] < branch_lens  # [k, n]
    # Padding points at a real token: the branch's start, or for an empty branch the prefix
    # (a branch is empty only when it is all prefix, so the prefix then has tokens).
    pad = torch.where(branch_lens > 0, starts, prefix_col)
    index = row_start + torch.where(valid, starts + steps, pad)
    own = (steps[None, :] <= steps[:, None])[None] & valid[:, None, :]  # [k, n (query), n (key)]
    own |= torch.eye(longest, dtype=torch.bool)[None]  # a padding query sees itself
    prefix = torch.ones(len(lens), longest, prefix_len, dtype=torch.bool)
    mask = torch.cat([prefix, own], dim=2)[:, None]  # [k, 1, n, L + n]
    return PrefixBlock(row_start + prefix_col, prefix_len, index, valid, mask)
