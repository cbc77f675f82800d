"""The collapse lab's settings: named sets of `--set` overrides on top of `base.yaml`.

A suite is a list of settings run with the same seeds (same task stream per seed). Every
mismatch setting keeps the trainer the faithful fp32 reference and perturbs only the
sampler (`inject.*`, see `tir_rl.mismatch.injection`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One arm of an experiment."""

    name: str
    """Run-folder prefix and the label in plots and tables."""
    overrides: tuple[str, ...]
    """`key=value` overrides passed to `tir-rl train --set`."""
    what: str
    """One line for the report."""


def _noise(std: float) -> tuple[str, ...]:
    return (f"inject.logit_noise_std={std}",)


CORRECTIONS = (
    "token_tis", "token_mis", "geo_rs_token_tis", "turn_mis", "seq_mis", "geo_rs", "veto",
)  # fmt: skip
"""Correction presets compared against no correction (see docs/mismatch.md)."""


def corrections_suite(mismatch: tuple[str, ...], label: str) -> list[Setting]:
    """No mismatch; `mismatch` uncorrected; `mismatch` with each correction preset."""
    settings = [
        Setting("no_mismatch", ("correction_preset=none",), "fp32 sampler = trainer"),
        Setting("uncorrected", (*mismatch, "correction_preset=none"), f"{label}, no correction"),
    ]
    for preset in CORRECTIONS:
        settings.append(
            Setting(preset, (*mismatch, f"correction_preset={preset}"), f"{label}, {preset}")
        )
    return settings


def sweep_suite(stds: tuple[float, ...]) -> list[Setting]:
    """Synthetic logit perturbation of growing size, no correction."""
    return [
        Setting(f"noise_{std:g}", (*_noise(std), "correction_preset=none"), f"noise std {std:g}")
        for std in stds
    ]


def causes_suite() -> list[Setting]:
    """Each real cause of mismatch on its own, no correction."""
    return [
        Setting("no_mismatch", ("correction_preset=none",), "fp32 sampler = trainer"),
        Setting("bf16_sampler", ("inject.sampler_dtype=bfloat16",), "bf16 sampler"),
        Setting("bf16_lm_head", ("inject.lm_head_dtype=bfloat16",), "sampler lm_head in bf16"),
        Setting("raw_logprobs", ("inject.raw_logprobs=true",), "raw (pre-temperature) logprobs"),
        Setting("stale_4", ("inject.sync_every=4",), "weights synced every 4 steps"),
    ]


MISMATCHES: dict[str, tuple[tuple[str, ...], str]] = {
    "noise": (_noise(0.1), "logit noise std 0.1"),
    "bf16": (("inject.sampler_dtype=bfloat16",), "bf16 sampler"),
    "raw": (("inject.raw_logprobs=true",), "raw logprobs"),
    "stale": (("inject.sync_every=4",), "stale weights (sync every 4)"),
}
"""Mismatches the corrections suite can use (`--mismatch NAME`)."""


def suite(name: str, mismatch: str = "noise", noise_std: float | None = None) -> list[Setting]:
    """The settings of suite `name` (`corrections`, `sweep` or `causes`)."""
    if name == "corrections":
        overrides, label = MISMATCHES[mismatch]
        if mismatch == "noise" and noise_std is not None:
            overrides, label = _noise(noise_std), f"logit noise std {noise_std:g}"
        return corrections_suite(overrides, label)
    if name == "sweep":
        return sweep_suite((0.0, 0.03, 0.1, 0.3))
    if name == "causes":
        return causes_suite()
    raise SystemExit(f"unknown suite {name!r}: choose corrections, sweep or causes")
