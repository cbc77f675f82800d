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


def _temperature(t: float) -> tuple[str, ...]:
    """Sample (and score) at temperature `t`: raw logprobs only differ from processed off 1."""
    return (f"rollout.temperature={t}", f"trainer.temperature={t}")


CORRECTIONS = (
    "token_tis", "token_mis", "geo_rs_token_tis", "turn_tis", "turn_mis", "seq_mis", "geo_rs",
    "veto",
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


MAP_MISMATCHES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("noise_0.3", _noise(0.3), "logit noise std 0.3"),
    ("bf16_sampler", ("inject.sampler_dtype=bfloat16",), "bf16 sampler"),
    ("noise_1", _noise(1.0), "logit noise std 1"),
    ("noise_0.5", _noise(0.5), "logit noise std 0.5"),
    ("noise_0.7", _noise(0.7), "logit noise std 0.7"),
    ("noise_0.1", _noise(0.1), "logit noise std 0.1"),
    ("noise_0.2", _noise(0.2), "logit noise std 0.2"),
    ("stale_4", ("inject.sync_every=4",), "weights synced every 4 steps"),
    ("bf16_lm_head", ("inject.lm_head_dtype=bfloat16",), "sampler lm_head in bf16"),
    ("noise_3", _noise(3.0), "logit noise std 3"),
    ("raw_T0.8", (*_temperature(0.8), "inject.raw_logprobs=true"), "raw logprobs at T 0.8"),
    ("T0.8_no_mismatch", _temperature(0.8), "T 0.8, exact logprobs (raw_T0.8's control)"),
)
"""The map's mismatches, most informative first (a suite cut short keeps the first ones)."""

BYPASS = ("correction.bypass=ppo_clip",)
"""Bypass mode: the sampler's logprobs serve as PPO's old logprobs (no recompute)."""

MAP_HORIZONS = (8, 4)
MAP_MODES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("bypass", BYPASS),
    ("decoupled", ()),
)


def horizon_overrides(horizon: int) -> tuple[str, ...]:
    """MultiHop at `horizon` with room for every lookup, the answer and a few mistakes."""
    return (f"env.kwargs.horizon={horizon}", f"rollout.max_turns={horizon + 4}")


def map_suite() -> list[Setting]:
    """The breaking-point map: each mismatch x horizon x update mode, no correction.

    Run in this order: per mismatch (most informative first), both horizons and both
    modes, after one mismatch-free reference per horizon (with an exact sampler the two modes
    are the same update).
    """
    settings = [
        Setting(
            f"h{h}_no_mismatch",
            (*horizon_overrides(h), "correction_preset=none"),
            f"horizon {h}, fp32 sampler = trainer",
        )  # fmt: skip
        for h in MAP_HORIZONS
    ]
    for key, overrides, label in MAP_MISMATCHES:
        for h in MAP_HORIZONS:
            for mode, mode_overrides in MAP_MODES:
                settings.append(
                    Setting(
                        f"h{h}_{mode}_{key}",
                        (
                            *horizon_overrides(h),
                            *mode_overrides,
                            *overrides,
                            "correction_preset=none",
                        ),  # fmt: skip
                        f"horizon {h}, {mode}, {label}, no correction",
                    )
                )
    return settings


LONG_RUN: tuple[str, ...] = (
    "run.steps=200",
    "run.eval_every=25",
    "run.tasks_per_step=2",
    "run.plot_every=25",
    "run.checkpoint_every=25",
    "trainer.lr=5.0e-3",
)
"""The long runs' size: 200 steps of 2 tasks x 8 samples, held-out every 25 steps, and a
learning rate 10x below configs/lab.yaml's, at which learning spans tens of steps instead of
five (at 5e-2 the lab policy had converged by step 5, docs/collapse.md B1)."""


def long_suite() -> list[Setting]:
    """200-step runs at horizon 8, and at horizon 4 for contrast: no mismatch, and the map's
    breaking point (logit noise 0.2) uncorrected in both update modes."""
    settings = []
    for h in (8, 4):
        base = (*horizon_overrides(h), *LONG_RUN, "correction_preset=none")
        settings += [
            Setting(f"h{h}_no_mismatch", base, f"horizon {h}, 200 steps, fp32 sampler = trainer"),
            Setting(
                f"h{h}_bypass_noise_0.2",
                (*base, *BYPASS, *_noise(0.2)),
                f"horizon {h}, 200 steps, bypass, logit noise std 0.2, no correction",
            ),
            Setting(
                f"h{h}_decoupled_noise_0.2",
                (*base, *_noise(0.2)),
                f"horizon {h}, 200 steps, decoupled, logit noise std 0.2, no correction",
            ),
        ]
    return settings


SFT_LONG_RUN: tuple[str, ...] = (
    "run.eval_every=50",
    "run.plot_every=50",
    "run.checkpoint_every=50",
)
"""The trained lab model's long runs (`--lab-sft`): make train's 8 x 8, held-out every 50
steps; each setting adds its step count (`_steps`)."""


def _steps(n: int) -> tuple[str, ...]:
    return (f"run.steps={n}",)


def sft_long_suite() -> list[Setting]:
    """300-step runs of the trained lab model at horizon 4, uncorrected unless named: its largest
    real gap (raw logprobs at T 0.8) in both update modes; then, in bypass mode, a sequence
    mask against that gap and a placebo of it, the other real causes (a bf16 sampler,
    weights synced every 4 steps) at T 1, and horizon 8; asynchronous staleness in both
    modes; the decoupled mode, and bypass mode's stale weights and bf16 sampler, at 3x the
    learning rate; stale weights at 3x the learning rate in the decoupled mode too, and at
    the base rate; and 100-step runs of it without correction, with the shipped one, with
    each of that preset's two parts, and with a placebo of its mask."""
    long_run = (*SFT_LONG_RUN, *_steps(300), "correction_preset=none")
    raw = (*_temperature(0.8), "inject.raw_logprobs=true")
    h4, h8 = (*horizon_overrides(4), *long_run), (*horizon_overrides(8), *long_run)
    h4_100 = (*horizon_overrides(4), *SFT_LONG_RUN, *_steps(100))
    lag = "inject.sync_every=4"
    return [
        *(
            Setting(
                f"h4_{mode}_raw_T0.8_300",
                (*h4, *mode_overrides, *raw),
                f"horizon 4, 300 steps, {mode}, raw logprobs at T 0.8, no correction",
            )
            for mode, mode_overrides in MAP_MODES
        ),
        Setting(
            "h4_bypass_raw_T0.8_geo_rs_300",
            (*h4, *BYPASS, *raw, "correction_preset=geo_rs"),
            "horizon 4, 300 steps, bypass, raw logprobs at T 0.8, geo_rs sequence mask",
        ),
        Setting(
            "h4_bypass_raw_T0.8_placebo_0.7_0.2_300",
            (*h4, *BYPASS, *raw, "run.placebo_drop=[0.7, 0.2]"),
            "horizon 4, 300 steps, bypass, raw logprobs at T 0.8, no correction, a placebo "
            "leaving 70% of the failed and 20% of the succeeded episodes out at random (about "
            "what geo_rs rejected there, A2)",
        ),
        Setting(
            "h4_bypass_stale_4_300",
            (*h4, *BYPASS, "inject.sync_every=4"),
            "horizon 4, 300 steps, bypass, weights synced every 4 steps, no correction",
        ),
        Setting(
            "h4_bypass_bf16_sampler_300",
            (*h4, *BYPASS, "inject.sampler_dtype=bfloat16"),
            "horizon 4, 300 steps, bypass, bf16 sampler, no correction",
        ),
        *(
            Setting(
                f"h4_{mode}_async_2_300",
                (*h4, *mode_overrides, "run.max_staleness=2"),
                f"horizon 4, 300 steps, {mode}, asynchronous (max staleness 2), no correction",
            )
            for mode, mode_overrides in MAP_MODES
        ),
        Setting(
            "h4_decoupled_raw_T0.8_lr3e-4_300",
            (*h4, *raw, "trainer.lr=3.0e-4"),
            "horizon 4, 300 steps, decoupled, raw logprobs at T 0.8, AdamW 3e-4, no correction",
        ),
        *(
            Setting(
                f"h4_bypass_{name}_lr3e-4_300",
                (*h4, *BYPASS, cause, "trainer.lr=3.0e-4"),
                f"horizon 4, 300 steps, bypass, {what}, AdamW 3e-4, no correction",
            )
            for name, cause, what in (
                ("stale_4", "inject.sync_every=4", "weights synced every 4 steps"),
                ("bf16_sampler", "inject.sampler_dtype=bfloat16", "bf16 sampler"),
            )
        ),
        Setting(
            "h4_decoupled_stale_4_lr3e-4_300",
            (*h4, lag, "trainer.lr=3.0e-4"),
            "horizon 4, 300 steps, decoupled, weights synced every 4 steps, AdamW 3e-4, "
            "no correction",
        ),
        Setting(
            "h4_decoupled_stale_4_300",
            (*h4, lag),
            "horizon 4, 300 steps, decoupled, weights synced every 4 steps, no correction",
        ),
        *(
            Setting(
                f"h4_decoupled_stale_4_lr3e-4{suffix}_100",
                (*h4_100, lag, "trainer.lr=3.0e-4", f"correction_preset={preset}"),
                f"horizon 4, 100 steps, decoupled, weights synced every 4 steps, AdamW 3e-4, "
                f"correction {preset}",
            )
            for suffix, preset in (
                ("", "none"),
                ("_geo_rs_token_tis", "geo_rs_token_tis"),
                ("_geo_rs", "geo_rs"),
                ("_token_tis", "token_tis"),
            )
        ),
        Setting(
            "h4_decoupled_stale_4_lr3e-4_placebo_0.55_0.2_100",
            (
                *h4_100,
                lag,
                "trainer.lr=3.0e-4",
                "correction_preset=none",
                "run.placebo_drop=[0.55, 0.2]",
            ),
            "horizon 4, 100 steps, decoupled, weights synced every 4 steps, AdamW 3e-4, no "
            "correction, a placebo leaving 55% of the failed and 20% of the succeeded episodes "
            "out at random (about what geo_rs rejected there, A5)",
        ),
        Setting(
            "h8_bypass_raw_T0.8_300",
            (*h8, *BYPASS, *raw),
            "horizon 8, 300 steps, bypass, raw logprobs at T 0.8, no correction",
        ),
    ]


STABILIZER_CAUSES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "stale": (
        (*horizon_overrides(4), *SFT_LONG_RUN, *_steps(100), "inject.sync_every=4",
         "trainer.lr=3.0e-4"),
        "decoupled",
        "weights synced every 4 steps, AdamW 3e-4, 100 steps",
    ),
    "raw": (
        (*horizon_overrides(4), *SFT_LONG_RUN, *_steps(300), *_temperature(0.8),
         "inject.raw_logprobs=true"),
        "bypass",
        "raw logprobs at T 0.8, 300 steps",
    ),
    "async": (
        (*horizon_overrides(4), *SFT_LONG_RUN, *_steps(100), "run.max_staleness=2",
         "trainer.lr=3.0e-4"),
        "decoupled",
        "asynchronous, max staleness 2, AdamW 3e-4, 100 steps",
    ),
    "none": ((), "decoupled", "make train's setting: no injected cause, 10 steps"),
}  # fmt: skip
"""The head-to-head's causes (docs/collapse.md A7): their overrides on `configs/lab_sft.yaml`
(`--lab-sft`), the update mode their uncorrected arm runs in, and a label. `none` is the cost
of stability: each arm on make train's own setting."""

VCPO_SWITCHES = ("trainer.ess_step_size.enabled=true", "trainer.optimal_baseline=true")
"""VCPO's two variance controls, each a switch of tir-rl's trainer."""

VCPO = (
    "correction_preset=seq_tis",
    "correction.is_cap=8.0",
    *VCPO_SWITCHES,
    "loss.aggregation=sequence_mean",
)
"""VCPO as its authors run it (vcpo `vcpo_k=10.sh`): sequence-level truncated IS at 8 on the
recompute (decoupled: with one update per batch PPO's clip never acts, as their disabled
clip), the learning rate scaled by the ESS ratio (sqrt rule, reference 1), the off-policy
optimal baseline per group, sequence-mean aggregation."""

STABILIZER_ARMS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "uncorrected": (None, "no correction, GRPO, the cause's own update mode"),
    "preset": (
        ("correction_preset=geo_rs_token_tis",),
        "the shipped preset geo_rs_token_tis, GRPO, the cause's update mode",
    ),
    "bypass": (
        (*BYPASS, "loss.name=grpo"),
        "GRPO's PPO clip with its ratio to the sampler (bypass mode), no correction: the "
        "control of the arms below, which take their ratio there too",
    ),
    "dppo_tv": ((*BYPASS, "loss.name=dppo_tv"), "DPPO binary TV (δ 0.15), anchored to the sampler"),
    "dppo_kl": ((*BYPASS, "loss.name=dppo_kl"), "DPPO binary KL (δ 0.05), anchored to the sampler"),
    "gspo": ((*BYPASS, "loss.name=gspo"), "GSPO (clip 3e-4 / 4e-4), ratio to the sampler"),
    "cispo": ((*BYPASS, "loss.name=cispo"), "CISPO (weight clip 1.2), ratio to the sampler"),
    "vcpo": (VCPO, "VCPO: sequence TIS 8, ESS-scaled step, optimal baseline"),
    "preset_vcpo": (
        ("correction_preset=geo_rs_token_tis", *VCPO_SWITCHES),
        "the combination (chosen 2026-12-03, after stale and async, before raw): the preset's "
        "weights on the decoupled update with VCPO's ESS-scaled step and optimal baseline",
    ),
}  # fmt: skip
"""The arms, each with its update mode where it has its own: DPPO, GSPO and CISPO take their
ratio against the sampler (bypass mode, DPPO's authors' recommendation): with tir-rl's one
optimizer step per batch their ratio to the recompute is exactly 1 and they would all be
plain policy gradient. `uncorrected` and `preset` run in the cause's own mode (`arm_mode`);
VCPO and the combination `preset_vcpo` recompute (decoupled) under every cause. `bypass`
(PPO's clip in bypass mode) was added after the first seed of `stale`, where every bypass arm
held: it tells what the arms owe to the anchor and what to their own formula (under `raw`,
whose own mode is bypass, it is the uncorrected arm)."""


def truncation_suite() -> list[Setting]:
    """make train's setting sampling the whole vocabulary, and at top_p 0.9 with the trainer
    replaying the kept set and without (docs/mismatch.md, truncated sampling)."""
    top_p = "rollout.top_p=0.9"
    return [
        Setting("top_p_1", (), "make train's setting, top_p 1"),
        Setting("top_p_0.9_replay", (top_p,), "top_p 0.9, the kept set replayed"),
        Setting(
            "top_p_0.9_no_replay",
            (top_p, "trainer.replay_kept_set=false"),
            "top_p 0.9, the trainer scoring the whole vocabulary (the biased ratio)",
        ),
    ]


def stabilizers_suite(cause: str) -> list[Setting]:
    """Every arm of the head-to-head under one cause (`STABILIZER_CAUSES`)."""
    if cause not in STABILIZER_CAUSES:
        raise SystemExit(f"unknown cause {cause!r}: choose {', '.join(STABILIZER_CAUSES)}")
    overrides, mode, label = STABILIZER_CAUSES[cause]
    settings = []
    for arm, (arm_overrides, what) in STABILIZER_ARMS.items():
        settings.append(
            Setting(
                f"{cause}_{arm}",
                (
                    *overrides,
                    "correction_preset=none",
                    *arm_mode(arm, mode),
                    *(arm_overrides or ()),
                ),
                f"{label}; {what}",
            )
        )
    return settings


def arm_mode(arm: str, cause_mode: str) -> tuple[str, ...]:
    """The update-mode overrides an arm runs with under a cause whose uncorrected update runs
    in `cause_mode`: the cause's mode for the arms without one of their own (`uncorrected`,
    `preset`), nothing for the arms that set theirs (bypass mode for DPPO, GSPO, CISPO and
    `bypass`; VCPO's decoupled recompute)."""
    if arm not in ARMS_IN_THE_CAUSE_S_MODE or cause_mode != "bypass":
        return ()
    return BYPASS


ARMS_IN_THE_CAUSE_S_MODE = frozenset({"uncorrected", "preset"})
"""Until 2026-12-03 only `uncorrected` took the cause's mode and `preset` ran decoupled under
every cause. That changed no run of `stale`, `async` or `none` (all decoupled); it was found
before any `raw` run of the preset started (under `raw`, whose mode is bypass, the decoupled
update alone held 3 of 3 seeds in A2, so a decoupled preset would say nothing of the preset)."""


def breaking_point_suite() -> list[Setting]:
    """The corrections suite at the map's breaking point: bypass mode, horizon 8, logit noise
    0.2 (both uncorrected seeds collapsed there), with the decoupled recompute beside it."""
    where = (*horizon_overrides(8), *BYPASS)
    settings = [
        Setting(s.name, (*where, *s.overrides), f"horizon 8, bypass, {s.what}")
        for s in corrections_suite(_noise(0.2), "logit noise std 0.2")
    ]
    settings.append(
        Setting(
            "decoupled",
            (*horizon_overrides(8), *_noise(0.2), "correction_preset=none"),
            "horizon 8, decoupled (the default update), logit noise std 0.2, no correction",
        )
    )
    settings.append(
        Setting(
            "guard_skip",
            (*where, *_noise(0.2), "correction_preset=none", *GUARD_SKIP),
            "horizon 8, bypass, logit noise std 0.2, no correction, the guard skipping updates "
            "from k3 > 0.002",
        )
    )
    return settings


GUARD_SKIP = ('guard.absolute={"mismatch/k3_kl": 0.002}', "guard.action=skip_step")
"""A guard that acts at the breaking point: its k3 limit sits under the gap that collapses
bypass mode there (k3 ~4e-3), where the lab's usual 0.01 never fires."""


MISMATCHES: dict[str, tuple[tuple[str, ...], str]] = {
    "noise": (_noise(0.1), "logit noise std 0.1"),
    "bf16": (("inject.sampler_dtype=bfloat16",), "bf16 sampler"),
    "raw": (("inject.raw_logprobs=true",), "raw logprobs"),
    "stale": (("inject.sync_every=4",), "stale weights (sync every 4)"),
}
"""Mismatches the corrections suite can use (`--mismatch NAME`)."""


def suite(name: str, mismatch: str = "noise", noise_std: float | None = None) -> list[Setting]:
    """The settings of suite `name`: corrections, sweep, causes, map, long, breaking or
    sft_long."""
    if name == "corrections":
        overrides, label = MISMATCHES[mismatch]
        if mismatch == "noise" and noise_std is not None:
            overrides, label = _noise(noise_std), f"logit noise std {noise_std:g}"
        return corrections_suite(overrides, label)
    if name == "sweep":
        return sweep_suite((0.0, 0.03, 0.1, 0.3))
    if name == "causes":
        return causes_suite()
    if name == "map":
        return map_suite()
    if name == "long":
        return long_suite()
    if name == "breaking":
        return breaking_point_suite()
    if name == "sft_long":
        return sft_long_suite()
    if name == "truncation":
        return truncation_suite()
    if name.startswith("stabilizers_"):
        return stabilizers_suite(name.removeprefix("stabilizers_"))
    raise SystemExit(
        f"unknown suite {name!r}: choose corrections, sweep, causes, map, long, breaking, "
        f"sft_long or stabilizers_<cause> ({', '.join(STABILIZER_CAUSES)})"
    )
