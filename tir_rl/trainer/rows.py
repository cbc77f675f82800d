"""Laying sequences out in rows: the pieces every micro-batch plan shares."""

from __future__ import annotations

import torch

from tir_rl.trainer.batch import MicroBatch, TrainBatch
from tir_rl.trainer.prefix_layout import PrefixLayout


def first_fit_decreasing(order: list[int], lens: list[int], capacity: int) -> list[list[int]]:
    """Items (taken in `order`, longest first) into bins of `capacity`.

    An item longer than `capacity` gets a bin of its own.
    """
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for k, room in enumerate(free):
            if lens[i] <= room:
                bins[k].append(i)
                free[k] -= lens[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lens[i])
    return bins


def sequence_tokens(batch: TrainBatch, i: int) -> tuple[torch.Tensor, int, int]:
    """Sequence `i`'s prompt + completion ids [P + n], P and n."""
    prompt = batch.prompt_ids[i]
    n = int(batch.completion_lens[i])
    return torch.cat([prompt, batch.completion_ids[i, :n]]), len(prompt), n


TokenGather = tuple[int, torch.Tensor, int]
"""One sequence's completion tokens in a micro-batch: the row, the predicting column of each
of its n tokens ([n] long, token order), and the sequence's index in the micro-batch."""


def finish_micro_batch(
    batch: TrainBatch,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    group: list[int],
    gather: list[TokenGather],
    prefix_layout: PrefixLayout | None = None,
) -> MicroBatch:
    """A `MicroBatch` of the laid-out rows, its completion tokens' gathers flattened."""
    rows, preds, seqs, toks = [], [], [], []
    for row, columns, local in gather:
        n = len(columns)
        rows.append(torch.full((n,), row, dtype=torch.long))
        preds.append(columns)
        seqs.append(torch.full((n,), local, dtype=torch.long))
        toks.append(torch.arange(n))
    seq_indices = torch.tensor(group, dtype=torch.long)
    dest_seq, dest_tok = torch.cat(seqs), torch.cat(toks)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        seq_indices=seq_indices,
        row=torch.cat(rows),
        pred_pos=torch.cat(preds),
        dest_seq=dest_seq,
        dest_tok=dest_tok,
        targets=batch.completion_ids[seq_indices[dest_seq], dest_tok],
        prefix_layout=prefix_layout,
    )
