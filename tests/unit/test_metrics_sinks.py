"""The metrics logger's fan-out to its sinks, and the run config's `run.loggers` checks."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from tir_rl.config import load
from tir_rl.errors import ConfigError
from tir_rl.report.metrics_logger import MetricsLogger
from tir_rl.report.run_log import read_metrics
from tir_rl.report.sinks import JsonlSink, LoggerName, MetricsRow, TensorBoardSink
from tir_rl.report.wandb_sink import WandbSink
from tir_rl.run_config import RunConfig


class FakeSink:
    """A `MetricsSink` that records what it was given (and can fail on close)."""

    def __init__(self, *, fail_on_close: bool = False) -> None:
        self.rows: list[MetricsRow] = []
        self.configs: list[dict] = []
        self.plots: list[tuple[int, list[Path]]] = []
        self.num_flushes = 0
        self.num_closes = 0
        self.fail_on_close = fail_on_close

    def log(self, row):
        self.rows.append(row)

    def log_config(self, config):
        self.configs.append(dict(config))

    def log_plots(self, step, paths):
        self.plots.append((step, list(paths)))

    def flush(self):
        self.num_flushes += 1

    def close(self):
        self.num_closes += 1
        if self.fail_on_close:
            raise OSError("disk gone")


def test_every_sink_gets_the_same_cleaned_row():
    first, second = FakeSink(), FakeSink()
    logger = MetricsLogger([first, second])
    with pytest.warns(UserWarning):
        logger.log(3, {"train/loss": 0.5, "mismatch/kl": float("nan"), "x/text": "no", "step": 9})
    for sink in (first, second):
        (row,) = sink.rows
        assert row.step == 3 and isinstance(row.time, float)
        assert set(row.values) == {"train/loss", "mismatch/kl"}
        assert row.values["train/loss"] == 0.5 and math.isnan(row.values["mismatch/kl"])
        assert sink.num_flushes == 1
    assert first.rows[0] is second.rows[0]


def test_config_and_plots_fan_out_and_empty_plots_are_not_sent(tmp_path):
    sink = FakeSink()
    logger = MetricsLogger([sink])
    logger.log_config({"run": {"name": "a", "steps": 2}})
    logger.log_plots(2, [])
    logger.log_plots(2, [tmp_path / "reward.png"])
    assert sink.configs == [{"run": {"name": "a", "steps": 2}}]
    assert sink.plots == [(2, [tmp_path / "reward.png"])]


def test_close_closes_every_sink_once_and_raises_the_first_failure():
    broken, healthy = FakeSink(fail_on_close=True), FakeSink()
    logger = MetricsLogger([broken, healthy])
    with pytest.raises(OSError, match="disk gone"):
        logger.close()
    logger.close()
    assert broken.num_closes == 1 and healthy.num_closes == 1
    with pytest.raises(ValueError, match="after close"):
        logger.log(0, {"a/b": 1.0})


def test_open_builds_the_named_sinks_in_order(tmp_path):
    config = MetricsLogger.Config(
        run_dir=tmp_path / "run", loggers=[LoggerName.TENSORBOARD, LoggerName.JSONL]
    )
    with MetricsLogger.open(config) as logger:
        assert [type(s) for s in logger.sinks] == [TensorBoardSink, JsonlSink]
        logger.log(1, {"a/b": 2.0})
    assert [r["a/b"] for r in read_metrics(tmp_path / "run")] == [2.0]


def test_open_refuses_loggers_without_jsonl(tmp_path):
    config = MetricsLogger.Config(run_dir=tmp_path / "run", loggers=[LoggerName.TENSORBOARD])
    with pytest.raises(ConfigError, match="has no 'jsonl'"):
        MetricsLogger.open(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_run_config_defaults_to_jsonl_and_tensorboard():
    config = load(RunConfig)
    assert config.run.loggers == [LoggerName.JSONL, LoggerName.TENSORBOARD]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.loggers=[tensorboard]"], r"has no 'jsonl'.*Add 'jsonl'"),
        (["run.loggers=[jsonl,jsonl]"], "names jsonl more than once"),
        (["run.loggers=[jsonl,wandbb]"], r"'wandbb' is not one of .* Did you mean 'wandb'\?"),
        (["run.loggers=[jsonl]", "wandb.project=mine"], r"wandb.project set .* has no 'wandb'"),
        (["wandb.mode=ofline"], r"Did you mean 'offline'\?"),
    ],
)
def test_run_config_refuses_bad_loggers(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(RunConfig, None, overrides)


def test_wandb_named_but_not_installed_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    assert importlib.util.find_spec("wandb") is None
    with pytest.raises(ConfigError, match=r'pip install "tir-rl\[wandb\]"'):
        load(RunConfig, None, ["run.loggers=[jsonl,wandb]"])
    with pytest.raises(ConfigError, match=r'pip install "tir-rl\[wandb\]"'):
        WandbSink(WandbSink.Config(), run_dir=tmp_path)
    config = MetricsLogger.Config(
        run_dir=tmp_path / "run", loggers=[LoggerName.JSONL, LoggerName.WANDB]
    )
    with pytest.raises(ConfigError, match="not installed"):
        MetricsLogger.open(config)
