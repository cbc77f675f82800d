"""The half of `tir-rl doctor` that needs only the run config (and the model's config.json).

Each check yields a `Finding` (pass / warn / fail, what was seen, and the fix): the chat
format and logprobs semantics, temperature, dtypes, the prefix cache, staleness and the
correction, as `docs/mismatch.md` orders them. `tir_rl.doctor` adds what it measures on a
live engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tir_rl.engine.engine_config import EngineKind
from tir_rl.run_config import RunConfig


class Verdict(StrEnum):
    """Outcome of one check."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    """One row of the doctor's table."""

    check: str
    verdict: Verdict
    detail: str
    fix: str = ""


def static_findings(config: RunConfig, *, tie_word_embeddings: bool | None) -> list[Finding]:
    """Checks that need only the config (and the model's config.json)."""
    engine, trainer, rollout = config.engine, config.trainer, config.rollout
    out = []
    if engine.logprobs_mode == "processed_logprobs":
        out.append(Finding("logprobs semantics", Verdict.PASS, "processed_logprobs"))
    else:
        out.append(Finding(
            "logprobs semantics", Verdict.FAIL,
            f"engine.logprobs_mode={engine.logprobs_mode}: sampler logprobs are not those of "
            "the distribution the tokens were drawn from",
            "--set engine.logprobs_mode=processed_logprobs",
        ))  # fmt: skip
    if trainer.temperature == rollout.temperature:
        out.append(Finding(
            "temperature", Verdict.PASS,
            f"sampler {rollout.temperature} = trainer {trainer.temperature}",
        ))  # fmt: skip
    else:
        out.append(Finding(
            "temperature", Verdict.FAIL,
            f"sampler {rollout.temperature} != trainer {trainer.temperature}",
            "set rollout.temperature and trainer.temperature to the same value",
        ))  # fmt: skip
    cut = rollout.truncation
    if cut.active:
        out.append(Finding(
            "top-p / top-k / min-p", Verdict.PASS,
            f"top_p {cut.top_p:g}, top_k {cut.top_k}, min_p {cut.min_p:g}: the trainer replays "
            "the kept set (the measured kept mass and ratios: 'truncated sampling' below)",
        ))  # fmt: skip
    else:
        out.append(Finding("top-p / top-k / min-p", Verdict.PASS, "off: the whole vocabulary"))
    if engine.dtype == trainer.dtype:
        out.append(Finding("dtype", Verdict.PASS, f"sampler {engine.dtype} = trainer"))
    else:
        out.append(Finding(
            "dtype", Verdict.WARN,
            f"sampler {engine.dtype} vs trainer {trainer.dtype}: a real, measured mismatch "
            "(bf16 vs fp32 here: k3 KL ~1.5e-3, max |Δ| ~0.3)",
            f"--set engine.dtype={trainer.dtype}, or configure a correction "
            "(correction_preset=geo_rs_token_tis)",
        ))  # fmt: skip
    head = "tied to the embedding" if tie_word_embeddings else "untied"
    if engine.dtype == "float32":
        out.append(Finding("lm_head precision", Verdict.PASS, f"float32 on both sides ({head})"))
    else:
        out.append(Finding(
            "lm_head precision", Verdict.WARN,
            f"the sampler computes the lm_head in {engine.dtype} ({head}); low-precision "
            "logits are the largest single source of mismatch on rare tokens",
            "run the sampler in float32 (engine.dtype=float32) where memory allows",
        ))  # fmt: skip
    if not engine.local.clear_kv_on_update:
        out.append(Finding(
            "KV across weight updates", Verdict.WARN,
            "engine.local.clear_kv_on_update=false: tokens sampled after an update attend to keys "
            "and values the old weights computed, and cached prefixes outlive the update",
            "--set engine.local.clear_kv_on_update=true, or compare mismatch/lag_0 with it on",
        ))  # fmt: skip
    out.append(_prefix_caching_finding(config))
    out.append(_staleness_finding(config))
    if config.correction.is_level == "none" and not config.correction.rejects:
        out.append(Finding(
            "correction", Verdict.WARN,
            "metrics only: no importance weights and no rejection",
            "for long-horizon tool use start with correction_preset=geo_rs_token_tis",
        ))  # fmt: skip
    else:
        out.append(Finding("correction", Verdict.PASS, _describe_correction(config)))
    return out


def _prefix_caching_finding(config: RunConfig) -> Finding:
    """The prefix cache as configured, against what it was measured to add per dtype."""
    engine = config.engine
    if engine.kind is not EngineKind.LOCAL:
        return Finding(
            "prefix caching", Verdict.PASS,
            "the servers' own flags decide it: measured below (inference path)",
        )  # fmt: skip
    if not engine.prefix_caching:
        return Finding(
            "prefix caching", Verdict.PASS,
            "off: each turn prefills its whole context again (slower multi-turn sampling)",
        )  # fmt: skip
    if engine.dtype == "float32":
        return Finding(
            "prefix caching", Verdict.PASS,
            "on, float32 sampler: a cache hit was measured to leave logprobs unchanged "
            "(docs/performance.md); measured on this model below (inference path)",
        )  # fmt: skip
    return Finding(
        "prefix caching", Verdict.WARN,
        f"on, {engine.dtype} sampler: in bfloat16 a cache hit multiplied the k3 mismatch by "
        "1.06, 2.3 and 24 on three seeds (docs/performance.md); measured on this model below",
        f"--set engine.local.enable_prefix_caching=false (the default for {engine.dtype}), or keep "
        "a per-token correction on and compare mismatch/k3_kl with the cache off",
    )  # fmt: skip


def _staleness_finding(config: RunConfig) -> Finding:
    """The asynchronous loop's bound against the correction that will see stale tokens."""
    k = config.run.max_staleness
    if k == 0:
        return Finding("staleness", Verdict.PASS, "synchronous (run.max_staleness=0)")
    geo = config.correction.geo_mask
    if geo is not None and geo[1] / max(geo[0], 1e-12) < 1.01:
        return Finding(
            "staleness", Verdict.WARN,
            f"run.max_staleness={k} with geo_mask={geo}: a band for numerical mismatch, which "
            "the policy's drift over one update leaves, so stale sequences are rejected",
            "correction_preset=token_tis (docs/async.md), or widen correction.geo_mask",
        )  # fmt: skip
    return Finding(
        "staleness", Verdict.PASS,
        f"tokens lag the trained weights by at most {k} version(s); late groups: "
        f"{config.run.late_groups}",
    )  # fmt: skip


def _describe_correction(config: RunConfig) -> str:
    c = config.correction
    parts = [f"IS {c.is_level} (cap {c.is_cap:g})" if c.is_level != "none" else "no IS"]
    for name in ("token_mask", "turn_mask", "seq_mask", "geo_mask"):
        if getattr(c, name) is not None:
            parts.append(f"{name} {tuple(getattr(c, name))}")
    if c.veto_threshold is not None:
        parts.append(f"veto {c.veto_threshold:g}")
    return ", ".join(parts)
