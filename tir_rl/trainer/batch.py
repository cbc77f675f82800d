"""Training batches: trajectories as padded tensors, and the micro-batches a forward runs.

A `TrainBatch` holds B trajectories. Its per-token tensors have shape [B, T] where T is the
longest completion; positions past a completion's end are padding (mask 0). A `MicroBatch`
is one forward pass over some of them, laid out by one of the `Packing` layouts
(`tir_rl.trainer.packing` plans them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from tir_rl.errors import ConfigError
from tir_rl.trainer.prefix_layout import PrefixLayout
from tir_rl.types import UNVERSIONED, Trajectory


class Packing(StrEnum):
    """How sequences are laid out in micro-batches (`tir_rl.trainer.packing` has each)."""

    PACKED = "packed"
    BUCKETED = "bucketed"
    PADDED = "padded"
    SHARED_PREFIX = "shared_prefix"


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

    @classmethod
    def of_sequence(cls, token_ids: Sequence[int]) -> TrainBatch:
        """One sequence to score by teacher forcing (e.g. the parity probe).

        Its first token is the prompt, the rest the completion, every token in the mask.
        """
        if len(token_ids) < 2:
            raise ConfigError(f"a scored sequence needs at least 2 tokens, got {len(token_ids)}")
        completion = torch.tensor([list(token_ids[1:])], dtype=torch.long)
        return cls(
            prompt_ids=[torch.tensor(list(token_ids[:1]), dtype=torch.long)],
            completion_ids=completion,
            loss_mask=torch.ones_like(completion, dtype=torch.bool),
            sampler_logprobs=torch.zeros(completion.shape, dtype=torch.float32),
            turn_ids=torch.zeros_like(completion),
            completion_lens=torch.tensor([completion.shape[1]]),
            rewards=torch.zeros(1),
            group_ids=torch.zeros(1, dtype=torch.long),
        )

    @property
    def num_sequences(self) -> int:
        """B."""
        return len(self.prompt_ids)

    def checked_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        """`advantages` as [B] float32 on the CPU, detached; another shape is refused."""
        advantages = advantages.detach().float().cpu()
        if advantages.shape != (self.num_sequences,):
            raise ConfigError(
                f"advantages must have shape [{self.num_sequences}], got {tuple(advantages.shape)}"
            )
        return advantages

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
    """[R, L] long; each token's position in its own sequence (restarts at 0 at every
    sequence start)."""
    seq_indices: torch.Tensor
    """[b] long; which sequences of the TrainBatch this micro-batch covers."""
    row: torch.Tensor
    """[n] long; row of each completion token's predicting logit."""
    pred_pos: torch.Tensor
    """[n] long; column of the logit that predicts the token: the column of the token before
    it in its sequence (its own column minus 1, except where a shared prefix ends)."""
    dest_seq: torch.Tensor
    """[n] long; index into `seq_indices` of the token's sequence."""
    dest_tok: torch.Tensor
    """[n] long; the token's index in its completion."""
    targets: torch.Tensor
    """[n] long; the completion token ids."""
    prefix_layout: PrefixLayout | None = None
    """Where each shared prefix and its branches lie (`Packing.SHARED_PREFIX`), for the
    attention that computes a prefix once for all its branches; None: plain packed rows,
    whose block-diagonal causal mask the model derives from `position_ids`."""

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
