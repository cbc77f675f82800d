import pytest

from tir_rl.config import load
from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig


def test_adapter_settings_without_enabled_are_refused_not_ignored():
    with pytest.raises(ConfigError, match="trainer.lora.r is set but trainer.lora.enabled"):
        load(RunConfig, None, ["model=tiny", "trainer.lora.r=32"])


def test_enabled_lora_takes_its_settings():
    config = load(RunConfig, None, ["model=tiny", "trainer.lora.enabled=true", "trainer.lora.r=32"])
    assert config.trainer.lora.r == 32 and config.trainer.lora.scale == 0.5


def test_default_section_loads_untouched():
    assert load(RunConfig, None, ["model=tiny"]).trainer.lora.enabled is False


def test_lora_init_is_chosen_in_the_run_config_and_checked():
    config = load(RunConfig, None, ["model=tiny", "trainer.lora.enabled=true",
                                    "trainer.lora.init=pissa"])  # fmt: skip
    assert config.trainer.lora.init == "pissa" and not config.trainer.lora.adapters_off_is_start
    with pytest.raises(ConfigError, match="init 'svd' is not known: choose one of default, pissa"):
        load(RunConfig, None, ["model=tiny", "trainer.lora.enabled=true", "trainer.lora.init=svd"])
