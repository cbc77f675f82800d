import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from tir_rl import config
from tir_rl.errors import ConfigError


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(kw_only=True)
class Inner:
    lr: float = 1e-6
    """learning rate"""
    steps: int = 10
    mode: Mode = Mode.SAFE


@dataclass(kw_only=True)
class Root:
    name: str = "run"
    out: Path = Path("runs")
    kind: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=list)
    cap: float | None = None
    inner: Inner = field(default_factory=Inner)
    options: dict[str, int] = field(default_factory=dict)


def test_yaml_and_overrides_build_the_typed_tree(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ninner:\n  lr: 1e-5\n  mode: fast\ntags: [p, q]\n")
    cfg = config.load(Root, path, ["inner.steps=3", "cap=2.5", "kind=b"])
    assert cfg == Root(
        name="x", kind="b", tags=["p", "q"], cap=2.5, inner=Inner(lr=1e-5, steps=3, mode=Mode.FAST)
    )


def test_a_mapping_override_merges_into_the_files_and_an_empty_one_clears_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("options: {a: 1, b: 2}\n")
    assert config.load(Root, path, ["options={b: 3}"]).options == {"a": 1, "b": 3}
    assert config.load(Root, path, ["options.c=4"]).options == {"a": 1, "b": 2, "c": 4}
    assert config.load(Root, path, ["options={}"]).options == {}
    # in the order given: a later override merges into what the earlier ones left
    assert config.load(Root, path, ["options={}", "options={c: 5}"]).options == {"c": 5}
    assert config.load(Root, path, ["options.a=7", "options={}"]).options == {}


def test_unknown_key_names_the_nearest_valid_key():
    expected = r"Unknown config key 'inner.stpes'. Did you mean 'steps'"
    with pytest.raises(ConfigError, match=expected):
        config.load(Root, None, ["inner.stpes=3"])


def test_wrong_types_are_refused_with_the_path():
    with pytest.raises(ConfigError, match="inner.steps: expected an integer"):
        config.load(Root, None, ["inner.steps=1.5"])
    with pytest.raises(ConfigError, match=r"kind: 'c' is not one of 'a', 'b'"):
        config.load(Root, None, ["kind=c"])
    with pytest.raises(ConfigError, match="inner.mode: 'slow' is not one of"):
        config.load(Root, None, ["inner.mode=slow"])


def test_bad_override_syntax_shows_an_example():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config.parse_overrides(["trainer.lr"])


def test_round_trip_through_yaml(tmp_path):
    cfg = Root(tags=["t"], inner=Inner(mode=Mode.FAST))
    config.dump(cfg, tmp_path / "r.yaml")
    assert config.load(Root, tmp_path / "r.yaml") == cfg


def test_validate_hook_runs():
    @dataclass(kw_only=True)
    class Checked:
        low: float = 0.0
        high: float = 1.0

        def validate(self):
            if self.low > self.high:
                raise ConfigError("low must not exceed high")

    with pytest.raises(ConfigError, match="low must not exceed high"):
        config.from_dict(Checked, {"low": 2.0})


def test_partial_section_keeps_the_defaults_of_the_field():
    @dataclass(frozen=True, kw_only=True)
    class Engine:
        model_path: str
        dtype: str = "float32"

    @dataclass(kw_only=True)
    class Top:
        engine: Engine = field(default_factory=lambda: Engine(model_path="bundled", dtype="bf16"))

    cfg = config.load(Top, None, ["engine.dtype=float16"])
    assert cfg.engine == Engine(model_path="bundled", dtype="float16")


def test_every_shipped_config_loads():
    from tir_rl.run_config import RunConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert len(files) >= 3
    for path in files:
        cfg = config.load(RunConfig, path)
        assert cfg.engine.model_path == cfg.model == cfg.trainer.model, path


def test_engine_and_trainer_follow_model_and_a_different_checkpoint_is_refused():
    from tir_rl.run_config import RunConfig

    cfg = config.load(RunConfig, None, ["model=tiny"])
    assert cfg.engine.model_path == cfg.trainer.model == "tiny"
    same = config.load(RunConfig, None, ["model=tiny", "trainer.model=tiny"])
    assert same.trainer.model == "tiny"
    for key in ("trainer.model", "engine.model_path"):
        with pytest.raises(ConfigError, match=f"{key}='bundled' differs from model='tiny'"):
            config.load(RunConfig, None, ["model=tiny", f"{key}=bundled"])


def test_the_trainer_follows_the_rollout_temperature_and_a_different_one_is_refused():
    from tir_rl.run_config import RunConfig

    cfg = config.load(RunConfig, None, ["rollout.temperature=0.7"])
    assert cfg.trainer.temperature == 0.7  # named once, by the sampler
    same = config.load(RunConfig, None, ["rollout.temperature=0.7", "trainer.temperature=0.7"])
    assert same.trainer.temperature == 0.7  # a saved config, explicit, loads again
    with pytest.raises(ConfigError, match="trainer.temperature=0.5 differs from rollout"):
        config.load(RunConfig, None, ["rollout.temperature=0.7", "trainer.temperature=0.5"])


def test_vllm_kernels_in_the_trainer_turn_the_engines_kv_split_off_and_refuse_it_on():
    import os

    from tir_rl.engine import cpu_platform
    from tir_rl.run_config import RunConfig

    parity = ["trainer.kernels=vllm_cpu", "trainer.packing=packed"]
    cfg = config.load(RunConfig, None, parity)
    assert cfg.engine.local.cpu_attention_split_kv is False
    assert config.load(RunConfig, None, []).engine.local.cpu_attention_split_kv is None
    with pytest.raises(ConfigError, match="engine.local.cpu_attention_split_kv True"):
        config.load(RunConfig, None, [*parity, "engine.local.cpu_attention_split_kv=true"])
    os.environ.pop("VLLM_CPU_ATTN_SPLIT_KV", None)
    with cpu_platform.thread_environment(cfg.engine.local):  # what the engine core inherits
        assert os.environ["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    assert "VLLM_CPU_ATTN_SPLIT_KV" not in os.environ


def test_a_kl_penalty_loads_and_a_reference_model_without_one_is_refused():
    from tir_rl.run_config import RunConfig

    cfg = config.load(RunConfig, None, ["model=tiny", "loss.kl_coef=0.1"])
    assert cfg.loss.kl_coef == 0.1
    assert cfg.trainer.reference_model == ""  # the policy's starting weights, kept as given
    other = config.load(RunConfig, None, ["loss.kl_coef=0.1", "trainer.reference_model=tiny"])
    assert other.trainer.reference_model == "tiny"
    with pytest.raises(
        ConfigError, match=r"trainer.reference_model='tiny' is set but loss.kl_coef"
    ):
        config.load(RunConfig, None, ["trainer.reference_model=tiny"])


def test_the_chat_section_sets_the_format_and_its_options():
    from tir_rl.chat import ChatFormatName
    from tir_rl.run_config import RunConfig

    cfg = config.load(
        RunConfig,
        None,
        ["chat.format=llama3", "chat.system_prompt=Be brief.", "chat.extra_stop_token_ids=[7, 9]"],
    )
    assert cfg.chat.format is ChatFormatName.LLAMA3
    assert (cfg.chat.system_prompt, cfg.chat.extra_stop_token_ids) == ("Be brief.", (7, 9))
    assert config.load(RunConfig, None).chat.format is ChatFormatName.AUTO
    with pytest.raises(ConfigError, match="chat.format"):
        config.load(RunConfig, None, ["chat.format=llama2"])


def test_run_seed_seeds_every_random_source_left_unset():
    from tir_rl.run_config import RunConfig

    seeded = config.load(RunConfig, None, ["run.seed=3"])
    assert (seeded.engine.local.seed, seeded.trainer.seed, seeded.inject.noise_seed) == (3, 3, 3)
    given = config.load(
        RunConfig, None, ["run.seed=3", "engine.local.seed=7", "inject.noise_seed=0"]
    )
    assert (given.engine.local.seed, given.trainer.seed, given.inject.noise_seed) == (7, 3, 0)


def test_degenerate_groups_follow_the_kl_penalty_and_dropping_them_beside_one_is_refused():
    from tir_rl.run_config import RunConfig

    assert config.load(RunConfig, None).run.drop_degenerate_groups is True
    kl = config.load(RunConfig, None, ["loss.kl_coef=0.1"])
    assert kl.run.drop_degenerate_groups is False  # resolved, so the saved config says it
    kept = config.load(RunConfig, None, ["run.drop_degenerate_groups=false"])
    assert kept.run.drop_degenerate_groups is False
    with pytest.raises(ConfigError, match="run.drop_degenerate_groups=true with loss.kl_coef"):
        config.load(RunConfig, None, ["loss.kl_coef=0.1", "run.drop_degenerate_groups=true"])


def test_reinforce_bypass_is_refused_at_load():
    from tir_rl.run_config import RunConfig

    assert (
        config.load(RunConfig, None, ["correction.bypass=ppo_clip"]).correction.bypass == "ppo_clip"
    )
    with pytest.raises(ConfigError, match="'reinforce' is not one of 'off', 'ppo_clip'"):
        config.load(RunConfig, None, ["correction_preset=token_tis", "correction.bypass=reinforce"])


def test_an_injection_sets_the_samplers_dtype_and_logprobs_mode_or_refuses_a_contradiction():
    from tir_rl.run_config import RunConfig

    bf16 = config.load(RunConfig, None, ["inject.sampler_dtype=bfloat16"])
    assert bf16.engine.dtype == "bfloat16"
    raw = config.load(RunConfig, None, ["inject.raw_logprobs=true", "rollout.temperature=0.7"])
    assert raw.engine.logprobs_mode == "raw_logprobs"
    with pytest.raises(ConfigError, match="engine.dtype='float16' contradicts inject.sampler"):
        config.load(RunConfig, None, ["inject.sampler_dtype=bfloat16", "engine.dtype=float16"])
    with pytest.raises(ConfigError, match="engine.logprobs_mode='processed_logits' contradicts"):
        config.load(
            RunConfig,
            None,
            ["inject.raw_logprobs=true", "engine.logprobs_mode=processed_logits",
             "engine.allow_other_logprobs_mode=true"],
        )  # fmt: skip


def test_batch_invariant_kernels_start_the_engine_batch_invariant_and_refuse_the_rest():
    from tir_rl.run_config import RunConfig

    invariant = [
        "trainer.kernels=batch_invariant",
        "trainer.packing=packed",
        "trainer.attn_implementation=eager",
    ]
    assert config.load(RunConfig, None, invariant).engine.local.batch_invariant is True
    assert config.load(RunConfig, None, []).engine.local.batch_invariant is None
    with pytest.raises(ConfigError, match="engine.local.batch_invariant False"):
        config.load(RunConfig, None, [*invariant, "engine.local.batch_invariant=false"])
    with pytest.raises(ConfigError, match="trainer.attn_implementation sdpa"):
        config.load(RunConfig, None, invariant[:2])
    with pytest.raises(ConfigError, match="trainer.packing shared_prefix"):
        config.load(RunConfig, None, [invariant[0], invariant[2]])


def test_vllms_batch_invariant_mode_is_refused_where_vllm_lacks_it_and_set_for_a_start():
    import os

    import torch

    from tir_rl.engine import batch_invariance
    from tir_rl.trainer import Trainer
    from tir_rl.trainer.placement import prepare_device

    if torch.cuda.is_available():
        pytest.skip("the refusals are for a machine without CUDA")
    with pytest.raises(ConfigError, match="CUDA only; this engine runs on cpu"):
        batch_invariance.check_platform(True)
    batch_invariance.check_platform(False)
    cpu_trainer = Trainer.Config(
        kernels="batch_invariant", packing="packed", attn_implementation="eager"
    )
    with pytest.raises(ConfigError, match="batch-invariant CUDA kernels; the trainer runs on cpu"):
        prepare_device(cpu_trainer)
    os.environ.pop(batch_invariance.ENV, None)
    with batch_invariance.environment(True):  # what the engine core inherits
        assert os.environ[batch_invariance.ENV] == "1"
    assert batch_invariance.ENV not in os.environ


def test_validating_a_run_config_changes_nothing_resolving_fills_what_follows():
    import copy

    from tir_rl.run_config import RunConfig

    loaded = config.load(RunConfig, None, ["model=tiny", "correction_preset=token_tis"])
    assert loaded.trainer.model == "tiny" and loaded.correction_preset is None  # resolved
    before = copy.deepcopy(loaded)
    loaded.validate()
    assert loaded == before
    fresh = RunConfig(model="tiny")  # built in code: nothing followed yet
    assert fresh.trainer.temperature is None
    fresh.resolve()
    assert fresh.trainer.temperature == fresh.rollout.temperature and fresh.trainer.model == "tiny"
