"""Did a run collapse, when, and did the collapse guard see it coming?

The collapse lab's definition (this folder; `report.py` applies it), on a run's
`metrics.jsonl` rows:

- **gradient-norm spike** at step s: ``grad_norm[s] > spike_factor × median`` of the
  ``window`` finite values before it (at least ``min_history`` of them);
- **reward drop** at step s: the trailing mean training reward over ``smooth`` steps falls
  below ``(1 - drop_fraction) ×`` its best value so far, and that best was at least
  ``min_peak_reward`` (a run that never learned anything cannot collapse);
- **collapse**: a reward drop that persists to the end of the run (the last trailing mean is
  still below the threshold), or a drop within ``follow_steps`` after a spike. The collapse
  step is the first step of the drop; ``spike_step`` is the spike before it, if any;
- **persisting** collapse: one whose drop lasts to the end of the run. A drop after a spike
  that recovers is a collapse but not a persisting one (declared after seeing one such dip,
  before judging the runs that followed it);
- **degradation** (weaker): the held-out accuracy at the end is below the one at the start.

The guard's lead time is ``collapse_step - first_alert_step`` for the first alert at or
before the collapse (positive: the alert came first).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tir_rl.errors import ConfigError

REWARD_KEY = "rollout/reward_mean"
GRAD_NORM_KEY = "train/grad_norm"
HELDOUT_KEY = "eval/pass_at_1"
ALERTS_KEY = "guard/alerts"


@dataclass(frozen=True, kw_only=True)
class CollapseCriteria:
    """Thresholds of the collapse definition (see the module docstring)."""

    spike_factor: float = 5.0
    """A gradient norm above this multiple of its rolling median is a spike."""
    window: int = 10
    """Past steps in the rolling median."""
    min_history: int = 3
    """Spikes are looked for once this many past gradient norms are known."""
    smooth: int = 3
    """Steps in the trailing mean of the training reward."""
    drop_fraction: float = 0.5
    """A trailing reward below (1 - this) × its best so far is a drop."""
    min_peak_reward: float = 0.05
    """Best trailing reward needed before a drop counts."""
    follow_steps: int = 5
    """A drop within this many steps after a spike is a collapse even if it recovers."""

    def __post_init__(self) -> None:
        if self.spike_factor <= 1 or not 0 < self.drop_fraction < 1:
            raise ConfigError("spike_factor must be > 1 and drop_fraction in (0, 1)")
        if min(self.window, self.min_history, self.smooth, self.follow_steps) < 1:
            raise ConfigError("window, min_history, smooth and follow_steps must be >= 1")


@dataclass(frozen=True)
class CollapseVerdict:
    """What `judge_run` found in one run's metrics."""

    collapsed: bool
    collapse_step: int | None
    """First step of the reward drop that made it a collapse."""
    persisting: bool
    """A collapse whose drop lasts to the end of the run (False without a collapse)."""
    spike_steps: tuple[int, ...]
    """Every gradient-norm spike."""
    first_alert_step: int | None
    """First step at which the collapse guard raised an alert."""
    degraded: bool
    """Held-out accuracy at the end below the one at the start."""
    heldout_before: float | None
    heldout_after: float | None
    peak_reward: float
    """Best trailing training reward."""
    final_reward: float
    """Trailing training reward at the last step."""

    @property
    def alert_lead_steps(self) -> int | None:
        """Steps from the first alert to the collapse; None without both in that order."""
        if self.collapse_step is None or self.first_alert_step is None:
            return None
        if self.first_alert_step > self.collapse_step:
            return None
        return self.collapse_step - self.first_alert_step


def judge_run(
    rows: Sequence[dict[str, Any]], criteria: CollapseCriteria | None = None
) -> CollapseVerdict:
    """Apply the collapse definition to a run's metric rows (each with a `step`)."""
    c = criteria or CollapseCriteria()
    by_step = trailing_means(values_by_step(rows, REWARD_KEY), c.smooth)
    steps = sorted(by_step)
    trailing = [by_step[s] for s in steps]
    spikes = spike_steps(values_by_step(rows, GRAD_NORM_KEY), c)

    collapse_step, persisting, best = None, False, -math.inf
    for i, value in enumerate(trailing):
        if best >= c.min_peak_reward and value < (1 - c.drop_fraction) * best:
            persists = trailing[-1] < (1 - c.drop_fraction) * best
            after_spike = any(0 <= steps[i] - s <= c.follow_steps for s in spikes)
            if persists or after_spike:
                collapse_step, persisting = steps[i], persists
                break
        best = max(best, value)

    alerts = alert_steps(rows)
    heldout = values_by_step(rows, HELDOUT_KEY)
    first_eval = heldout[min(heldout)] if heldout else None
    last_eval = heldout[max(heldout)] if len(heldout) > 1 else None
    return CollapseVerdict(
        collapsed=collapse_step is not None,
        collapse_step=collapse_step,
        persisting=persisting,
        spike_steps=tuple(spikes),
        first_alert_step=alerts[0] if alerts else None,
        degraded=first_eval is not None and last_eval is not None and last_eval < first_eval,
        heldout_before=first_eval,
        heldout_after=last_eval,
        peak_reward=max(trailing, default=0.0),
        final_reward=trailing[-1] if trailing else 0.0,
    )


def trailing_means(values: dict[int, float], smooth: int) -> dict[int, float]:
    """By step, the mean of the values at that step and the `smooth - 1` steps before it."""
    steps = sorted(values)
    return {
        s: statistics.fmean(values[t] for t in steps[max(0, i - smooth + 1) : i + 1])
        for i, s in enumerate(steps)
    }


def alert_steps(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Steps at which the collapse guard recorded an alert."""
    return sorted(s for s, n in values_by_step(rows, ALERTS_KEY).items() if n > 0)


def values_by_step(rows: Sequence[dict[str, Any]], key: str) -> dict[int, float]:
    """Finite values of `key` by step (the last row of a step wins)."""
    out: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[int(row["step"])] = float(value)
    return out


def spike_steps(grad_norms: dict[int, float], c: CollapseCriteria) -> list[int]:
    history: list[float] = []
    spikes = []
    for step in sorted(grad_norms):
        value = grad_norms[step]
        recent = history[-c.window :]
        if len(recent) >= c.min_history and value > c.spike_factor * statistics.median(recent):
            spikes.append(step)
        history.append(value)
    return spikes
