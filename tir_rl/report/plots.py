"""PNG plots of a run, drawn from its `metrics.jsonl` (matplotlib, Agg backend).

`write_plots(run_dir)` redraws every plot whose metrics exist into `run_dir/plots/`; each PNG
is written to a temporary file and renamed, so a viewer never sees a half-written image. It
reads the whole metrics file and draws a handful of small figures, cheap enough to call
every few steps. A plot whose metrics are absent is skipped quietly.

Plots and the keys they read (the first key of each tuple that is present wins):

- `reward.png`: `REWARD_KEYS` (train reward mean) and `HELDOUT_KEYS` (held-out accuracy).
- `grad_norm.png`: `GRAD_NORM_KEYS`.
- `mismatch.png`: `MISMATCH_KEYS`, one panel each (`tir_rl.mismatch.metrics` names).
- `mismatch_by_turn.png`: `mismatch/turn_{k}/k3_kl` (else `.../kl`): the latest step per turn
  and a step x turn heatmap.
- `mismatch_by_tool_distance.png`: `mismatch/tool_dist_{bucket}/k3_kl` (else `.../kl`),
  buckets `none` (before any tool response), `0-7`, `8-31`, ... model tokens after it.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tir_rl.report.run_log import read_metrics

PLOTS_DIR = "plots"
REWARD_KEYS = ("rollout/reward_mean", "train/reward_mean", "reward/mean")
"""Mean training reward per step, in order of preference."""
HELDOUT_KEYS = ("eval/pass_at_1", "eval/pass@1", "eval/accuracy", "eval/reward_mean")
"""Held-out accuracy (logged only on evaluation steps)."""
GRAD_NORM_KEYS = ("train/grad_norm",)
MISMATCH_KEYS = (
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
    "mismatch/abs_diff_max",
)
_TURN_KEY = re.compile(r"^mismatch/turn_(\d+)(\+?)/(k3_kl|kl)$")
_DIST_KEY = re.compile(r"^mismatch/tool_dist_(none|\d+-\d+|\d+\+)/(k3_kl|kl)$")

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Series:
    """One metric over steps (rows where it is missing are left out; NaN kept as a gap)."""

    key: str
    steps: list[int]
    values: list[float]


def series(rows: Rows, key: str) -> Series:
    """The values of `key` by step."""
    steps = [int(r["step"]) for r in rows if key in r]
    values = [_as_float(r[key]) for r in rows if key in r]
    return Series(key, steps, values)


def first_present(rows: Rows, keys: Sequence[str]) -> Series | None:
    """The series of the first key in `keys` that has a finite value somewhere."""
    for key in keys:
        s = series(rows, key)
        if any(math.isfinite(v) for v in s.values):
            return s
    return None


def write_plots(run_dir: Path | str, *, rows: Rows | None = None) -> list[Path]:
    """Redraw every plot that has data into `run_dir/plots/`.

    Args:
        run_dir: Run folder holding `metrics.jsonl`.
        rows: Metrics rows already in memory (default: read `run_dir/metrics.jsonl`).

    Returns:
        Paths of the PNGs written (plots without data are skipped).
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir) if rows is None else rows
    if not rows:
        return []
    out_dir = run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers: list[tuple[str, Callable[[Any, Rows], bool]]] = [
        ("reward.png", _draw_reward),
        ("grad_norm.png", _draw_grad_norm),
        ("mismatch.png", _draw_mismatch),
        ("mismatch_by_turn.png", _bucket_drawer(_TURN_KEY, "assistant turn")),
        (
            "mismatch_by_tool_distance.png",
            _bucket_drawer(_DIST_KEY, "model tokens after the last tool response"),
        ),
    ]
    written = []
    for name, draw in drawers:
        if _render(out_dir / name, draw, rows):
            written.append(out_dir / name)
    return written


def _render(path: Path, draw: Callable[[Any, Rows], bool], rows: Rows) -> bool:
    """Draw into a new figure and save it atomically; False when `draw` found no data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure with an Agg canvas: no pyplot, no global backend switch, thread-safe.
    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    if not draw(figure, rows):
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            figure.savefig(f, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _draw_reward(figure: Any, rows: Rows) -> bool:
    train = first_present(rows, REWARD_KEYS)
    heldout = first_present(rows, HELDOUT_KEYS)
    if train is None and heldout is None:
        return False
    ax = figure.subplots()
    if train is not None:
        ax.plot(
            train.steps,
            train.values,
            marker=_marker(train),
            label=f"train ({train.key})",
            color="tab:blue",
        )
    if heldout is not None:
        ax.plot(
            heldout.steps,
            heldout.values,
            "o-",
            label=f"held-out ({heldout.key})",
            color="tab:orange",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("Reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    return True


def _draw_grad_norm(figure: Any, rows: Rows) -> bool:
    s = first_present(rows, GRAD_NORM_KEYS)
    if s is None:
        return False
    ax = figure.subplots()
    ax.plot(s.steps, s.values, marker=_marker(s), color="tab:green")
    if all(v > 0 for v in s.values if math.isfinite(v)):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(s.key)
    ax.set_title("Gradient norm (before clipping)")
    ax.grid(alpha=0.3)
    return True


def _draw_mismatch(figure: Any, rows: Rows) -> bool:
    present = [s for key in MISMATCH_KEYS if (s := first_present(rows, (key,))) is not None]
    if not present:
        return False
    axes = figure.subplots(1, len(present), squeeze=False)[0]
    for ax, s in zip(axes, present, strict=True):
        ax.plot(s.steps, s.values, marker=_marker(s), color="tab:red")
        ax.set_title(s.key.removeprefix("mismatch/"))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    figure.suptitle("Sampler/trainer mismatch by step")
    return True


def bucket_table(rows: Rows, pattern: re.Pattern[str]) -> tuple[list[str], str, list[int], Any]:
    """Per-bucket values of a per-turn or per-distance metric family.

    Returns:
        (bucket labels in order, metric name used (k3_kl preferred), steps that have any of
        them, a [num_steps, num_buckets] float array with NaN where a bucket had no tokens).
        Empty labels when no key matches.
    """
    import numpy as np

    found: dict[str, set[str]] = {}
    for row in rows:
        for key in row:
            m = pattern.match(key)
            if m:
                found.setdefault(m.groups()[-1], set()).add(key)
    metric = "k3_kl" if "k3_kl" in found else ("kl" if "kl" in found else "")
    if not metric:
        return [], "", [], np.zeros((0, 0))
    keys = sorted(found[metric], key=_bucket_order)
    labels = [_bucket_label(k) for k in keys]
    used = [r for r in rows if any(k in r for k in keys)]
    table = np.full((len(used), len(keys)), np.nan)
    for i, row in enumerate(used):
        for j, key in enumerate(keys):
            if key in row:
                table[i, j] = _as_float(row[key])
    return labels, metric, [int(r["step"]) for r in used], table


def _bucket_drawer(pattern: re.Pattern[str], xlabel: str) -> Callable[[Any, Rows], bool]:
    def draw(figure: Any, rows: Rows) -> bool:
        import numpy as np

        labels, metric, steps, table = bucket_table(rows, pattern)
        if not labels:
            return False
        latest, heat = figure.subplots(1, 2, width_ratios=[1, 1.4])
        x = np.arange(len(labels))
        latest.bar(x, np.nan_to_num(table[-1], nan=0.0), color="tab:purple")
        latest.set_xticks(x, labels, rotation=45 if len(labels) > 6 else 0)
        latest.set_xlabel(xlabel)
        latest.set_ylabel(metric)
        latest.set_title(f"latest step ({steps[-1]})")
        latest.grid(alpha=0.3, axis="y")
        image = heat.imshow(
            np.ma.masked_invalid(table.T),
            aspect="auto",
            origin="lower",
            cmap="magma",
            interpolation="nearest",
            extent=_extent(steps, len(labels)),
        )
        heat.set_yticks(np.arange(len(labels)), labels)
        heat.set_xlabel("step")
        heat.set_ylabel(xlabel)
        heat.set_title(f"{metric} by step")
        figure.colorbar(image, ax=heat)
        figure.suptitle(f"Mismatch ({metric}) by {xlabel}")
        return True

    return draw


def _marker(s: Series) -> str | None:
    """Dots when there are few points (a single step would otherwise draw nothing)."""
    return "." if len(s.steps) < 30 else None


def _extent(steps: list[int], num_buckets: int) -> tuple[float, float, float, float]:
    lo, hi = min(steps), max(steps)
    half = 0.5 if hi == lo else (hi - lo) / (2 * max(len(steps) - 1, 1))
    return (lo - half, hi + half, -0.5, num_buckets - 0.5)


def _bucket_label(key: str) -> str:
    return key.split("/")[1].removeprefix("turn_").removeprefix("tool_dist_")


def _bucket_order(key: str) -> tuple[int, int]:
    label = _bucket_label(key)
    if label == "none":
        return (-1, 0)
    digits = re.match(r"\d+", label)
    return (int(digits.group()) if digits else 1 << 30, label.endswith("+"))


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
