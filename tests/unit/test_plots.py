import functools
import math
import subprocess
import sys

import pytest
import torch
from PIL import Image

from tir_rl.mismatch.metrics import mismatch_metrics
from tir_rl.report.metrics_logger import MetricsLogger
from tir_rl.report.plots import _DIST_KEY, _TURN_KEY, PLOTS_DIR, bucket_table, write_plots
from tir_rl.report.run_log import read_metrics
from tir_rl.report.sinks import LoggerName

ALL_PLOTS = {
    "reward.png",
    "grad_norm.png",
    "mismatch.png",
    "mismatch_by_turn.png",
    "mismatch_by_tool_distance.png",
}


@functools.cache
def real_mismatch_metrics():
    """Metrics from the real mismatch module on random logprobs: 2 sequences, 3 turns."""
    generator = torch.Generator().manual_seed(0)
    sampler = -torch.rand(2, 300, generator=generator) * 3
    trainer = sampler + 0.05 * torch.randn(2, 300, generator=generator)
    loss_mask = torch.ones(2, 300, dtype=torch.long)
    loss_mask[:, 100:120] = 0  # tool response after turn 0
    loss_mask[:, 200:210] = 0  # tool response after turn 1
    turn_ids = torch.zeros(2, 300, dtype=torch.long)
    turn_ids[:, 120:] = 1
    turn_ids[:, 210:] = 2
    return mismatch_metrics(trainer, sampler, loss_mask, turn_ids)


def write_synthetic_run(run_dir, *, steps=range(6), with_mismatch=True):
    config = MetricsLogger.Config(run_dir=run_dir, loggers=[LoggerName.JSONL])
    with MetricsLogger.open(config) as logger:
        for step in steps:
            metrics = {"rollout/reward_mean": step / 10, "train/grad_norm": 1.0 + step}
            if step % 3 == 0:
                metrics["eval/pass_at_1"] = 0.1 * step
                metrics["eval/reward_mean"] = 0.05 * step
            if with_mismatch:
                metrics.update({k: v * (1 + step) for k, v in real_mismatch_metrics().items()})
            if step == 2:
                metrics["mismatch/kl"] = float("nan")
            logger.log(step, metrics)


def assert_valid_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size == (800, 450)
        low, high = image.convert("L").getextrema()
        assert low < high  # something was drawn


def test_write_plots_draws_every_plot_and_replaces_them_later(tmp_path):
    write_synthetic_run(tmp_path, steps=range(4))
    written = write_plots(tmp_path)
    assert {p.name for p in written} == ALL_PLOTS
    for path in written:
        assert_valid_png(path)
    first = {p.name: p.read_bytes() for p in written}

    write_synthetic_run(tmp_path, steps=range(4, 7))  # the run goes on: rows are appended
    second = {p.name: p.read_bytes() for p in write_plots(tmp_path)}
    assert second.keys() == ALL_PLOTS
    assert all(first[name] != second[name] for name in ALL_PLOTS)
    leftovers = [p for p in (tmp_path / PLOTS_DIR).iterdir() if p.name not in ALL_PLOTS]
    assert leftovers == []  # no temporary files left behind


def test_reward_plot_prefers_train_reward_and_pass_at_1():
    from tir_rl.report.plots import HELDOUT_KEYS, REWARD_KEYS, first_present

    rows = [
        {"step": 1, "rollout/reward_mean": 0.2},
        {"step": 2, "eval/reward_mean": 0.3, "eval/pass_at_1": float("nan")},
        {"step": 3, "eval/reward_mean": 0.4, "eval/pass_at_1": 0.5},
    ]
    assert first_present(rows, REWARD_KEYS).key == "rollout/reward_mean"
    heldout = first_present(rows, HELDOUT_KEYS)
    assert heldout.key == "eval/pass_at_1" and heldout.steps == [2, 3]
    assert first_present(rows[:2], ("eval/pass_at_1",)) is None  # only NaN: no data


def test_missing_keys_skip_their_plots_quietly(tmp_path):
    write_synthetic_run(tmp_path, with_mismatch=False)
    written = write_plots(tmp_path)
    assert {p.name for p in written} == {"reward.png", "grad_norm.png"}
    assert write_plots(tmp_path / "empty-run") == []


def test_bucket_table_orders_turns_and_tool_distances(tmp_path):
    write_synthetic_run(tmp_path, steps=range(3))
    rows = read_metrics(tmp_path)
    labels, metric, steps, table = bucket_table(rows, _TURN_KEY)
    assert (labels, metric, steps) == (["0", "1", "2"], "k3_kl", [0, 1, 2])
    assert table.shape == (3, 3)
    assert table[1, 2] == pytest.approx(rows[1]["mismatch/turn_2/k3_kl"])

    labels, _, _, table = bucket_table(rows, _DIST_KEY)
    assert labels == ["none", "0-7", "8-31", "32-127"]
    assert all(math.isfinite(v) for v in table.ravel())


def test_bucket_table_falls_back_to_kl_and_keeps_gaps():
    rows = [
        {"step": 0, "mismatch/turn_0/kl": 0.1},
        {"step": 1, "mismatch/turn_0/kl": 0.2, "mismatch/turn_8+/kl": 0.5},
    ]
    labels, metric, steps, table = bucket_table(rows, _TURN_KEY)
    assert (labels, metric, steps) == (["0", "8+"], "kl", [0, 1])
    assert math.isnan(table[0, 1]) and table[1, 1] == 0.5


def test_importing_plots_does_not_import_matplotlib():
    code = "import sys, tir_rl.report.plots; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
