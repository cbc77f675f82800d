"""Run files that people and tools read back: `metrics.jsonl` and saved trajectories.

Layout of those files in a run folder::

    runs/NAME/
      metrics.jsonl          one JSON object per step: {"step": int, "time": float, "a/b": float}
                             (written by the JSONL sink, `report/sinks.py`; a kept copy may be
                             gzipped as metrics.jsonl.gz, and reads the same)
      trajectories.jsonl     sample episodes, one `Trajectory.to_dict()` per line (the caller
                             picks the file; `save_trajectories` only appends)
      episode_errors.jsonl   every episode that ended in an error, trained on or not:
                             {"step", "group_id", "episode_id", "status", "error"}

Non-finite metric values (NaN, ±inf) are written as JSON `null` and read back as NaN: a
diverging run must still leave a readable log. Nothing here raises on bad metric values.
"""

from __future__ import annotations

import gzip
import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tir_rl.types import EpisodeTimings, Message, Role, RolloutStatus, ToolCall, Trajectory

METRICS_FILE = "metrics.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"
EPISODE_ERRORS_FILE = "episode_errors.jsonl"
KEPT_METRICS_FILE = f"{METRICS_FILE}.gz"


def run_file(run_dir: Path, name: str) -> Path | None:
    """`run_dir / name`, or its gzipped kept copy `name.gz` when only that is there."""
    for candidate in (name, f"{name}.gz"):
        if (run_dir / candidate).is_file():
            return run_dir / candidate
    return None


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a `metrics.jsonl`, in file order; null values come back as NaN.

    `path` may also be its gzipped kept copy, or a run folder holding either. A malformed line
    (a run killed mid-write) is skipped with a warning; a missing file gives an empty list.
    """
    path = Path(path)
    if path.is_dir():
        path = run_file(path, METRICS_FILE) or path / METRICS_FILE
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
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
    trained_version: int | None = None
    """The policy version the trainer updated from when it trained on the episode (a
    token's lag is this minus its `Trajectory.policy_versions` entry)."""


def save_trajectories(
    path: Path | str,
    trajectories: Iterable[Trajectory],
    step: int,
    *,
    trainer_logprobs: Sequence[Sequence[float]] | None = None,
    trained_version: int | None = None,
) -> None:
    """Append `trajectories` to the JSONL file `path`, one `Trajectory.to_dict()` per line.

    Each line also carries `"step"` and, when given, `"trainer_logprobs"` (one list per
    trajectory, aligned with `completion_ids`) so the viewer can colour tokens by the
    sampler/trainer log-ratio, and `"trained_version"` (the policy version the trainer
    updated from) so it can colour them by staleness. Non-finite floats are written as null.
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
            if trained_version is not None:
                row["trained_version"] = int(trained_version)
            f.write(json.dumps(finite_or_none(row), allow_nan=False) + "\n")


def keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from the JSON-lines file `path`; atomic.

    A resumed run replays the steps after its checkpoint and writes their lines again. A
    last line without its newline was cut by the kill that ended the run: it goes too, and
    so does a line that is not a row with an int step (skipped with a warning, as
    `read_metrics` skips it). Lines kept are kept as written.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or not line.endswith("\n"):
            continue
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            row_step = None
        if not isinstance(row_step, int):
            warnings.warn(f"{path}:{number}: dropping a line without an int step", stacklevel=2)
        elif row_step <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def append_episode_errors(path: Path, trajectories: Iterable[Trajectory], step: int) -> None:
    """Append one line per trajectory whose status is an error (nothing when none is).

    A failed episode often carries no tokens and never reaches the batch, so without this
    file its reason would be left only in a count of `rollout/status/*`.
    """
    rows = [
        {
            "step": int(step),
            "group_id": t.group_id,
            "episode_id": t.episode_id,
            "status": t.status.value,
            "error": t.error,
        }
        for t in trajectories
        if t.status.is_error
    ]
    if rows:
        with path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


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
        policy_versions=[int(v) for v in data.get("policy_versions", ())],
        episode_id=None if data.get("episode_id") is None else int(data["episode_id"]),
    )


def _saved_from_dict(data: Mapping[str, Any]) -> SavedTrajectory:
    trainer = data.get("trainer_logprobs")
    return SavedTrajectory(
        step=int(data.get("step", 0)),
        trajectory=trajectory_from_dict(data),
        trainer_logprobs=None if trainer is None else _nan_for_null(trainer),
        trained_version=data.get("trained_version"),
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
