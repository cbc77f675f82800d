"""Save and resume training: HF model, optimizer, RNG states, step, data position, config.

Layout of a checkpoint folder::

    step_000010/
      model/             save_pretrained output + tokenizer: loadable by transformers and vLLM
                         (with LoRA: the merged weights W + scale·B A, base model names)
      adapter/           with LoRA only: peft's save_pretrained of the adapter
                         (`PeftModel.from_pretrained(base, adapter/)`); what resume loads
      optimizer.pt       unsharded (parameter-name keyed) optimizer state, from rank 0
      rng_rank{r}.pt     python, numpy and torch RNG states of rank r
      trainer_state.json step, data position, skip counters, trainer config, guard history,
                         which weights the KL penalty's reference policy is (checked on load)
      config.yaml        the run's config tree, when given

Every rank calls `save` and `load` (they gather and scatter shards). Rank 0 writes into a
hidden temporary folder and renames it at the end, so a crash never leaves half a
checkpoint under the final name.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tir_rl import distributed as tdist
from tir_rl.config import dump, to_dict
from tir_rl.engine.weights.files import read_checkpoint_weights
from tir_rl.errors import ConfigError
from tir_rl.trainer import lora
from tir_rl.trainer.reference import ReferenceRecord, check_record
from tir_rl.trainer.step_result import UpdateStatus

if TYPE_CHECKING:
    from tir_rl.mismatch.guard import CollapseGuard
    from tir_rl.trainer.trainer import Trainer

MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
_STATE_FILE = "trainer_state.json"
CHECKPOINTS = "checkpoints"
_SKIP_COUNT_KEYS = {
    "num_skipped_nonfinite": UpdateStatus.NONFINITE,
    "num_skipped_guard": UpdateStatus.GUARD,
    "num_skipped_rejected": UpdateStatus.ALL_REJECTED,
}
"""The state file's name of each count of `Trainer.skip_counts`."""
"""A run folder's subfolder holding one `step_N` checkpoint per save."""


def step_folder(run_dir: Path, step: int) -> Path:
    """Where a run saves its checkpoint after `step` steps."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete `checkpoints/step_N` folder of a run, if any."""
    folder = Path(run_dir) / CHECKPOINTS
    found = [p for p in folder.glob("step_*") if (p / _STATE_FILE).is_file()]
    return max(found, key=lambda p: int(p.name.split("_")[1]), default=None)


@dataclass
class ResumeState:
    """What `load` hands back to the training loop."""

    step: int
    """Number of train steps done before the checkpoint."""
    data_position: Any = None
    """The caller's opaque data position (int or JSON-able dict), as saved."""
    trainer_config: dict[str, Any] = field(default_factory=dict)
    """The trainer config at save time (plain dict)."""


def save(
    path: str | Path,
    trainer: Trainer,
    *,
    data_position: Any = None,
    config: Any = None,
    guard: CollapseGuard | None = None,
) -> Path:
    """Write a checkpoint of `trainer` to `path` (every rank must call this).

    Args:
        path: the checkpoint folder to create (replaced if it exists).
        trainer: the trainer to save.
        data_position: opaque, JSON-able position in the data stream.
        config: the run's config tree (a dataclass), saved as YAML for reference.
        guard: a collapse guard whose history is saved too.

    Returns:
        The checkpoint folder.
    """
    path = Path(path)
    tmp = temp_folder_for(path) if tdist.is_rank0() else _temp_name(path)
    tdist.barrier()

    state = trainer.rank0_full_state_dict()
    optim_state = tdist.full_optimizer_state_dict(trainer.model, trainer.optimizer)
    torch.save(_rng_state(), tmp / f"rng_rank{tdist.rank()}.pt")
    if tdist.is_rank0():
        _save_model(trainer, state, tmp / MODEL_DIR)
        if trainer.lora_enabled:
            lora.save_adapter(trainer.model, tmp / ADAPTER_DIR)
        torch.save(optim_state, tmp / "optimizer.pt")
        record = {
            "step": trainer.step,
            "data_position": data_position,
            **{key: trainer.skip_counts[status] for key, status in _SKIP_COUNT_KEYS.items()},
            "world_size": tdist.world_size(),
            "trainer_config": to_dict(trainer.config),
            "guard": guard.state_dict() if guard is not None else None,
            "reference": (
                trainer.reference.record.to_dict() if trainer.reference is not None else None
            ),
        }
        (tmp / _STATE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if config is not None:
            dump(config, tmp / "config.yaml")
    tdist.barrier()
    if tdist.is_rank0():
        put_in_place(tmp, path)
    tdist.barrier()
    return path


def load(path: str | Path, trainer: Trainer, *, guard: CollapseGuard | None = None) -> ResumeState:
    """Restore `trainer` (weights, optimizer, RNG, step, counters) from a checkpoint.

    Every rank must call this. The trainer must have been built with the same model
    architecture; the world size may differ (RNG states then come from rank 0's file).
    The trainer's reference policy (KL penalty) is not touched: it must be the one the
    checkpoint records (the run's starting weights by default), which the trainer built
    from the run's config.

    Raises:
        ConfigError: `path` is not a finished checkpoint, or it records a reference policy
            other than the trainer's.
        ModelError: its model folder holds no weights.
    """
    path = Path(path)
    if not (path / _STATE_FILE).is_file():
        raise ConfigError(f"{path} is not a tir-rl checkpoint (no {_STATE_FILE}).")
    record = json.loads((path / _STATE_FILE).read_text())
    if record.get("reference") and trainer.reference is not None:
        check_record(ReferenceRecord.from_dict(record["reference"]), trainer.reference.record, path)

    has_adapter = (path / ADAPTER_DIR).is_dir()
    if has_adapter != trainer.lora_enabled:
        raise ConfigError(
            f"{path} is a {'LoRA' if has_adapter else 'full fine-tuning'} checkpoint but the "
            f"trainer {'trains LoRA adapters' if trainer.lora_enabled else 'has no LoRA'}; "
            "resume with the run's own trainer.lora settings."
        )
    if trainer.lora_enabled:  # the base weights are the trainer's own: load the adapter
        lora.load_adapter(trainer.model, path / ADAPTER_DIR)
    else:
        model_state = {}
        if tdist.is_rank0():
            model_state = read_checkpoint_weights(path / MODEL_DIR)  # tied copies restored
        tdist.load_full_model_state_dict(trainer.model, model_state)
    optim_state = (
        torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        if tdist.is_rank0()
        else {}
    )
    tdist.load_full_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state)

    trainer.step = int(record["step"])
    for key, status in _SKIP_COUNT_KEYS.items():
        trainer.skip_counts[status] = int(record.get(key, 0))
    if guard is not None and record.get("guard"):
        guard.load_state_dict(record["guard"])
    rng_file = path / f"rng_rank{tdist.rank()}.pt"
    if not rng_file.is_file():
        rng_file = path / "rng_rank0.pt"
    _set_rng_state(torch.load(rng_file, weights_only=False))
    tdist.barrier()
    return ResumeState(
        step=trainer.step,
        data_position=record.get("data_position"),
        trainer_config=record.get("trainer_config", {}),
    )


def temp_folder_for(path: Path) -> Path:
    """The hidden sibling folder a save of `path` writes into, created empty.

    Writing there and renaming it at the end (`put_in_place`) means a crash never leaves
    half a checkpoint under the final name.
    """
    tmp = _temp_name(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def put_in_place(tmp: Path, path: Path) -> None:
    """Replace `path` (if any) by the finished folder `tmp`."""
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def save_hf_model(
    folder: Path, model: Any, tokenizer: Any, *, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Save a Hugging Face model folder (safetensors, config, tokenizer) loadable by vLLM.

    Args:
        folder: the folder to write (created if needed).
        model: a transformers model, possibly FSDP2-wrapped.
        tokenizer: the tokenizer to save beside it.
        state_dict: the weights to save instead of the model's own (a gathered FSDP2 state).
    """
    model.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    # FSDP2 renames the model class (FSDPLlamaForCausalLM); write the real architecture.
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [_unwrapped_class_name(model)]
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(folder)


def _temp_name(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp"


def _save_model(trainer: Trainer, state: dict[str, torch.Tensor], folder: Path) -> None:
    from transformers import AutoTokenizer

    model = trainer.hf_model()
    if getattr(model.config, "tie_word_embeddings", False):
        # Unsharded FSDP2 state holds the tied copies as separate tensors; keep one, as
        # save_pretrained does for a plain module.
        tied = getattr(model, "_tied_weights_keys", None) or ()
        state = {k: v for k, v in state.items() if k not in set(tied)}
    tokenizer = AutoTokenizer.from_pretrained(trainer.model_path)
    save_hf_model(folder, model, tokenizer, state_dict=state)


def _unwrapped_class_name(model: torch.nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    raise AssertionError("unreachable: nn.Module is not an FSDPModule")


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
