"""Run outputs that people and tools read: `metrics.jsonl`, TensorBoard scalars, trajectories.

Layout of a run folder written here::

    runs/NAME/
      metrics.jsonl          one JSON object per step: {"step": int, "time": float, "a/b": float}
      tensorboard/           TensorBoard event files (only when the `tensorboard` package exists)
      trajectories.jsonl     sample episodes, one `Trajectory.to_dict()` per line (the caller
                             picks the file; `save_trajectories` only appends)

Non-finite metric values (NaN, ±inf) are written as JSON `null` and read back as NaN: a
diverging run must still leave a readable log. Nothing here raises on bad metric values.
"""

from __future__ import annotations

import json
import math
import numbers
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tir_rl.types import EpisodeTimings, Message, Role, RolloutStatus, ToolCall, Trajectory

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "time")


class MetricsLogger:
    """Writes one JSONL row (and TensorBoard scalars) per training step.

    Example:
        >>> logger = MetricsLogger(MetricsLogger.Config(run_dir=Path("runs/demo")))
        >>> logger.log(0, {"train/loss": 0.5, "mismatch/kl": 1e-4})
        >>> logger.close()
    """

    @dataclass(kw_only=True)
    class Config:
        """Where and how metrics are written."""

        run_dir: Path
        """Run folder; created if missing. Metrics go to `run_dir/metrics.jsonl`."""
        tensorboard: bool = True
        """Also write TensorBoard scalars to `run_dir/tensorboard/` (skipped with one warning
        when the `tensorboard` package is not installed)."""
        flush_every_step: bool = True
        """Flush the JSONL file (and TensorBoard) after every `log` call, so a crash or a
        live `write_plots` never sees a half-written step."""
        resume_after_step: int | None = None
        """When resuming from a checkpoint taken at this step: drop rows with a larger step
        from `metrics.jsonl` (and purge them from TensorBoard) before appending."""

    def __init__(self, config: MetricsLogger.Config) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if config.resume_after_step is not None and self.path.exists():
            _truncate_after(self.path, config.resume_after_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._warned_keys: set[str] = set()
        self._writer: Any = None
        if config.tensorboard:
            self._writer = _open_summary_writer(
                self.run_dir / TENSORBOARD_DIR, purge_step=_purge_step(config.resume_after_step)
            )

    @property
    def tensorboard_enabled(self) -> bool:
        """Whether TensorBoard events are being written."""
        return self._writer is not None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one row: `{"step": step, "time": now, **metrics}`.

        Args:
            step: Training step (the x axis of every plot).
            metrics: Slash-namespaced names to numbers (Python numbers, numpy or 0-d torch
                scalars). Non-finite values become null; non-numeric values are dropped with
                one warning per key.
        """
        if self._file.closed:
            raise ValueError("MetricsLogger.log called after close()")
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        scalars: dict[str, float] = {}
        for key, value in metrics.items():
            number = self._to_float(key, value)
            if number is None:
                continue
            scalars[key] = number
            row[key] = number if math.isfinite(number) else None
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        if self._writer is not None:
            for key, number in scalars.items():
                self._writer.add_scalar(key, number, global_step=int(step))
        if self.config.flush_every_step:
            self.flush()

    def flush(self) -> None:
        """Flush buffered rows to disk."""
        self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the sinks (idempotent)."""
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            warnings.warn(message, stacklevel=3)


def _purge_step(resume_after_step: int | None) -> int | None:
    return None if resume_after_step is None else resume_after_step + 1


def _open_summary_writer(log_dir: Path, *, purge_step: int | None) -> Any:
    """A TensorBoard `SummaryWriter`, or None (with one warning) when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            "tensorboard is not installed: writing metrics.jsonl only "
            "(pip install tensorboard to get TensorBoard events)",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _truncate_after(path: Path, step: int) -> None:
    """Rewrite `path` keeping rows with `step <= step` (atomically)."""
    kept = [row for row in read_metrics(path) if row["step"] <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(finite_or_none(row), allow_nan=False) + "\n")
    tmp.replace(path)


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a `metrics.jsonl`, in file order; null values come back as NaN.

    A malformed line (a run killed mid-write) is skipped with a warning; a missing file
    gives an empty list.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{number}: skipping malformed metrics line", stacklevel=2)
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                warnings.warn(f"{path}:{number}: skipping row without an int step", stacklevel=2)
                continue
            rows.append({k: math.nan if v is None else v for k, v in row.items()})
    return rows


# --- trajectories ----------------------------------------------------------------------------


@dataclass
class SavedTrajectory:
    """One line of a trajectories JSONL file."""

    step: int
    """Training step at which the episode was sampled."""
    trajectory: Trajectory
    trainer_logprobs: list[float] | None = None
    """Trainer logprobs of `trajectory.completion_ids` when they were saved with it."""


def save_trajectories(
    path: Path | str,
    trajectories: Iterable[Trajectory],
    step: int,
    *,
    trainer_logprobs: Sequence[Sequence[float]] | None = None,
) -> None:
    """Append `trajectories` to the JSONL file `path`, one `Trajectory.to_dict()` per line.

    Each line also carries `"step"` and, when given, `"trainer_logprobs"` (one list per
    trajectory, aligned with `completion_ids`) so the viewer can colour tokens by the
    sampler/trainer log-ratio. Non-finite floats are written as null.
    """
    trajectories = list(trajectories)
    if trainer_logprobs is not None and len(trainer_logprobs) != len(trajectories):
        raise ValueError(
            f"got {len(trainer_logprobs)} trainer logprob lists for {len(trajectories)} "
            "trajectories"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for i, trajectory in enumerate(trajectories):
            row: dict[str, Any] = {"step": int(step), **trajectory.to_dict()}
            if trainer_logprobs is not None:
                row["trainer_logprobs"] = [float(x) for x in trainer_logprobs[i]]
            f.write(json.dumps(finite_or_none(row), allow_nan=False) + "\n")


def load_trajectories(path: Path | str) -> list[SavedTrajectory]:
    """Read back a file written by `save_trajectories` (null logprobs become NaN)."""
    saved = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                saved.append(_saved_from_dict(json.loads(line)))
    return saved


def trajectory_from_dict(data: Mapping[str, Any]) -> Trajectory:
    """Inverse of `Trajectory.to_dict()` (tolerates nulls for non-finite logprobs)."""
    messages = [
        Message(
            role=Role(m["role"]),
            content=m["content"],
            tool_calls=tuple(ToolCall(c["name"], c["arguments"]) for c in m.get("tool_calls", ())),
            name=m.get("name"),
        )
        for m in data.get("messages", ())
    ]
    return Trajectory(
        prompt_ids=list(data["prompt_ids"]),
        completion_ids=list(data["completion_ids"]),
        loss_mask=list(data["loss_mask"]),
        sampler_logprobs=_nan_for_null(data["sampler_logprobs"]),
        turn_ids=list(data["turn_ids"]),
        reward=_nan_for_null([data.get("reward", 0.0)])[0],
        status=RolloutStatus(data.get("status", RolloutStatus.FINISHED)),
        group_id=int(data.get("group_id", 0)),
        num_tool_calls=int(data.get("num_tool_calls", 0)),
        num_tool_errors=int(data.get("num_tool_errors", 0)),
        messages=messages,
        timings=EpisodeTimings(**data.get("timings", {})),
        error=data.get("error"),
    )


def _saved_from_dict(data: Mapping[str, Any]) -> SavedTrajectory:
    trainer = data.get("trainer_logprobs")
    return SavedTrajectory(
        step=int(data.get("step", 0)),
        trajectory=trajectory_from_dict(data),
        trainer_logprobs=None if trainer is None else _nan_for_null(trainer),
    )


def _nan_for_null(values: Iterable[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def finite_or_none(value: Any) -> Any:
    """Copy of a JSON-like value with every non-finite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value
