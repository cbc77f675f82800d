"""Training batches: trajectories as padded tensors, and their micro-batch packing plans.

A `TrainBatch` holds B trajectories. Its per-token tensors have shape [B, T] where T is the
longest completion; positions past a completion's end are padding (mask 0).

`plan_micro_batches` turns a batch into forward passes under a token budget:

- `packed`: (nearly) padding-free. Several sequences share one row; `position_ids` restart
  at 0 at each sequence start, and transformers (>= 4.46, checked on 5.19 with sdpa and
  `use_cache=False`) derives a block-diagonal causal mask from them, so no token attends
  across sequences. Rows hold at most the longest sequence's length (sdpa computes the
  whole masked L_row² attention, so one 4096-token row would cost more than four 1024-token
  rows) and are filled first-fit-decreasing; a pass stacks as many rows as fit the budget,
  padding only the few tokens by which rows differ.
- `bucketed`: sequences sorted by length, grouped into right-padded micro-batches whose
  padded size fits the budget (padding only between similar lengths).
- `padded`: the batch order, right-padded; the baseline for benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from tir_rl.errors import ConfigError
from tir_rl.types import UNVERSIONED, Trajectory


class Packing(StrEnum):
    """How sequences are laid out in micro-batches."""

    PACKED = "packed"
    BUCKETED = "bucketed"
    PADDED = "padded"


@dataclass
class TrainBatch:
    """B trajectories as tensors for the trainer (one rank's share of a global batch)."""

    prompt_ids: list[torch.Tensor]
    """Per sequence, the prompt token ids [P_i] (long). Never empty."""
    completion_ids: torch.Tensor
    """[B, T] long; completion tokens (sampled and rendered), 0 past each completion's end."""
    loss_mask: torch.Tensor
    """[B, T] bool; True for tokens the engine sampled."""
    sampler_logprobs: torch.Tensor
    """[B, T] float32; the engine's processed logprobs (meaningless where the mask is 0)."""
    turn_ids: torch.Tensor
    """[B, T] long; assistant turn index of each token, -1 past the completion's end."""
    completion_lens: torch.Tensor
    """[B] long; number of completion tokens per sequence."""
    rewards: torch.Tensor
    """[B] float32."""
    group_ids: torch.Tensor
    """[B] long; ties the G samples of one task together."""
    policy_versions: torch.Tensor = None  # type: ignore[assignment]  # filled in __post_init__
    """[B, T] long; policy version of the weights that sampled each token, `UNVERSIONED`
    (-1) at rendered tokens, padding and where no engine recorded one (None: all -1)."""

    def __post_init__(self) -> None:
        b = len(self.prompt_ids)
        assert self.completion_ids.shape[0] == b, "one completion row per prompt"
        if self.policy_versions is None:
            self.policy_versions = torch.full_like(self.completion_ids, UNVERSIONED)
        for name in ("loss_mask", "sampler_logprobs", "turn_ids", "policy_versions"):
            assert getattr(self, name).shape == self.completion_ids.shape, name

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory]) -> TrainBatch:
        """Pack trajectories into padded tensors (token ids kept verbatim, nothing re-tokenized).

        Raises:
            ConfigError: a trajectory has an empty prompt (its first token has no context).
        """
        if not trajectories:
            raise ConfigError("TrainBatch needs at least one trajectory.")
        b = len(trajectories)
        t = max(1, max(len(tr.completion_ids) for tr in trajectories))
        completion_ids = torch.zeros(b, t, dtype=torch.long)
        loss_mask = torch.zeros(b, t, dtype=torch.bool)
        sampler_logprobs = torch.zeros(b, t, dtype=torch.float32)
        turn_ids = torch.full((b, t), -1, dtype=torch.long)
        versions = torch.full((b, t), UNVERSIONED, dtype=torch.long)
        prompts = []
        for i, tr in enumerate(trajectories):
            if not tr.prompt_ids:
                raise ConfigError(
                    f"Trajectory {i} has an empty prompt; every sequence needs at least one "
                    "prompt token (e.g. BOS) so its first completion token has a logit."
                )
            n = len(tr.completion_ids)
            prompts.append(torch.tensor(tr.prompt_ids, dtype=torch.long))
            completion_ids[i, :n] = torch.tensor(tr.completion_ids, dtype=torch.long)
            loss_mask[i, :n] = torch.tensor(tr.loss_mask, dtype=torch.bool)
            sampler_logprobs[i, :n] = torch.tensor(tr.sampler_logprobs, dtype=torch.float32)
            turn_ids[i, :n] = torch.tensor(tr.turn_ids, dtype=torch.long)
            if tr.policy_versions:
                versions[i, :n] = torch.tensor(tr.policy_versions, dtype=torch.long)
        return cls(
            prompt_ids=prompts,
            completion_ids=completion_ids,
            loss_mask=loss_mask,
            sampler_logprobs=sampler_logprobs,
            turn_ids=turn_ids,
            completion_lens=torch.tensor([len(tr.completion_ids) for tr in trajectories]),
            rewards=torch.tensor([float(tr.reward) for tr in trajectories]),
            group_ids=torch.tensor([int(tr.group_id) for tr in trajectories]),
            policy_versions=versions,
        )

    @property
    def num_sequences(self) -> int:
        """B."""
        return len(self.prompt_ids)

    @property
    def total_lens(self) -> torch.Tensor:
        """[B] long; prompt plus completion length of each sequence."""
        prompt_lens = torch.tensor([len(p) for p in self.prompt_ids], dtype=torch.long)
        return prompt_lens + self.completion_lens

    @property
    def num_tokens(self) -> int:
        """Total number of real (prompt + completion) tokens."""
        return int(self.total_lens.sum())

    def select(self, indices: Sequence[int] | torch.Tensor) -> TrainBatch:
        """The sub-batch of the given sequences (trailing padding columns trimmed)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        lens = self.completion_lens[idx]
        t = max(1, int(lens.max())) if len(idx) else 1
        return TrainBatch(
            prompt_ids=[self.prompt_ids[int(i)] for i in idx],
            completion_ids=self.completion_ids[idx, :t],
            loss_mask=self.loss_mask[idx, :t],
            sampler_logprobs=self.sampler_logprobs[idx, :t],
            turn_ids=self.turn_ids[idx, :t],
            completion_lens=lens,
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            policy_versions=self.policy_versions[idx, :t],
        )

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """This rank's contiguous share of a global batch (B must divide by `world_size`)."""
        b = self.num_sequences
        if b % world_size:
            raise ConfigError(f"A batch of {b} sequences does not split over {world_size} ranks.")
        per = b // world_size
        return self.select(range(rank * per, (rank + 1) * per))

    def tensors(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """The batch as a dict of tensors (for `torch.save` of an offending batch)."""
        return {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "loss_mask": self.loss_mask,
            "sampler_logprobs": self.sampler_logprobs,
            "turn_ids": self.turn_ids,
            "completion_lens": self.completion_lens,
            "rewards": self.rewards,
            "group_ids": self.group_ids,
            "policy_versions": self.policy_versions,
        }


@dataclass
class MicroBatch:
    """One forward pass: rows of tokens plus where each completion token's logit sits."""

    input_ids: torch.Tensor
    """[R, L] long."""
    position_ids: torch.Tensor
    """[R, L] long; restarts at 0 at every sequence start."""
    seq_indices: torch.Tensor
    """[b] long; which sequences of the TrainBatch this micro-batch covers."""
    row: torch.Tensor
    """[n] long; row of each completion token's predicting logit."""
    pred_pos: torch.Tensor
    """[n] long; column of the logit that predicts the token (its own column minus 1)."""
    dest_seq: torch.Tensor
    """[n] long; index into `seq_indices` of the token's sequence."""
    dest_tok: torch.Tensor
    """[n] long; the token's index in its completion."""
    targets: torch.Tensor
    """[n] long; the completion token ids."""

    @property
    def num_padded_tokens(self) -> int:
        """Tokens the forward pass computes, padding included (R × L)."""
        return self.input_ids.numel()

    def token_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[n] bool; the value of a batch's [B, T] `mask` at each of this pass's tokens."""
        return mask[self.seq_indices[self.dest_seq], self.dest_tok].bool()

    def select_tokens(self, keep: torch.Tensor) -> MicroBatch:
        """The same rows with only the completion tokens where `keep` [n] bool is True.

        The forward pass is unchanged; only the logits at the kept tokens' predicting
        positions are then needed (e.g. the loss-mask-1 tokens of an update pass).
        """
        return replace(
            self,
            row=self.row[keep],
            pred_pos=self.pred_pos[keep],
            dest_seq=self.dest_seq[keep],
            dest_tok=self.dest_tok[keep],
            targets=self.targets[keep],
        )


def plan_micro_batches(
    batch: TrainBatch, max_tokens: int, packing: Packing = Packing.PACKED
) -> list[MicroBatch]:
    """Split `batch` into micro-batches of at most `max_tokens` computed tokens each.

    A sequence longer than `max_tokens` gets a micro-batch of its own.
    """
    if max_tokens <= 0:
        raise ConfigError(f"micro_batch_tokens must be positive, got {max_tokens}.")
    lens = batch.total_lens.tolist()
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    if packing is Packing.PACKED:
        # Rows no longer than the longest sequence: attention costs L_row² per row (the
        # block-diagonal mask does not skip work in sdpa), so a few short rows beat one long one.
        row_cap = max(1, min(max_tokens, max(lens)))
        rows = _first_fit_decreasing(order, lens, row_cap)
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


def _first_fit_decreasing(order: list[int], lens: list[int], capacity: int) -> list[list[int]]:
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


def _sequence_tokens(batch: TrainBatch, i: int) -> tuple[torch.Tensor, int, int]:
    prompt = batch.prompt_ids[i]
    n = int(batch.completion_lens[i])
    return torch.cat([prompt, batch.completion_ids[i, :n]]), len(prompt), n


def _packed_micro_batch(batch: TrainBatch, rows: list[list[int]]) -> MicroBatch:
    width = max(int(batch.total_lens[row].sum()) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    # Padding at a row's end continues the last sequence's positions: nothing attends to it.
    position_ids = torch.arange(width).expand(len(rows), width).clone()
    group, gather = [], []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            tokens, p, n = _sequence_tokens(batch, i)
            input_ids[r, offset : offset + len(tokens)] = tokens
            position_ids[r, offset:] = torch.arange(width - offset)
            gather.append((r, offset + p - 1, len(group), n))
            group.append(i)
            offset += len(tokens)
    return _finish(input_ids, position_ids, group, gather)


def _padded_micro_batch(batch: TrainBatch, group: list[int]) -> MicroBatch:
    seqs = [_sequence_tokens(batch, i) for i in group]
    width = max(len(s[0]) for s in seqs)
    input_ids = torch.zeros(len(group), width, dtype=torch.long)
    gather = []
    for r, (tokens, p, n) in enumerate(seqs):
        input_ids[r, : len(tokens)] = tokens
        gather.append((r, p - 1, r, n))
    position_ids = torch.arange(width).expand(len(group), width).clone()
    return _finish(input_ids, position_ids, group, gather)


def _finish(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    group: list[int],
    gather: list[tuple[int, int, int, int]],
) -> MicroBatch:
    rows, preds, seqs, toks = [], [], [], []
    for row, first_pred, local, n in gather:
        rows.append(torch.full((n,), row, dtype=torch.long))
        preds.append(first_pred + torch.arange(n))
        seqs.append(torch.full((n,), local, dtype=torch.long))
        toks.append(torch.arange(n))
    row_t, pred_t = torch.cat(rows), torch.cat(preds)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        seq_indices=torch.tensor(group, dtype=torch.long),
        row=row_t,
        pred_pos=pred_t,
        dest_seq=torch.cat(seqs),
        dest_tok=torch.cat(toks),
        targets=input_ids[row_t, pred_t + 1],
    )
