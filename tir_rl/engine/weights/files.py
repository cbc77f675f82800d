"""Write a trainer state dict where vLLM's `reload_weights(weights_path=...)` can read it.

vLLM 0.32 reloads weights in place through `collective_rpc("reload_weights", ...)`. Passing
tensors as `weights_iterator` only works when the worker shares the caller's process: the
`AsyncLLM` engine core and the OpenAI server are separate processes whose RPC encodes plain
msgpack, so tensors arrive as lists. Both engines therefore write one safetensors file and
pass its folder as `weights_path` (a string), which works in-process, across processes and
over HTTP (the folder must then be visible to the server at the same path).

Servers that read a shared folder get the weights *published* (`publish_state_dict`): each
version goes to a folder of its own, written under a temporary name, closed by a ready
marker and then renamed, so a server never loads a half-written checkpoint, and one write
serves every server of a pool. The folder's digest (`weights_digest`) goes with the
authenticated reload request, and the server checks it before it loads anything
(`tir_rl.engine.in_vllm.server_guard`): a file changed on disk after publication is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl.errors import EngineError, ModelError
from tir_rl.process.run_secret import refuse_unless_own

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "model.safetensors"
READY_MARKER = "READY.json"
"""Written last into a published folder: its version and size."""
_PUBLISHED_PREFIX = "weights-"


@dataclass(frozen=True)
class PublishedWeights:
    """One complete version of the weights in a folder the servers read."""

    folder: Path
    version: int | None
    """The policy version the weights carry (None: the caller keeps its label)."""
    num_bytes: int
    sha256: str
    """`weights_digest` of the folder when it was published."""


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


def publish_state_dict(
    state_dict: Mapping[str, torch.Tensor], root: Path, *, version: int | None
) -> PublishedWeights:
    """Write `state_dict` into a new folder under `root`, marked ready; remove older ones.

    The tensors and then the ready marker go into a temporary folder, which is renamed to
    `root/weights-NNNNNN` only when both are on disk: a reader that finds the folder finds
    it whole (`check_published`). Folders published earlier under `root` are removed, so a
    server must load a version before the next one is published (the engines do).
    """
    check_weights_root(root)
    earlier = sorted(root.glob(f"{_PUBLISHED_PREFIX}*"))
    number = 1 + max((int(p.name.removeprefix(_PUBLISHED_PREFIX)) for p in earlier), default=0)
    tmp = Path(tempfile.mkdtemp(prefix=".publishing-", dir=root))
    try:
        tmp.chmod(0o755)  # a server running as another user reads it
        path = write_state_dict(state_dict, tmp)
        num_bytes = path.stat().st_size
        sha256 = weights_digest(tmp)
        marker = {"version": version, "files": [WEIGHTS_FILE], "bytes": num_bytes, "sha256": sha256}
        (tmp / READY_MARKER).write_text(json.dumps(marker) + "\n")
        folder = root / f"{_PUBLISHED_PREFIX}{number:06d}"
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in earlier:
        shutil.rmtree(old, ignore_errors=True)
    return PublishedWeights(folder=folder, version=version, num_bytes=num_bytes, sha256=sha256)


def check_published(weights: PublishedWeights) -> None:
    """Raise `EngineError` unless `weights.folder` is a complete published version."""
    marker = weights.folder / READY_MARKER
    if not marker.is_file():
        raise EngineError(
            f"{weights.folder} has no {READY_MARKER}: it is not a complete published version "
            "(still being written, or removed by a later publication). Publish the weights "
            "with tir_rl.engine.weights.files.publish_state_dict and load each version before "
            "publishing the next."
        )
    size = json.loads(marker.read_text())["bytes"]
    on_disk = (weights.folder / WEIGHTS_FILE).stat().st_size
    if on_disk != size:
        raise EngineError(
            f"{weights.folder}: {WEIGHTS_FILE} is {on_disk} bytes, its marker says {size}"
        )


def weights_digest(folder: Path) -> str:
    """SHA-256 over the names and bytes of every `*.safetensors` file of `folder`, in order.

    What a server checks before `reload_weights` reads `folder`: every file vLLM would load
    is covered, so a file replaced, changed or added after publication changes the digest.
    """
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as file:
            while chunk := file.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def check_weights_root(root: Path) -> None:
    """Create `root` (owner-only) if needed; refuse one that another user may write.

    Whoever can write the folder the servers load from can replace the policy they sample
    with; publishing into such a folder is refused rather than made safe in place.

    Raises:
        ConfigError: `root` belongs to another user or is writable by group or others.
    """
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    refuse_unless_own(
        root,
        root.stat(),
        what="the weights folder (engine.weights_dir)",
        open_to=stat.S_IWGRP | stat.S_IWOTH,
        fix=f"whoever writes it can replace the weights the servers load; run "
        f"`chmod go-w {root}` or give engine.weights_dir a folder only you can write",
    )
