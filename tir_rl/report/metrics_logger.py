"""`MetricsLogger`: cleans each metrics row once and fans it out to the run's sinks.

The sinks are named by `run.loggers` (`jsonl`, `tensorboard`, `wandb`; see
`report/sinks.py`); `MetricsLogger.open` builds them, `MetricsLogger(sinks)` takes any
objects satisfying the `MetricsSink` protocol. Nothing here raises on bad metric values:
non-numeric values and reserved keys are dropped with one warning per key.
"""

from __future__ import annotations

import contextlib
import numbers
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tir_rl.report.sinks import (
    DEFAULT_LOGGERS,
    JsonlSink,
    LoggerName,
    MetricsRow,
    MetricsSink,
    TensorBoardSink,
    check_logger_names,
)
from tir_rl.report.wandb_sink import WandbSink

RESERVED_KEYS = ("step", "time")


class MetricsLogger:
    """Writes one row per `log` call to every sink (JSONL always; TensorBoard, W&B by name).

    Example:
        >>> logger = MetricsLogger.open(MetricsLogger.Config(run_dir=Path("runs/demo")))
        >>> logger.log(0, {"train/loss": 0.5, "mismatch/kl": 1e-4})
        >>> logger.close()
    """

    @dataclass(kw_only=True)
    class Config:
        """Where and how metrics are written."""

        run_dir: Path
        """Run folder; created if missing. Metrics go to `run_dir/metrics.jsonl`."""
        loggers: Sequence[LoggerName] = DEFAULT_LOGGERS
        """The sinks to open (`run.loggers`); must include `jsonl`."""
        wandb: WandbSink.Config = field(default_factory=WandbSink.Config)
        """Settings of the W&B sink (used when `loggers` names `wandb`)."""
        flush_every_step: bool = True
        """Flush every sink after every `log` call, so a crash or a live `write_plots` never
        sees a half-written step."""
        resume_after_step: int | None = None
        """When resuming from a checkpoint taken at this step: drop rows with a larger step
        from `metrics.jsonl` (and purge them from TensorBoard) before appending, and continue
        the W&B run whose id the run folder keeps."""

    def __init__(self, sinks: Sequence[MetricsSink], *, flush_every_step: bool = True) -> None:
        """Fan out to `sinks` (any objects satisfying `MetricsSink`)."""
        self.sinks: tuple[MetricsSink, ...] = tuple(sinks)
        self.flush_every_step = flush_every_step
        self._closed = False
        self._warned_keys: set[str] = set()

    @classmethod
    def open(cls, config: MetricsLogger.Config) -> MetricsLogger:
        """Open the sinks `config.loggers` names, in order.

        Raises:
            ConfigError: `loggers` lacks `jsonl` or repeats a name; `wandb` is named but not
                installed.
        """
        check_logger_names(config.loggers)
        run_dir = Path(config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        resume = config.resume_after_step
        sinks: list[MetricsSink] = []
        try:
            for name in config.loggers:
                if name is LoggerName.JSONL:
                    sinks.append(JsonlSink(run_dir, resume_after_step=resume))
                elif name is LoggerName.TENSORBOARD:
                    board = TensorBoardSink.open(run_dir, resume_after_step=resume)
                    if board is not None:
                        sinks.append(board)
                elif name is LoggerName.WANDB:
                    resuming = resume is not None
                    sinks.append(WandbSink(config.wandb, run_dir=run_dir, resume=resuming))
                else:  # pragma: no cover (LoggerName is closed)
                    raise AssertionError(name)
        except BaseException:
            for sink in sinks:
                with contextlib.suppress(Exception):
                    sink.close()
            raise
        return cls(sinks, flush_every_step=config.flush_every_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Send one row `{"step": step, "time": now, **metrics}` to every sink.

        Args:
            step: Training step (the x axis of every plot).
            metrics: Slash-namespaced names to numbers (Python numbers, numpy or 0-d torch
                scalars). Non-finite values are kept (JSONL writes them as null);
                non-numeric values are dropped with one warning per key.
        """
        self._check_open("log")
        values: dict[str, float] = {}
        for key, value in metrics.items():
            number = self._to_float(key, value)
            if number is not None:
                values[key] = number
        row = MetricsRow(step=int(step), time=time.time(), values=values)
        for sink in self.sinks:
            sink.log(row)
        if self.flush_every_step:
            self.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Send the run's resolved config (a nested plain dict) to every sink."""
        self._check_open("log_config")
        for sink in self.sinks:
            sink.log_config(config)

    def log_plots(self, step: int, paths: Sequence[Path]) -> None:
        """Send the PNG plots written at `step` to every sink."""
        self._check_open("log_plots")
        if paths:
            for sink in self.sinks:
                sink.log_plots(step, list(paths))

    def flush(self) -> None:
        """Flush every sink."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Flush and close every sink (idempotent); the first failure is raised after all."""
        if self._closed:
            return
        self._closed = True
        failure: Exception | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 (close the others, then raise the first)
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise ValueError(f"MetricsLogger.{method} called after close()")

    def _to_float(self, key: str, value: Any) -> float | None:
        if key in RESERVED_KEYS:
            self._warn_once(key, f"metric key {key!r} is reserved for the row itself; dropped")
            return None
        if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
            try:
                value = value.item()
            except (ValueError, RuntimeError):
                pass
        if isinstance(value, numbers.Real):
            return float(value)
        self._warn_once(key, f"metric {key!r} has non-numeric value {value!r}; dropped")
        return None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned_keys:
            self._warned_keys.add(key)
            warnings.warn(message, stacklevel=4)
