import gzip
import json
import math
import sys
import warnings

import numpy as np
import pytest
import torch

from tir_rl.report.metrics_logger import MetricsLogger
from tir_rl.report.run_log import (
    KEPT_METRICS_FILE,
    METRICS_FILE,
    load_trajectories,
    read_metrics,
    save_trajectories,
)
from tir_rl.report.sinks import TENSORBOARD_DIR, LoggerName, TensorBoardSink
from tir_rl.types import Message, RolloutStatus, ToolCall, Trajectory


def make_logger(tmp_path, **overrides):
    config = MetricsLogger.Config(run_dir=tmp_path / "run", loggers=[LoggerName.JSONL], **overrides)
    return MetricsLogger.open(config)


def strict_loads(line):
    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_round_trip_writes_non_finite_as_null(tmp_path):
    with make_logger(tmp_path) as logger:
        logger.log(0, {"train/loss": 0.5, "mismatch/kl": float("nan")})
        logger.log(1, {"train/loss": float("inf"), "train/grad_norm": -math.inf})
        logger.log(2, {"a/np": np.float32(1.5), "a/torch": torch.tensor(2.5), "a/flag": True})
    lines = (tmp_path / "run" / METRICS_FILE).read_text().splitlines()
    raw = [strict_loads(line) for line in lines]
    assert [r["step"] for r in raw] == [0, 1, 2]
    assert raw[0]["mismatch/kl"] is None and raw[1]["train/loss"] is None
    assert raw[1]["train/grad_norm"] is None
    assert all(isinstance(r["time"], float) for r in raw)

    rows = read_metrics(tmp_path / "run")
    assert rows[0]["train/loss"] == 0.5
    assert math.isnan(rows[0]["mismatch/kl"]) and math.isnan(rows[1]["train/loss"])
    assert rows[2]["a/np"] == 1.5 and rows[2]["a/torch"] == 2.5 and rows[2]["a/flag"] == 1.0


def test_non_numeric_and_reserved_keys_are_dropped_with_one_warning_each(tmp_path):
    logger = make_logger(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            logger.log(step, {"x/text": "oops", "step": 99, "x/vec": torch.ones(3), "x/ok": 1})
    logger.close()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3, messages
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(set(r) == {"step", "time", "x/ok"} for r in rows)


def test_log_after_close_raises_and_close_is_idempotent(tmp_path):
    logger = make_logger(tmp_path)
    logger.close()
    logger.close()
    with pytest.raises(ValueError, match="after close"):
        logger.log(0, {"a/b": 1.0})


def test_read_metrics_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 0, "time": 1.0, "a/b": 1}\n{"step": 1, "ti')
    with pytest.warns(UserWarning, match="malformed"):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [0]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_a_gzipped_kept_copy_reads_as_the_file_it_was_made_from(tmp_path):
    with make_logger(tmp_path) as logger:
        for step in range(3):
            logger.log(step, {"train/loss": 0.5 * step})
    run = tmp_path / "run"
    written = read_metrics(run)
    (run / KEPT_METRICS_FILE).write_bytes(gzip.compress((run / METRICS_FILE).read_bytes()))
    (run / METRICS_FILE).unlink()
    assert read_metrics(run) == read_metrics(run / KEPT_METRICS_FILE) == written
    assert [r["train/loss"] for r in written] == [0.0, 0.5, 1.0]


def test_resume_drops_rows_after_the_checkpoint_step(tmp_path):
    with make_logger(tmp_path) as logger:
        for step in range(5):
            logger.log(step, {"a/b": float(step)})
    with make_logger(tmp_path, resume_after_step=2) as logger:
        logger.log(3, {"a/b": 30.0})
    rows = read_metrics(tmp_path / "run")
    assert [(r["step"], r["a/b"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


def test_tensorboard_events_are_written_when_available(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = MetricsLogger.Config(run_dir=tmp_path / "run")
    with MetricsLogger.open(config) as logger:
        assert any(isinstance(sink, TensorBoardSink) for sink in logger.sinks)
        for step in range(3):
            logger.log(step, {"train/loss": 1.0 / (step + 1), "mismatch/kl": float("nan")})
    tb_dir = tmp_path / "run" / TENSORBOARD_DIR
    assert list(tb_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert {"train/loss", "mismatch/kl"} <= set(events.Tags()["scalars"])
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])


def test_missing_tensorboard_warns_once_and_keeps_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    config = MetricsLogger.Config(run_dir=tmp_path / "run")
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        logger = MetricsLogger.open(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logger.log(0, {"a/b": 1.0})
        logger.log(1, {"a/b": 2.0})
    logger.close()
    assert not any(isinstance(sink, TensorBoardSink) for sink in logger.sinks)
    assert [r["a/b"] for r in read_metrics(tmp_path / "run")] == [1.0, 2.0]
    assert not (tmp_path / "run" / TENSORBOARD_DIR).exists()


def make_trajectory(**overrides):
    fields = dict(
        prompt_ids=[1, 2, 3],
        completion_ids=[10, 11, 12, 13],
        loss_mask=[1, 1, 0, 1],
        sampler_logprobs=[-0.5, float("-inf"), 0.0, -1.25],
        turn_ids=[0, 0, 0, 1],
        reward=1.0,
        status=RolloutStatus.TRUNCATED_MAX_TURNS,
        group_id=7,
        num_tool_calls=1,
        num_tool_errors=1,
        messages=[
            Message.user("what is 2+2?"),
            Message.assistant("", [ToolCall("python", {"code": "print(2+2)"})]),
            Message.tool("4", name="python"),
            Message.assistant("<answer>4</answer>"),
        ],
        error=None,
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_save_and_load_trajectories_round_trip(tmp_path):
    path = tmp_path / "traj" / "samples.jsonl"
    first = make_trajectory()
    second = make_trajectory(group_id=8, reward=0.0, status=RolloutStatus.ERROR_PARSE, error="bad")
    save_trajectories(path, [first], step=3, trainer_logprobs=[[-0.4, -2.0, float("nan"), -1.0]])
    save_trajectories(path, [second], step=4)
    for line in path.read_text().splitlines():
        strict_loads(line)

    saved = load_trajectories(path)
    assert [s.step for s in saved] == [3, 4]
    loaded = saved[0].trajectory
    assert loaded.messages == first.messages
    assert loaded.status == RolloutStatus.TRUNCATED_MAX_TURNS
    assert loaded.completion_ids == first.completion_ids and loaded.group_id == 7
    assert loaded.sampler_logprobs[0] == -0.5 and math.isnan(loaded.sampler_logprobs[1])
    assert saved[0].trainer_logprobs[:2] == [-0.4, -2.0]
    assert math.isnan(saved[0].trainer_logprobs[2])
    assert saved[1].trainer_logprobs is None
    assert saved[1].trajectory.status == RolloutStatus.ERROR_PARSE
    assert saved[1].trajectory.error == "bad"


def test_save_trajectories_rejects_misaligned_trainer_logprobs(tmp_path):
    with pytest.raises(ValueError, match="trainer logprob lists"):
        save_trajectories(tmp_path / "t.jsonl", [make_trajectory()], 0, trainer_logprobs=[])
