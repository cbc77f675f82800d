"""The frozen reference policy of the KL penalty (`loss.kl_coef > 0`).

GRPOLoss adds β·k3(ℓ^ref_t − ℓ^θ_t) per model token; ℓ^ref comes from a policy that never
trains: by default the run's starting weights (`trainer.model`), or another checkpoint
(`trainer.reference_model`). It is built only when the loss has a KL term:

    full fine-tuning ──► a frozen copy (requires_grad off, eval mode, no optimizer state;
                         under FSDP2 sharded like the policy), float32 like the policy's
                         master weights so that step 0 gives ℓ^ref = ℓ^θ bit for bit
    LoRA (same base) ──► the policy itself inside peft's `disable_adapter()`: the base
                         weights never train, so no second copy is loaded

Its logprobs are computed per micro-batch by the trainer, on the policy's micro-batch layout,
temperature and compute dtype, under `torch.no_grad()`.

A run resumed from a checkpoint must keep the reference it started with, not take the
resumed weights: the checkpoint records which weights the reference is (`ReferenceRecord`:
the configured name, the resolved folder, a fingerprint of the tensors), and `checkpoint.load`
refuses a trainer whose reference differs. The trainer rebuilds its reference from the run's
config (`trainer.model` is the run's starting checkpoint), before the checkpoint's weights are
loaded into the policy, so a resumed run gets the same one.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tir_rl.errors import ConfigError


@dataclass(frozen=True)
class ReferenceRecord:
    """Which weights the reference policy is; saved in each checkpoint, checked on resume."""

    model: str
    """As configured: `tiny`, `bundled`, `lab` or a folder (the policy's `model` by default)."""
    path: str
    """The folder the weights were loaded from."""
    fingerprint: str
    """sha256 over the tensors' names, dtypes, shapes and bytes (`weights_fingerprint`)."""
    adapters_disabled: bool
    """True when the reference is the LoRA policy's own base weights, adapters off."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for `trainer_state.json`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReferenceRecord:
        """The record as `to_dict` wrote it."""
        return cls(**data)


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 of a model's state dict: names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


class ReferencePolicy:
    """The frozen policy whose logprobs the KL term pulls towards; it is never updated."""

    def __init__(self, model: nn.Module, record: ReferenceRecord) -> None:
        """Hold `model` as the reference (see `frozen_copy` and `policy_without_adapters`).

        Args:
            model: a frozen module of its own, or (when `record.adapters_disabled`) the LoRA
                policy, whose adapters `forward_model` disables.
            record: which weights these are.
        """
        self.model = model
        self.record = record

    @classmethod
    def frozen_copy(cls, model: nn.Module, record: ReferenceRecord) -> ReferencePolicy:
        """`model` (not shared with the policy) frozen: no gradients, eval mode."""
        model.requires_grad_(False)
        model.eval()
        return cls(model, record)

    @property
    def adapters_disabled(self) -> bool:
        """Whether the reference is the LoRA policy with its adapters off."""
        return self.record.adapters_disabled

    @contextlib.contextmanager
    def forward_model(self) -> Iterator[nn.Module]:
        """The module to run for reference logprobs, in eval mode, adapters off under LoRA.

        Under LoRA the policy's train/eval mode and its adapters are restored on exit.
        """
        if not self.adapters_disabled:
            yield self.model
            return
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():  # type: ignore[operator]  # peft.PeftModel
                yield self.model
        finally:
            self.model.train(was_training)


def load_reference(
    policy: nn.Module,
    *,
    policy_model: str,
    policy_path: Path,
    reference_model: str,
    adapters_off_is_start: bool,
    attn_implementation: str,
) -> tuple[nn.Module | None, ReferenceRecord]:
    """The reference's weights (None: the LoRA policy with its adapters off) and their record.

    Args:
        policy: the policy as just loaded, before any update or LoRA wrapping.
        policy_model: the policy's `trainer.model` value.
        policy_path: the folder the policy was loaded from.
        reference_model: `trainer.reference_model` ("" for the policy's starting weights).
        adapters_off_is_start: whether the policy trains LoRA adapters that start at zero, so
            that the policy with its adapters disabled is its starting weights, unchanged.
        attn_implementation: the transformers attention kernel, as the policy's.
    """
    from tir_rl.models import resolve_model

    name = reference_model or policy_model
    path = resolve_model(reference_model) if reference_model else policy_path
    weights = None
    if not (adapters_off_is_start and path.resolve() == policy_path.resolve()):
        weights = load_reference_weights(
            policy,
            policy_path=policy_path,
            reference_path=path,
            attn_implementation=attn_implementation,
        )
    record = ReferenceRecord(
        model=name,
        path=str(path),
        fingerprint=weights_fingerprint(weights if weights is not None else policy),
        adapters_disabled=weights is None,
    )
    return weights, record


def load_reference_weights(
    policy: nn.Module,
    *,
    policy_path: Path,
    reference_path: Path,
    attn_implementation: str,
) -> nn.Module:
    """A float32 copy of the reference's weights, sharing no tensor with `policy`.

    When the reference is the policy's own checkpoint, `policy` must be the freshly loaded
    model (before any update): it is deep-copied instead of read from disk again.

    Raises:
        ConfigError: the reference's vocabulary differs from the policy's (its logprobs
            would score other tokens).
    """
    if reference_path.resolve() == policy_path.resolve():
        return copy.deepcopy(policy)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        reference_path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    reference.config.use_cache = False
    ours, theirs = policy.config.vocab_size, reference.config.vocab_size
    if ours != theirs:
        raise ConfigError(
            f"trainer.reference_model {str(reference_path)!r} has a vocabulary of {theirs} "
            f"tokens, the policy {ours}: the KL term compares the two models' logprobs of the "
            "same token ids. Use a checkpoint of the same model family (same tokenizer)."
        )
    return reference


def check_record(saved: ReferenceRecord, ours: ReferenceRecord, checkpoint: Path) -> None:
    """Refuse to resume with a reference other than the run's own.

    Raises:
        ConfigError: the fingerprints differ.
    """
    if saved.fingerprint == ours.fingerprint:
        return
    raise ConfigError(
        f"{checkpoint} was trained with a KL penalty to the reference {saved.model!r} "
        f"(loaded from {saved.path}, weights sha256 {saved.fingerprint[:12]}), but this trainer's "
        f"reference {ours.model!r} (from {ours.path}) has other weights "
        f"(sha256 {ours.fingerprint[:12]}). Resume with the run's own model and "
        "trainer.reference_model; if the folder changed since the run started, restore it."
    )
