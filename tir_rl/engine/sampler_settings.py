"""What every engine must honour, whether vLLM runs here or in a server someone started.

`SamplerSettings` holds the keys the local engine (`VLLMLocalEngine.Config`) and a server
(`VLLMHttpEngine.Config`) share, defined once: what the sampler must compute (its dtype and
logprobs mode, checked against a server on connect), what the run accepts from it, and how
the trainer's weights reach it. Each engine's config adds its own keys to these.
"""

from __future__ import annotations

from dataclasses import dataclass

from tir_rl.engine.base import PROCESSED_LOGPROBS
from tir_rl.engine.weights.transfer import WeightTransfer
from tir_rl.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SamplerSettings:
    """The settings every engine shares (flat keys of the run config's `engine` section)."""

    dtype: str = "float32"
    """Compute dtype: the local engine's, or the one a server must use (checked on connect
    when the server exposes it). float32 on a CPU (no native bf16 there: slow and
    mismatched)."""
    logprobs_mode: str = PROCESSED_LOGPROBS
    """vLLM logprobs mode; anything but `processed_logprobs` needs the flag below."""
    allow_other_logprobs_mode: bool = False
    """Accept a logprobs mode other than `processed_logprobs` (e.g. for a debug run)."""
    weights_dir: str | None = None
    """Folder the weights go through with the `file` transfer. The local engine: None makes
    a private folder in /dev/shm, removed on close. A server: a folder it reads at the same
    path (required there)."""
    weight_transfer: WeightTransfer = WeightTransfer.FILE
    """How the trainer's weights reach the engine (`tir_rl.engine.weights.transfer`): `file` (a
    folder it reloads), `nccl` or `ipc` (vLLM's transfer engines, CUDA; `ipc` when the
    engine shares the trainer's GPU), or `gloo` (the NCCL protocol on CPUs). A server must
    have been started for `nccl`/`gloo` (`--weight-transfer-config`, docs/scale.md)."""
    transfer_address: str = "127.0.0.1"
    """This machine's address as the engines reach it (the transfer group's rendezvous for
    `nccl`/`gloo`; servers on other machines need a routable one)."""

    def check_logprobs_mode(self) -> None:
        """Refuse a logprobs mode other than the processed one unless it was allowed."""
        if self.logprobs_mode != PROCESSED_LOGPROBS and not self.allow_other_logprobs_mode:
            raise ConfigError(
                f"engine.logprobs_mode={self.logprobs_mode!r}: tir-rl compares sampler and "
                "trainer logprobs of the processed distribution (after temperature). Use "
                "'processed_logprobs', or set allow_other_logprobs_mode=True knowingly."
            )

    def sampler_settings(self) -> dict[str, object]:
        """These settings by name, to build another engine's config that shares them."""
        return {name: getattr(self, name) for name in SAMPLER_SETTING_NAMES}


SAMPLER_SETTING_NAMES = tuple(SamplerSettings.__dataclass_fields__)
"""The keys of `SamplerSettings`, in their order."""
