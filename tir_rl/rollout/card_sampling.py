"""Sampling as the model's card says: the settings its `generation_config.json` declares.

A model's authors write the sampling they recommend into the checkpoint's
`generation_config.json` (Qwen3: temperature 0.6, top_p 0.95, top_k 20; Llama 3.1:
temperature 0.6, top_p 0.9), which is where vLLM's own server reads its defaults from.
`rollout.sampling_from: model` takes temperature, top_p, top_k and min_p from there, only when
asked; the trainer then divides by that temperature and replays that kept set like any other
(docs/mismatch.md). What the card asks for beyond those (a repetition, presence or frequency
penalty) the trainer cannot replay, so tir-rl does not apply it and says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from tir_rl.errors import ConfigError

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Settings a card may ask for that change the sampler's distribution and that tir-rl neither
applies nor replays, with their neutral values."""


class SamplingSource(StrEnum):
    """Where a run's sampling settings come from (`rollout.sampling_from`)."""

    CONFIG = "config"
    """`rollout.temperature`, `top_p`, `top_k` and `min_p` as the config gives them."""
    MODEL = "model"
    """The model's `generation_config.json`; a rollout setting given beside it that differs
    is refused."""


@dataclass(frozen=True)
class CardSampling:
    """The sampling a model's generation config declares (None: not declared)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    not_applied: tuple[str, ...] = ()
    """Settings the card asks for that tir-rl does not apply (`PENALTIES`), as `name=value`."""

    def declared(self) -> dict[str, float | int]:
        """The rollout settings the card declares, by their `rollout` key."""
        values = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
        }
        return {name: value for name, value in values.items() if value is not None}


def read_card_sampling(model_dir: Path) -> CardSampling:
    """The sampling settings of the model in `model_dir`, read from its generation config.

    Raises:
        ConfigError: the folder has no generation config, the card asks for greedy decoding
            (no sampler logprobs to train on), or it declares none of the four settings.
    """
    path = Path(model_dir) / GENERATION_CONFIG
    where = f"rollout.sampling_from=model reads {path}"
    if not path.is_file():
        raise ConfigError(
            f"{where}, which does not exist: the model declares no sampling. Set "
            "rollout.temperature / top_p / top_k / min_p yourself (rollout.sampling_from=config)."
        )
    card = json.loads(path.read_text(encoding="utf-8"))
    if card.get("do_sample") is False:
        raise ConfigError(
            f"{where}: its do_sample is false (greedy decoding), which gives no sampler "
            "logprobs to train on. Set rollout.temperature and the other settings yourself."
        )
    top_k = card.get("top_k")
    sampling = CardSampling(
        temperature=_number(card, "temperature"),
        top_p=_number(card, "top_p"),
        top_k=None if top_k is None or int(top_k) <= 0 else int(top_k),  # 0: off, as in HF
        min_p=_number(card, "min_p"),
        not_applied=tuple(
            f"{name}={card[name]:g}"
            for name, neutral in PENALTIES.items()
            if card.get(name) is not None and float(card[name]) != neutral
        ),
    )
    if not sampling.declared() and top_k is None:
        raise ConfigError(
            f"{where}, which declares no temperature, top_p, top_k or min_p. Set them "
            "yourself (rollout.sampling_from=config)."
        )
    return sampling


def _number(card: dict, name: str) -> float | None:
    value = card.get(name)
    return None if value is None else float(value)
