"""LoRA through `peft`: wrap the policy, merge its weights for the engine, save the adapter.

With `trainer.lora.enabled`, the trainer wraps its model in a `peft.PeftModel` whose LoRA
layers hold A [r, in] and B [out, r] beside each targeted `nn.Linear`'s frozen weight
W [out, in]; only A and B train (AdamW holds state for them alone). The forward is
y = W x + scale · B A dropout(x), scale = alpha / r. The engine cannot run adapters, so what
it gets after an update is the merged weight W + scale · B A under the base model's
Hugging Face names, computed beside the model (nothing in the trained model is mutated):

    PeftModel ──► merged_state_dict ──► {HF name: W (+ scale·B A)} ──► engine / model/ folder
        └──────► save_adapter ──► adapter/ (peft's save_pretrained: PeftModel.from_pretrained)

`peft` is the optional extra `tir-rl[lora]`; it is imported only when LoRA is configured.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER_NAME = "default"
"""The one adapter the trainer trains (peft's default name)."""

INITS = ("default", "pissa")
"""How the adapters can start (`trainer.lora.init`)."""


@dataclass(kw_only=True)
class LoRAConfig:
    """LoRA adapters on the policy (the `trainer.lora` section; needs `tir-rl[lora]`)."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model. The other fields may be set only when
    this is true (otherwise they are refused, not ignored)."""
    r: int = 8
    """Rank of each adapter (A is [r, in], B is [out, r])."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input during the update (0 keeps the update's logprobs
    equal to those the engine reproduces with the merged weights)."""
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """The `nn.Linear` modules that get an adapter, as fnmatch patterns matched against the
    full module name (`model.layers.2.mlp.*`) or its last part (peft's style: `q_proj`).
    A pattern that matches no linear module is refused; so is a tied embedding or head."""
    init: str = "default"
    """How A and B start; either way the adapted model starts as the base model.
    `default`: A random, B zero (LoRA's own initialisation). `pissa`: B A is the top-r part
    of W's singular value decomposition and the frozen weight becomes the residual
    W − scale·B A (PiSSA), so the adapters train W's principal directions, shared by every
    output row; r must not exceed any target's smaller dimension (docs/lora.md)."""

    def validate(self) -> None:
        """Check values a user can get wrong; adapter settings without `enabled` are refused."""
        if not self.enabled:
            changed = [f.name for f in fields(self) if getattr(self, f.name) != f.default]
            if changed:
                raise ConfigError(
                    f"trainer.lora.{changed[0]} is set but trainer.lora.enabled is false, so it "
                    "would be ignored. Set trainer.lora.enabled=true to train LoRA adapters, "
                    "or drop the trainer.lora settings."
                )
            return
        if self.r <= 0:
            raise ConfigError(f"trainer.lora.r must be a positive rank, got {self.r}.")
        if self.alpha <= 0:
            raise ConfigError(f"trainer.lora.alpha must be > 0, got {self.alpha}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout}.")
        if self.init not in INITS:
            raise ConfigError(
                f"trainer.lora.init {self.init!r} is not known: choose one of "
                f"{', '.join(INITS)}.{did_you_mean(self.init, INITS)}"
            )
        if not self.target_modules:
            raise ConfigError(
                "trainer.lora.target_modules is empty: name the linear modules to adapt "
                "(e.g. [q_proj, v_proj] or [model.layers.2.mlp.*])."
            )

    @property
    def scale(self) -> float:
        """The factor on B A: alpha / r."""
        return self.alpha / self.r

    @property
    def adapters_off_is_start(self) -> bool:
        """Whether the model with its adapters disabled is the starting policy.

        Not under PiSSA, whose frozen weights are the residual of the decomposition.
        """
        return self.init == "default"


def import_peft() -> Any:
    """The `peft` module, or a ConfigError that says how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            'trainer.lora.enabled needs peft, the optional extra: pip install "tir-rl[lora]"'
        ) from exc
    return peft


def resolve_targets(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Full names of the `nn.Linear` modules the patterns match (refusing what cannot work).

    Raises:
        ConfigError: a pattern matches no linear module, or matches a tied input embedding
            or output head (the engine ties them back, so a merged head would be lost).
    """
    from torch import nn

    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    tied = _tied_linear_names(model)
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in linear if _matches(n, pattern)]
        if not hits:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ConfigError(
                f"trainer.lora.target_modules pattern {pattern!r} matches no linear module of "
                f"the model (names look like {linear[0]!r}; last parts: {', '.join(leaves)})."
                f"{did_you_mean(pattern, [*linear, *leaves])}"
            )
        for name in hits:
            if name in tied:
                raise ConfigError(
                    f"trainer.lora.target_modules pattern {pattern!r} matches {name!r}, whose "
                    "weight is tied to the input embedding (tie_word_embeddings); vLLM ties "
                    "them again on load, so the merged head would not reach the engine. "
                    "Target other modules."
                )
            if name not in chosen:
                chosen.append(name)
    return chosen


def wrap(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """`model` inside a `peft.PeftModel` with LoRA on the targeted modules (only they train)."""
    peft = import_peft()
    targets = resolve_targets(model, config.target_modules)
    if config.init == "pissa":
        _check_rank_fits(model, targets, config.r)
    lora_config = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        bias="none",
        init_lora_weights="pissa" if config.init == "pissa" else True,
    )
    return peft.get_peft_model(model, lora_config, adapter_name=ADAPTER_NAME)


def _check_rank_fits(model: nn.Module, targets: list[str], r: int) -> None:
    """PiSSA takes r singular vectors of every target: refuse a rank a target cannot give."""
    modules = dict(model.named_modules())
    for name in targets:
        out_features, in_features = modules[name].weight.shape
        if r > min(out_features, in_features):
            raise ConfigError(
                f"trainer.lora.init=pissa takes the top r={r} singular vectors of each target, "
                f"but {name!r} is [{out_features}, {in_features}]: choose "
                f"r <= {min(out_features, in_features)} or leave init at default."
            )


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's HF-named state dict (CPU) with every adapter merged: W + scale·B A.

    Computed beside the model: no weight of `model` (a `PeftModel`) changes.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()  # the transformers model, LoRA layers injected
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in inner.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER_NAME)
        state: dict[str, torch.Tensor] = {}
        for key, value in inner.state_dict().items():
            if ".lora_" in key:
                continue
            hf_key = key.replace(".base_layer.", ".")
            tensor = value.detach()
            if hf_key in deltas:
                tensor = tensor + deltas[hf_key].to(tensor.dtype)
            state[hf_key] = tensor.cpu()
    return state


def save_adapter(model: nn.Module, folder: Path) -> None:
    """Write the adapter where `peft.PeftModel.from_pretrained(base, folder)` loads it.

    A and B only: peft would also save the base weight of a targeted `lm_head` (it counts it
    as an embedding layer), 4 bytes per vocabulary entry × hidden size, which the base model
    already holds (PiSSA's residual included: peft recomputes it on load).
    """
    model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)


def load_adapter(model: nn.Module, folder: Path) -> None:
    """Load the adapter weights saved by `save_adapter` into the wrapped `model`.

    Raises:
        ConfigError: `folder` holds no adapter, or its tensors do not fit the model's.
    """
    peft = import_peft()
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"{folder} holds no LoRA adapter (no adapter_config.json).")
    weights = peft.utils.load_peft_weights(str(folder), device="cpu")
    result = peft.set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise ConfigError(
            f"The adapter in {folder} does not fit the configured LoRA (unexpected tensors "
            f"such as {unexpected[0]!r}); resume with the run's own trainer.lora settings."
        )


def _matches(name: str, pattern: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(leaf, pattern)


def _tied_linear_names(model: nn.Module) -> set[str]:
    """The linear module whose weight is the input embedding's (a tied head), if any."""
    get_in = getattr(model, "get_input_embeddings", None)
    embedding = get_in() if get_in is not None else None
    if embedding is None:
        return set()
    return {
        name
        for name, m in model.named_modules()
        if getattr(m, "weight", None) is embedding.weight and m is not embedding
    }
