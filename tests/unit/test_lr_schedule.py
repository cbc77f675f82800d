import math

import pytest

from tir_rl import config
from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig
from tir_rl.trainer.lr_schedule import LRSchedule, lr_factor


def test_constant_is_one_at_every_step():
    assert [lr_factor(s, LRSchedule.CONSTANT) for s in range(4)] == [1.0] * 4


def test_linear_warmup_then_constant():
    factors = [lr_factor(s, LRSchedule.CONSTANT, warmup_steps=3) for s in range(6)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_warms_up_then_decays_to_the_floor_and_stays_there():
    kw = {"warmup_steps": 2, "schedule_steps": 6, "min_lr_ratio": 0.1}
    factors = [lr_factor(s, LRSchedule.COSINE, **kw) for s in range(9)]
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert factors == pytest.approx([1 / 3, 2 / 3, *cos, 0.1, 0.1])
    assert factors[2] == 1.0 and factors[4] == pytest.approx(0.55)  # peak, then half-way


def test_cosine_without_its_length_is_refused():
    with pytest.raises(ConfigError, match="cosine needs trainer.schedule_steps"):
        lr_factor(0, LRSchedule.COSINE)


def test_a_run_config_decays_a_cosine_over_run_steps():
    cfg = config.load(RunConfig, None, ["run.steps=20", "trainer.lr_schedule=cosine"])
    assert cfg.trainer.lr_schedule is LRSchedule.COSINE and cfg.trainer.schedule_steps == 20
    kept = config.load(RunConfig, None, ["trainer.lr_schedule=cosine", "trainer.schedule_steps=7"])
    assert kept.trainer.schedule_steps == 7  # a value the user gave is honoured
    assert config.load(RunConfig, None, []).trainer.lr_schedule is LRSchedule.CONSTANT


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lr_schedule=linear"], r"'linear' is not one of 'constant', 'cosine'"),
        (["trainer.warmup_steps=-1"], "must be >= 0"),
        (["trainer.lr_schedule=cosine", "trainer.min_lr_ratio=1.5"], r"must be in \[0, 1\]"),
        (["trainer.min_lr_ratio=0.1"], "no effect with trainer.lr_schedule=constant"),
        (["trainer.schedule_steps=5"], "no effect with trainer.lr_schedule=constant"),
        (
            ["run.steps=4", "trainer.lr_schedule=cosine", "trainer.warmup_steps=4"],
            "warmup_steps=4 must be smaller than trainer.schedule_steps=4",
        ),
    ],
)
def test_bad_schedule_settings_are_refused_at_load_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(RunConfig, None, overrides)
