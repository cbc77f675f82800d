"""Where metrics go: the `MetricsSink` protocol and its JSONL and TensorBoard sinks.

`MetricsLogger` (`report/metrics_logger.py`) cleans each row once and hands it to every sink
the run names in `run.loggers`. A sink receives only finite-or-NaN floats; it decides how to
store them. The W&B sink is `report/wandb_sink.py` (imported only when a run names it).

`metrics.jsonl` is the run's record: plots, `--resume`, the collapse lab and the bench
scripts read it, so the JSONL sink is always open (`check_logger_names` refuses a list
without it).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from tir_rl.errors import ConfigError
from tir_rl.report.run_log import METRICS_FILE, finite_or_none, keep_steps_up_to

TENSORBOARD_DIR = "tensorboard"


class LoggerName(StrEnum):
    """The sinks a run can name in `run.loggers`."""

    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"


DEFAULT_LOGGERS = (LoggerName.JSONL, LoggerName.TENSORBOARD)


def check_logger_names(names: Sequence[LoggerName]) -> None:
    """Refuse a `run.loggers` list without `jsonl` or with a name twice.

    Raises:
        ConfigError: `jsonl` is missing or a name repeats.
    """
    if LoggerName.JSONL not in names:
        raise ConfigError(
            f"run.loggers={[str(n) for n in names]} has no 'jsonl': metrics.jsonl is the run's "
            "record (plots, --resume and the bench scripts read it), so it is always written. "
            "Add 'jsonl' to the list, e.g. --set 'run.loggers=[jsonl,wandb]'."
        )
    repeated = sorted({str(n) for n in names if list(names).count(n) > 1})
    if repeated:
        raise ConfigError(f"run.loggers names {', '.join(repeated)} more than once")


@dataclass(frozen=True)
class MetricsRow:
    """One cleaned metrics row, as every sink receives it."""

    step: int
    """Training step (the x axis of every plot)."""
    time: float
    """Wall-clock time of the row (seconds since the epoch)."""
    values: Mapping[str, float]
    """Slash-namespaced names to floats; non-finite values are kept (NaN, ±inf)."""


class MetricsSink(Protocol):
    """A destination of metrics rows, the run's config and its plots."""

    def log(self, row: MetricsRow) -> None:
        """Record one row."""
        ...

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's resolved config (a nested plain dict)."""
        ...

    def log_plots(self, step: int, paths: Sequence[Path]) -> None:
        """Record the PNG plots just written at `step`."""
        ...

    def flush(self) -> None:
        """Push buffered data to storage."""
        ...

    def close(self) -> None:
        """Flush and release the sink (idempotent)."""
        ...


class JsonlSink:
    """`run_dir/metrics.jsonl`: one `{"step", "time", **values}` object per row.

    Non-finite values are written as null. The config (`config.yaml`) and plots (`plots/`)
    already live in the run folder, so `log_config` and `log_plots` do nothing.
    """

    def __init__(self, run_dir: Path, *, resume_after_step: int | None = None) -> None:
        """Open (append) the file; on resume drop rows after `resume_after_step` first."""
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after_step is not None and self.path.exists():
            keep_steps_up_to(self.path, resume_after_step)
        self._file = self.path.open("a", encoding="utf-8")

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._file.closed

    def log(self, row: MetricsRow) -> None:
        """Append the row as one JSON line."""
        record = finite_or_none({"step": row.step, "time": row.time, **row.values})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Nothing: the run folder's `config.yaml` holds it."""

    def log_plots(self, step: int, paths: Sequence[Path]) -> None:
        """Nothing: the PNGs are in the run folder."""

    def flush(self) -> None:
        """Flush the file."""
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()


class TensorBoardSink:
    """TensorBoard scalars in `run_dir/tensorboard/`."""

    def __init__(self, writer: Any) -> None:
        """Wrap an open `SummaryWriter` (use `TensorBoardSink.open`)."""
        self._writer = writer

    @classmethod
    def open(cls, run_dir: Path, *, resume_after_step: int | None = None) -> TensorBoardSink | None:
        """The sink, or None with one warning when the `tensorboard` package is missing.

        On resume, events after `resume_after_step` are purged.
        """
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn(
                "tensorboard is not installed: writing metrics.jsonl only "
                "(pip install tensorboard to get TensorBoard events)",
                stacklevel=3,
            )
            return None
        purge_step = None if resume_after_step is None else resume_after_step + 1
        writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge_step)
        return cls(writer)

    def log(self, row: MetricsRow) -> None:
        """One scalar per value at `row.step`."""
        for key, number in row.values.items():
            self._writer.add_scalar(key, number, global_step=row.step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Nothing: the run folder's `config.yaml` holds it."""

    def log_plots(self, step: int, paths: Sequence[Path]) -> None:
        """Nothing: TensorBoard draws its own charts from the scalars."""

    def flush(self) -> None:
        """Flush the event file."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Close the writer (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
