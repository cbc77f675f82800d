"""Weight sync: the trainer's weights to the engine, then the parity probe.

::

    every rank: trainer.rank0_full_state_dict() (gathers FSDP2 shards; full on rank 0)
        │        trainer forward on the probe (every rank runs it under FSDP2)
        ▼
    rank 0:  injection.sampler_state(full, k) ──► engine.update_weights ──► probe_parity
             (the trainer's tensors, or the injected ones; a stale step sends nothing)

After optimizer step k the engine gets the trainer's weights, unless `inject` is set: then
it gets `MismatchInjection.sampler_state` (transformed weights), or nothing on a stale step
(`inject.sync_every` > 1), and the probe logs the gap instead of raising (`ParityError`
otherwise). How the weights travel is the engine's `engine.weight_transfer`
(`tir_rl.engine.weights.transfer`: a published file, or vLLM's nccl / ipc / gloo transfer engines);
the probe is `tir_rl.engine.parity`. A pool's servers are each checked: the version they
label tokens with, and their parity.

A clean evaluation (`run.eval_clean_sampler`) lends the engine the trainer's exact weights
(`rank0_exact_weights`) and then hands back what the sampler had: the stale copy kept at
the last sync, or the injected weights recomputed from the same state.

The caller runs the rank-0 halves inside its rank coordination (`distributed.rank0_run`);
nothing here talks to other ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tir_rl import distributed as tdist
from tir_rl.engine import parity
from tir_rl.mismatch.injection import MismatchInjection

if TYPE_CHECKING:
    import torch

    from tir_rl.engine.base import Engine
    from tir_rl.trainer import Trainer

StateDict = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class PreparedSync:
    """What every rank computed for one sync; rank 0 sends it."""

    state: StateDict
    """The weights for the engine (rank 0; `{}` on the other ranks)."""
    trainer_logprobs: list[float]
    """The trainer's logprobs of the probe, `[T - 1]`."""


class WeightSync:
    """Sends the trainer's weights (or the injected sampler's) to the engine and probes parity."""

    def __init__(
        self,
        injection: MismatchInjection,
        *,
        probe_ids: Sequence[int],
        parity_tolerance: float,
        keep_stale_copy: bool = False,
    ) -> None:
        """Set up the syncs of one run.

        Args:
            injection: the run's injected mismatch (inactive: the engine gets the trainer's
                exact weights and parity is enforced).
            probe_ids: the parity probe's token ids (the same on every rank).
            parity_tolerance: largest engine/trainer logprob gap allowed on the probe; not
                enforced while injecting.
            keep_stale_copy: keep a copy of what each sync sent when syncs are stale
                (`inject.sync_every` > 1), so a clean evaluation can hand it back.
        """
        self.injection = injection
        self.probe_ids = list(probe_ids)
        self.tolerance = parity_tolerance if injection.strict_parity else math.inf
        self.keep_stale_copy = keep_stale_copy and injection.config.sync_every > 1
        self._stale_state: StateDict | None = None

    def due(self, num_updates: int, *, force: bool = False) -> bool:
        """Whether the engine gets new weights after `num_updates` optimizer steps.

        A pure function of the count, so every rank skips the same syncs; `force` for the
        engine's start and a resume.
        """
        return force or self.injection.syncs_after(num_updates)

    def prepare(self, trainer: Trainer, num_updates: int) -> PreparedSync:
        """Every rank: gather the weights and score the probe with the trainer."""
        full = trainer.rank0_full_state_dict()
        state = full  # only rank 0 holds the full state
        if tdist.is_rank0():
            state = self.sampler_weights(full, num_updates)
            if self.keep_stale_copy:
                self._stale_state = {k: v.detach().clone() for k, v in state.items()}
        # The trainer side of the probe is a forward pass: with FSDP2 every rank runs it.
        logprobs = trainer.sequence_logprobs(self.probe_ids).tolist()
        return PreparedSync(state, logprobs)

    async def rank0_send(
        self, engine: Engine, prepared: PreparedSync, version: int
    ) -> parity.ParityReport:
        """Rank 0: load the prepared weights into the engine, then run the parity probe.

        Every copy of the weights the engine holds is probed (`Engine.check_each_copy`: a
        pool's servers one by one); the report is the worst.

        The update lands in flight (`Engine.update_weights`): the engine's later tokens carry
        policy version `version`.

        Raises:
            ParityError: the gap exceeds the tolerance (never while injecting).
        """
        await engine.update_weights(prepared.state, version=version)
        reports = await engine.check_each_copy(
            lambda copy: self._probe(copy, prepared), version=version
        )
        return max(reports, key=lambda report: report.max_abs_diff)

    async def _probe(self, engine: Engine, prepared: PreparedSync) -> parity.ParityReport:
        return await parity.probe_parity(  # looked up at call time, so a test may replace it
            engine,
            lambda ids: prepared.trainer_logprobs,
            self.probe_ids,
            tolerance=self.tolerance,
        )

    def sampler_weights(self, full: StateDict, num_updates: int) -> StateDict:
        """The weights the sampler runs after `num_updates`: the trainer's, or injected."""
        state = self.injection.sampler_state(full, num_updates, force=True)
        assert state is not None  # forced
        return state

    @contextlib.contextmanager
    def rank0_exact_weights(
        self, engine: Engine, full: StateDict, num_updates: int
    ) -> Iterator[None]:
        """Rank 0: the engine runs the trainer's exact weights `full` inside the block.

        On exit it gets the sampler's weights back: the stale copy of the last sync, else
        the injected weights recomputed from `full`.
        """
        restore = self._stale_state or self.sampler_weights(full, num_updates)
        asyncio.run(engine.update_weights(full))
        try:
            yield
        finally:
            asyncio.run(engine.update_weights(restore))
