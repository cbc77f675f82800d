"""Micro-batch plans: a `TrainBatch` laid out as forward passes under a token budget.

- `packed`: (nearly) padding-free. Several sequences share one row; `position_ids` restart
  at 0 at each sequence start, and transformers (>= 4.46, checked on 5.19 with sdpa and
  `use_cache=False`) derives a block-diagonal causal mask from them, so no token attends
  across sequences. Rows hold at most the longest sequence's length (sdpa computes the
  whole masked L_row² attention, so one 4096-token row would cost more than four 1024-token
  rows) and are filled first-fit-decreasing; a pass stacks as many rows as fit the budget,
  padding only the few tokens by which rows differ.
- `shared_prefix`: as `packed`, but the sequences of one group (the G samples of a task, an
  agent episode's samples) share one copy of their common prefix, with an explicit mask
  (`tir_rl.trainer.prefix_sharing`).
- `bucketed`: sequences sorted by length, grouped into right-padded micro-batches whose
  padded size fits the budget (padding only between similar lengths).
- `padded`: the batch order, right-padded; the baseline for benchmarks.

Every plan covers each completion token exactly once, with the column of the logit that
predicts it and that column's position in the token's own sequence.
"""

from __future__ import annotations

import torch

from tir_rl.errors import ConfigError
from tir_rl.trainer.batch import MicroBatch, Packing, TrainBatch
from tir_rl.trainer.prefix_sharing import plan_shared_prefix_micro_batches
from tir_rl.trainer.rows import (
    TokenGather,
    finish_micro_batch,
    first_fit_decreasing,
    sequence_tokens,
)


def plan_micro_batches(
    batch: TrainBatch, max_tokens: int, packing: Packing = Packing.PACKED
) -> list[MicroBatch]:
    """Split `batch` into micro-batches of at most `max_tokens` computed tokens each.

    A sequence longer than `max_tokens` gets a micro-batch of its own (a shared-prefix unit
    of one sequence, likewise).
    """
    if max_tokens <= 0:
        raise ConfigError(f"micro_batch_tokens must be positive, got {max_tokens}.")
    if packing is Packing.SHARED_PREFIX:
        return plan_shared_prefix_micro_batches(batch, max_tokens)
    lens = batch.total_lens.tolist()
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    if packing is Packing.PACKED:
        # Rows no longer than the longest sequence: attention costs L_row² per row (the
        # block-diagonal mask does not skip work in sdpa), so a few short rows beat one long one.
        row_cap = max(1, min(max_tokens, max(lens)))
        rows = first_fit_decreasing(order, lens, row_cap)
        rows_per_pass = max(1, max_tokens // row_cap)
        return [
            _packed_micro_batch(batch, rows[k : k + rows_per_pass])
            for k in range(0, len(rows), rows_per_pass)
        ]
    if packing is Packing.PADDED:
        order = list(range(len(lens)))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * max(lens[j] for j in [*groups[-1], i]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [_padded_micro_batch(batch, g) for g in groups]


def _packed_micro_batch(batch: TrainBatch, rows: list[list[int]]) -> MicroBatch:
    width = max(int(batch.total_lens[row].sum()) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    # Padding at a row's end continues the last sequence's positions: nothing attends to it.
    position_ids = torch.arange(width).expand(len(rows), width).clone()
    group: list[int] = []
    gather: list[TokenGather] = []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            tokens, p, n = sequence_tokens(batch, i)
            input_ids[r, offset : offset + len(tokens)] = tokens
            position_ids[r, offset:] = torch.arange(width - offset)
            gather.append((r, offset + p - 1 + torch.arange(n), len(group)))
            group.append(i)
            offset += len(tokens)
    return finish_micro_batch(batch, input_ids, position_ids, group, gather)


def _padded_micro_batch(batch: TrainBatch, group: list[int]) -> MicroBatch:
    seqs = [sequence_tokens(batch, i) for i in group]
    width = max(len(s[0]) for s in seqs)
    input_ids = torch.zeros(len(group), width, dtype=torch.long)
    gather: list[TokenGather] = []
    for r, (tokens, p, n) in enumerate(seqs):
        input_ids[r, : len(tokens)] = tokens
        gather.append((r, p - 1 + torch.arange(n), r))
    position_ids = torch.arange(width).expand(len(group), width).clone()
    return finish_micro_batch(batch, input_ids, position_ids, group, gather)
