"""Every collapse-lab setting is a valid run config (keys exist, values validate)."""

from pathlib import Path

import pytest

from collapse_lab.run import (
    GPU_SIZE,
    LAB_CONFIG,
    LAB_SFT_CONFIG,
    LAB_SFT_SIZE,
    LAB_SIZE,
    lab_clean_eval,
)
from collapse_lab.settings import MISMATCHES, suite
from tir_rl.config import load
from tir_rl.run_config import RunConfig

LAB = Path(__file__).resolve().parents[2] / "bench" / "collapse"

CASES = [
    (name, mismatch, setting)
    for name in ("corrections", "sweep", "causes", "map", "long", "breaking")
    for mismatch in (MISMATCHES if name == "corrections" else ["noise"])
    for setting in suite(name, mismatch)
]


@pytest.mark.parametrize(
    ("suite_name", "mismatch", "setting"), CASES, ids=lambda x: getattr(x, "name", str(x))
)
def test_setting_loads_on_the_base_config(suite_name, mismatch, setting) -> None:
    for size in ((), GPU_SIZE):
        config = load(RunConfig, LAB / "base.yaml", ["model=tiny", *size, *setting.overrides])
        if setting.name.endswith("no_mismatch"):
            assert not config.inject.active
        elif setting.name != "noise_0":
            assert config.inject.active, setting


def test_corrections_suite_covers_every_correction_the_issue_names() -> None:
    names = {s.name for s in suite("corrections")}
    assert {"token_tis", "token_mis", "seq_mis", "geo_rs", "turn_mis", "veto"} <= names
    assert {"no_mismatch", "uncorrected"} <= names


@pytest.mark.parametrize(
    ("suite_name", "mismatch", "setting"), CASES, ids=lambda x: getattr(x, "name", str(x))
)
def test_setting_loads_on_the_lab_config(suite_name, mismatch, setting) -> None:
    chosen = list(setting.overrides)
    overrides = ["model=tiny", *LAB_SIZE, *lab_clean_eval(chosen), *chosen]
    config = load(RunConfig, LAB_CONFIG, overrides)
    assert config.run.tasks_per_step == (2 if suite_name == "long" else 4)
    assert config.trainer.train_only == ("model.norm.weight",)
    assert config.run.eval_clean_sampler == (config.inject.sampler_dtype is None)


@pytest.mark.parametrize("setting", suite("map") + suite("sft_long"), ids=lambda s: s.name)
def test_map_setting_loads_on_the_trained_lab_models_config(setting) -> None:
    chosen = list(setting.overrides)
    overrides = ["model=tiny", *LAB_SFT_SIZE, *lab_clean_eval(chosen, LAB_SFT_CONFIG), *chosen]
    config = load(RunConfig, LAB_SFT_CONFIG, overrides)
    assert not config.trainer.train_only
    assert config.trainer.lr == (3e-4 if "_lr3e-4" in setting.name else 1e-4), setting.name
    assert config.run.eval_clean_sampler == (config.inject.sampler_dtype is None)
    assert (config.correction.bypass != "off") == ("_bypass_" in setting.name), setting.name
    presets = [o.split("=", 1)[1] for o in chosen if o.startswith("correction_preset=")]
    named = next(
        (p for p in ("geo_rs_token_tis", "geo_rs", "token_tis") if f"_{p}_" in setting.name), "none"
    )
    assert presets[-1] == named, setting.name
    if setting in suite("sft_long"):
        assert config.run.steps == int(setting.name.rsplit("_", 1)[1]), setting.name


@pytest.mark.parametrize("cause", ["stale", "raw", "async", "none"])
def test_each_stabilizer_arm_runs_in_its_own_update_mode_or_else_in_the_cause_s(cause) -> None:
    from collapse_lab.settings import STABILIZER_CAUSES

    cause_bypasses = STABILIZER_CAUSES[cause][1] == "bypass"
    for setting in suite(f"stabilizers_{cause}"):
        chosen = list(setting.overrides)
        overrides = ["model=tiny", *LAB_SFT_SIZE, *lab_clean_eval(chosen, LAB_SFT_CONFIG), *chosen]
        config = load(RunConfig, LAB_SFT_CONFIG, overrides)
        arm = setting.name.removeprefix(f"{cause}_")
        bypasses = config.correction.bypass != "off"
        if arm in ("uncorrected", "preset"):
            assert bypasses == cause_bypasses, setting.name
        else:  # VCPO and the combination recompute; the others take their ratio to the sampler
            assert bypasses == (arm not in ("vcpo", "preset_vcpo")), setting.name
        if arm.startswith("preset"):
            assert config.correction.geo_mask is not None, setting.name
        vcpo = arm.endswith("vcpo")
        assert config.trainer.ess_step_size.enabled == config.trainer.optimal_baseline == vcpo


def test_map_covers_both_update_modes_at_two_horizons_for_every_mismatch() -> None:
    from collapse_lab.settings import MAP_MISMATCHES

    names = {s.name for s in suite("map")}
    for key, _, _ in MAP_MISMATCHES:
        for horizon in (4, 8):
            assert {f"h{horizon}_bypass_{key}", f"h{horizon}_decoupled_{key}"} <= names
    for setting in suite("map"):
        config = load(RunConfig, LAB_CONFIG, ["model=tiny", *LAB_SIZE, *setting.overrides])
        bypass = config.correction.bypass != "off"
        assert bypass == ("_bypass_" in setting.name), setting.name
        assert config.rollout.max_turns > config_horizon(config), setting.name


def config_horizon(config: RunConfig) -> int:
    return int(config.env.kwargs["horizon"])


def test_only_runs_the_named_settings_in_the_given_order_and_refuses_unknown_names() -> None:
    from collapse_lab.run import pick

    settings = suite("map")
    chosen = pick(settings, ["h4_decoupled_stale_4", "h8_no_mismatch"])
    assert [s.name for s in chosen] == ["h4_decoupled_stale_4", "h8_no_mismatch"]
    with pytest.raises(SystemExit, match="h8_typo"):
        pick(settings, ["h8_no_mismatch", "h8_typo"])


def test_an_unfinished_run_resumes_from_its_checkpoint_and_one_without_starts_again(tmp_path):
    from collapse_lab.run import command_for

    fresh = ["tir-rl", "train", "--config", "lab.yaml"]
    assert command_for(tmp_path / "new", fresh) == (fresh, False)
    started = tmp_path / "started"
    (started / "checkpoints").mkdir(parents=True)
    (started / "metrics.jsonl").write_text("{}\n")
    assert command_for(started, fresh) == (fresh, False) and not started.exists()
    resumable = tmp_path / "resumable"
    (resumable / "checkpoints" / "step_50").mkdir(parents=True)
    (resumable / "checkpoints" / "step_50" / "trainer_state.json").write_text("{}")
    assert command_for(resumable, fresh) == (["tir-rl", "train", "--resume", str(resumable)], True)


def test_a_resumed_run_is_timed_over_all_its_attempts(tmp_path) -> None:
    from collapse_lab.run import record_attempt

    assert record_attempt(tmp_path, 600.0) == [600.0]
    assert record_attempt(tmp_path, 30.5) == [600.0, 30.5]


def test_core_pinning_refuses_a_core_this_process_may_not_use() -> None:
    import os

    from collapse_lab.run import pin_to_core

    allowed = os.sched_getaffinity(0)
    with pytest.raises(SystemExit, match="may use cores"):
        pin_to_core(max(allowed) + 1)
    assert os.sched_getaffinity(0) == allowed  # refused before anything changed
