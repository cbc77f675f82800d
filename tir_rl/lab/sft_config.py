"""The settings of `tir-rl sft`: environment, demonstrations, training, output folder.

`load_sft_config` reads them from YAML plus `--set` overrides.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tir_rl.chat import ChatFormat
from tir_rl.config import to_dict
from tir_rl.errors import ConfigError


@dataclass(kw_only=True)
class SFTEnvSection:
    """Which environment the demonstrations come from."""

    id: str = "tir_rl/MultiHop-v0"
    """gymnasium id; the environment must implement `ToolEnv.demonstration`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `gymnasium.make` (the split is always `train`)."""
    horizons: list[int] = field(default_factory=list)
    """Demonstration i uses ``horizon=horizons[i % len(horizons)]`` on top of `kwargs` (a
    mix of lengths); empty: `kwargs` alone."""

    def validate(self) -> None:
        """Check values."""
        if "split" in self.kwargs:
            raise ConfigError("sft env.kwargs must not set split: demonstrations use train")
        if any(h < 1 for h in self.horizons):
            raise ConfigError(f"sft env.horizons={self.horizons}: every horizon must be >= 1")


@dataclass(kw_only=True)
class SFTDataSection:
    """How many demonstrations, and which tasks."""

    num_demos: int = 128
    """Number of demonstration episodes (each one train task)."""
    seed: int = 0
    """Demonstration i resets its env with a seed derived from (seed, i)."""

    def validate(self) -> None:
        """Check values."""
        if self.num_demos < 1:
            raise ConfigError(f"sft data.num_demos={self.num_demos}: must be >= 1")


@dataclass(kw_only=True)
class SFTTrainSection:
    """Optimizer and schedule (fp32 on the CPU)."""

    epochs: int = 2
    """Passes over the demonstrations."""
    lr: float = 1e-4
    """Peak AdamW learning rate (linear warmup, then cosine decay to 0)."""
    warmup_steps: int = 2
    """Optimizer steps of linear warmup."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this; 0 or less: no clipping."""
    batch_tokens: int = 2048
    """Loss tokens (mask 1) per optimizer step, at least one demonstration: demonstrations
    are taken in shuffled order until the step holds this many assistant tokens. Each
    sequence runs its own forward pass (on the CPU a padded batch is no faster per token)."""
    cache_shared_prefix: bool = True
    """Compute the prefix all demonstrations share (the system turn) once per step without
    gradient (see the module docstring); False: full forward and backward per sequence."""
    loss_probe_demos: int = 16
    """Mean loss over the first N demonstrations is measured before and after training
    (reported in `sft_info.json`; 0: skip)."""
    seed: int = 0
    """Seeds torch and the shuffling."""
    threads: int | None = None
    """torch CPU threads (None: torch's default)."""

    def validate(self) -> None:
        """Check values."""
        if self.epochs < 1:
            raise ConfigError(f"sft train.epochs={self.epochs}: must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"sft train.lr={self.lr}: must be > 0")
        if self.batch_tokens < 1:
            raise ConfigError(f"sft train.batch_tokens={self.batch_tokens}: must be >= 1")
        if self.warmup_steps < 0 or self.loss_probe_demos < 0:
            raise ConfigError("sft train.warmup_steps and loss_probe_demos must be >= 0")


@dataclass(kw_only=True)
class SFTConfig:
    """Everything `tir-rl sft` needs."""

    model: str = "bundled"
    """Base model: `bundled`, `tiny`, or a local Hugging Face checkpoint folder."""
    output_dir: Path = Path("runs/sft/multihop")
    """Folder of the fine-tuned HF checkpoint (model, tokenizer, `sft_info.json`)."""
    env: SFTEnvSection = field(default_factory=SFTEnvSection)
    data: SFTDataSection = field(default_factory=SFTDataSection)
    train: SFTTrainSection = field(default_factory=SFTTrainSection)
    chat: ChatFormat.Config = field(default_factory=ChatFormat.Config)
    """The chat format the demonstrations are rendered in: use the same as the RL run's
    `chat` section, so that SFT teaches the turns the rollouts will render."""

    def validate(self) -> None:
        """Check every section."""
        self.env.validate()
        self.data.validate()
        self.train.validate()

    def config_hash(self) -> str:
        """Hash of everything that shapes the checkpoint (the output folder excluded)."""
        tree = to_dict(self)
        tree.pop("output_dir")
        if self.chat == ChatFormat.Config():  # the default renders as before `chat` existed
            tree.pop("chat")
        blob = json.dumps(tree, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_sft_config(path: str | Path | None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Load an `SFTConfig` from YAML plus `--set` overrides."""
    from tir_rl.config import load

    return load(SFTConfig, path, overrides)
