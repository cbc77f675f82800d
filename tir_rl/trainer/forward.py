"""The trainer's forward: the one way tir-rl computes a policy's token logprobs.

Training, `Trainer.compute_logprobs`, the reference policy of a KL term, the parity probe
after a weight sync, `tir-rl doctor` and the parity localizer all score tokens here, so a
setting that changes the training forward (compute dtype, kernels, packing) changes what
they measure too. Per micro-batch: the packed layout (a shared-prefix layout reaches every
attention layer), autocast to the compute dtype on one rank, lm_head only at the positions
whose logprob is used (`logits_to_keep`), then `token_stats` (log_softmax in float32 at the
sampler's temperature, over the sampler's kept set when it truncates: min-p, top-k, top-p).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from tir_rl import distributed as tdist
from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.trainer.batch import MicroBatch, Packing, TrainBatch
from tir_rl.trainer.packing import plan_micro_batches
from tir_rl.trainer.token_stats import TokenStats, score_only, token_stats


class TrainerForward:
    """Micro-batch planning and the scoring forward of one trainer."""

    def __init__(
        self,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        sharded: bool,
        temperature: float,
        micro_batch_tokens: int,
        packing: Packing,
        truncation: SamplingTruncation | None = None,
    ) -> None:
        self.device = device
        self.truncation = truncation if truncation is not None and truncation.active else None
        """The sampler's min-p, top-k and top-p, replayed on every scored position (None:
        the sampler draws from the whole vocabulary)."""
        self.compute_dtype = compute_dtype
        self.sharded = sharded
        self.temperature = temperature
        self.micro_batch_tokens = micro_batch_tokens
        self.packing = packing

    def plan(self, batch: TrainBatch) -> list[MicroBatch]:
        """The batch's micro-batches under the trainer's packing and token budget."""
        return plan_micro_batches(batch, self.micro_batch_tokens, self.packing)

    def matched(self, micro_batches: list[MicroBatch]) -> list[MicroBatch | None]:
        """Pad the list with None so every rank runs the same number of passes."""
        num = tdist.all_reduce_count(len(micro_batches), tdist.ReduceOp.MAX)
        return [*micro_batches, *([None] * (num - len(micro_batches)))]

    def token_stats(
        self,
        model: nn.Module,
        mb: MicroBatch,
        *,
        entropy: bool,
        temperature: float | None = None,
        replay: bool = True,
    ) -> TokenStats:
        """Token logprobs under `model` (grad if enabled), entropies, kept-set misses.

        `model` is the policy or the reference: both run the same code, so the reference gets
        the policy's layout, temperature, compute dtype and kept sets. `temperature` overrides
        the sampler's and `replay=False` scores the whole vocabulary (the parity probe scores
        prompt logprobs at 1, as the engine does).
        """
        keep = torch.unique(mb.pred_pos)  # sorted; the decoder hands lm_head these columns
        column = torch.searchsorted(keep, mb.pred_pos)
        head = model.get_output_embeddings()
        # A shared-prefix layout reaches every attention layer (`prefix_attention`).
        layout = (
            {} if mb.prefix_layout is None else {"prefix_layout": mb.prefix_layout.to(self.device)}
        )
        with self.autocast(), score_only(head, mb.row.to(self.device), column.to(self.device)):
            output = model(
                input_ids=mb.input_ids.to(self.device),
                position_ids=mb.position_ids.to(self.device),
                logits_to_keep=keep.to(self.device),
                use_cache=False,
                **layout,
            )
        logits = output.logits.squeeze(0)  # [n, V], one row per token, in the micro-batch's order
        return token_stats(
            logits,
            mb.targets.to(self.device),
            temperature=self.temperature if temperature is None else temperature,
            entropy=entropy,
            truncation=self.truncation if replay else None,
        )

    def score(
        self,
        batch: TrainBatch,
        model: nn.Module,
        *,
        temperature: float | None = None,
        replay: bool = True,
    ) -> torch.Tensor:
        """[B, T] float32 CPU logprobs of `batch` under `model` (grad mode as the caller's)."""
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
        for mb in self.matched(self.plan(batch)):
            if mb is None:
                self.empty_pass(model, backward=False)
                continue
            stats = self.token_stats(
                model, mb, entropy=False, temperature=temperature, replay=replay
            )
            logprobs = stats.logprobs.float().cpu()
            out[mb.seq_indices[mb.dest_seq], mb.dest_tok] = logprobs
        return out

    @torch.no_grad()
    def sequence(
        self, model: nn.Module, token_ids: Sequence[int], *, temperature: float = 1.0
    ) -> torch.Tensor:
        """[T − 1] float32 CPU teacher-forced logprobs of `token_ids[1:]` under `model`.

        The parity probe's and `tir-rl doctor`'s trainer side: the training forward on one
        sequence (every rank must call it when sharded). The caller sets eval mode.
        """
        batch = TrainBatch.of_sequence(token_ids)
        return self.score(batch, model, temperature=temperature, replay=False)[0]

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """Run the forward in the compute dtype over float32 parameters (one rank only).

        Sharded, FSDP2's `MixedPrecisionPolicy` casts the gathered parameters instead.
        """
        if self.compute_dtype == torch.float32 or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def empty_pass(self, model: nn.Module, *, backward: bool) -> None:
        """A one-token pass of `model` contributing nothing, to keep FSDP collectives matched."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        with self.autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()
