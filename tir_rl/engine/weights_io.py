"""Write a trainer state dict where vLLM's `reload_weights(weights_path=...)` can read it.

vLLM 0.32 reloads weights in place through `collective_rpc("reload_weights", ...)`. Passing
tensors as `weights_iterator` only works when the worker shares the caller's process: the
`AsyncLLM` engine core and the OpenAI server are separate processes whose RPC encodes plain
msgpack, so tensors arrive as lists. Both engines therefore write one safetensors file and
pass its folder as `weights_path` (a string), which works in-process, across processes and
over HTTP (the folder must then be visible to the server at the same path).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl.errors import ModelError

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "model.safetensors"


def default_weights_dir(prefix: str) -> Path:
    """A fresh private folder, in shared memory where the machine has it (no disk writes)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def write_state_dict(state_dict: Mapping[str, torch.Tensor], folder: Path) -> Path:
    """Save `state_dict` (HF names) as `folder/model.safetensors`, atomically; return it.

    Tied tensors (e.g. `lm_head.weight` sharing `model.embed_tokens.weight`) are cloned,
    since safetensors refuses shared storage; everything else is written without a copy
    when it is already a contiguous CPU tensor.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    storages: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    tmp = folder / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp))
    path = folder / WEIGHTS_FILE
    tmp.replace(path)
    return path


def read_checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of the Hugging Face checkpoint `folder` (HF names), tied ones included.

    A checkpoint with tied embeddings stores `lm_head.weight` once, as the input embedding;
    vLLM's in-place reload needs it under its own name, as a trainer state dict has it.
    """
    import json

    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors weights to load")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    model_config = json.loads((folder / "config.json").read_text())
    if model_config.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
