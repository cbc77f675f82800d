"""Collapse guard: warn of a collapse from the step's metrics, before its update is applied.

By default it limits the failure tilt (`tir_rl.mismatch.failure_tilt`: whether the sampler
favoured the update's failed episodes over the trainer, as the update weighs them) on its
5-step trailing mean. On the collapse lab's runs that signal foretold the collapses of an
uncorrected run under lag or a biased sampler, and stayed quiet where a correction held the
run, where k3 alarmed in every lagging run alike (docs/collapse.md A6). Further absolute
limits (`absolute`), relative rules against a metric's rolling median (`watch`: they alerted
in every run that held, A3) and non-finite values are checked too. On an alert it returns
typed `Alert`s, saves the offending batch and metrics for inspection, and tells the loop
what to do (`continue`, `skip_step`, or `stop`, after which the loop checkpoints and exits).

Every step that sampled a token is checked: an update before it is applied
(`Trainer.train_step`), and a step whose groups carry no learning signal after its batch is
scored (`Trainer.score_step`): a sampler so far off that no rollout scores makes no update,
and is exactly what the guard must not miss.

The guard is deterministic given the metric stream, so every rank reaches the same decision
when fed the same (all-reduced) metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from tir_rl.errors import ConfigError
from tir_rl.mismatch.failure_tilt import TILT_KEY

logger = logging.getLogger(__name__)


DEFAULT_TILT_LIMIT = 0.01
"""The failure tilt's 5-step-mean limit, chosen on the collapse lab's kept runs by
`bench/collapse/guard_signal.py` (docs/collapse.md A6)."""


class GuardAction(StrEnum):
    """What the training loop does when the guard fires."""

    CONTINUE = "continue"
    """Log the alert and apply the step anyway."""
    SKIP_STEP = "skip_step"
    """Drop this step's update (gradients zeroed, optimizer untouched) and go on."""
    STOP = "stop"
    """Drop this step's update, save a checkpoint and end the run cleanly."""


@dataclass(frozen=True)
class Alert:
    """One watched metric that spiked."""

    step: int
    metric: str
    value: float
    threshold: float
    """The limit it crossed (relative or absolute, whichever fired first)."""
    reason: str
    """`relative` (value > factor × rolling median), `absolute` (`value` is then the trailing
    mean over `smooth` steps), or `nonfinite`."""
    median: float | None = None
    """Rolling median of the history at the time, when there was enough history."""


@dataclass(frozen=True)
class GuardDecision:
    """The guard's verdict for one step."""

    action: GuardAction
    """CONTINUE when nothing fired."""
    alerts: tuple[Alert, ...] = ()
    saved_to: Path | None = None
    """Folder holding the offending batch and metrics, when saved."""

    @property
    def fired(self) -> bool:
        """Whether any watched metric spiked."""
        return bool(self.alerts)

    @property
    def apply_update(self) -> bool:
        """Whether the optimizer step should be applied."""
        return self.action is GuardAction.CONTINUE


class CollapseGuard:
    """Watches per-step metrics for spikes relative to their recent history."""

    @dataclass(kw_only=True)
    class Config:
        """Collapse guard settings."""

        enabled: bool = True
        """Turn the guard off entirely (no checks, no saves)."""
        watch: tuple[str, ...] = ()
        """Metric names checked against their rolling median, e.g. `train/grad_norm`. None by
        default: over the collapse lab's 32 long runs such relative rules alerted in every
        run that never collapsed (docs/collapse.md A3)."""
        factor: float = 10.0
        """A value above `factor` × rolling median of its history is a spike."""
        window: int = 20
        """Number of past steps in the rolling history."""
        min_history: int = 5
        """Relative checks start once this many past values are known."""
        min_median: float = 1e-8
        """Floor under the median, so a zero history (an exact sampler) does not flag noise."""
        failure_tilt_limit: float | None = DEFAULT_TILT_LIMIT
        """Upper limit on the failure tilt's trailing mean over `smooth` steps
        (`mismatch/failure_tilt`, `tir_rl.mismatch.failure_tilt`): on the collapse lab's new
        runs it foretold every collapse and alarmed none of the runs that held, where k3
        alarmed most (docs/collapse.md A6). None: no limit."""
        absolute: dict[str, float] = field(default_factory=dict)
        """Further upper limits per metric name on its trailing mean over `smooth` steps, e.g.
        `{"mismatch/k3_kl": 0.003}` (one for `mismatch/failure_tilt` replaces
        `failure_tilt_limit`)."""
        smooth: int = 5
        """Steps in the trailing mean the absolute limits are checked on, from the step at
        which that many values are known (1: each step's own value, from the first step).
        The collapse lab judged its detectors on 5-step means (docs/collapse.md A3, A6)."""
        nonfinite: tuple[str, ...] = ("train/grad_norm", "train/loss", "mismatch/k3_kl")
        """Metric names whose non-finite value is an alert (also those watched or limited)."""
        action: GuardAction = GuardAction.CONTINUE
        """What the loop does on a spike: continue, skip_step or stop."""
        save_dir: Path | None = None
        """Folder for offending batches (one subfolder per step). None: in a training run,
        `alerts/` in the run's folder; a guard built without a run folder saves nothing."""
        max_saved: int = 20
        """Stop saving batches after this many (alerts keep being reported)."""

    def __init__(
        self, config: CollapseGuard.Config | None = None, *, run_dir: Path | None = None
    ) -> None:
        self.config = config or CollapseGuard.Config()
        self.save_dir: Path | None = self.config.save_dir
        """Where offending batches go: `save_dir`, else the run folder's `alerts/`, else None."""
        if self.save_dir is None and run_dir is not None:
            self.save_dir = run_dir / "alerts"
        if self.config.smooth < 1:
            raise ConfigError(f"guard.smooth must be at least 1 step, got {self.config.smooth}")
        self._history: dict[str, deque[float]] = {
            name: deque(maxlen=self.config.window) for name in self.config.watch
        }
        tilt = self.config.failure_tilt_limit
        self._limits: dict[str, float] = {
            **({} if tilt is None else {TILT_KEY: tilt}),
            **self.config.absolute,
        }
        """Every absolute limit: the failure tilt's and `absolute`."""
        self._recent: dict[str, deque[float]] = {
            name: deque(maxlen=self.config.smooth) for name in self._limits
        }
        """The last `smooth` finite values of each metric with an absolute limit."""
        self.num_alerts = 0
        self.num_saved = 0

    def check(
        self,
        step: int,
        metrics: Mapping[str, float],
        *,
        batch: Mapping[str, Any] | None = None,
        rank: int = 0,
    ) -> GuardDecision:
        """Check one step's metrics, update the history, save the batch on a spike.

        Args:
            step: the training step (names the saved folder).
            metrics: this step's metrics; watched names that are missing are ignored.
            batch: tensors of the offending batch to save (e.g. `TrainBatch.tensors()`).
            rank: this process's rank; each rank saves its own share of the batch.

        Returns:
            The decision; `action` is CONTINUE unless something fired.
        """
        cfg = self.config
        if not cfg.enabled:
            return GuardDecision(GuardAction.CONTINUE)
        alerts = []
        for name in dict.fromkeys((*cfg.watch, *self._limits, *cfg.nonfinite)):
            if name not in metrics:
                continue
            alert = self._check_one(step, name, float(metrics[name]))
            if alert is not None:
                alerts.append(alert)
            if name in self._history and math.isfinite(float(metrics[name])):
                self._history[name].append(float(metrics[name]))
        if not alerts:
            return GuardDecision(GuardAction.CONTINUE)
        self.num_alerts += 1
        for alert in alerts:
            logger.warning(
                "collapse guard, step %d: %s = %.4g over %s threshold %.4g (action: %s)",
                step, alert.metric, alert.value, alert.reason, alert.threshold, cfg.action,
            )  # fmt: skip
        saved = self._save(step, metrics, alerts, batch, rank)
        return GuardDecision(cfg.action, tuple(alerts), saved)

    def _check_one(self, step: int, name: str, value: float) -> Alert | None:
        cfg = self.config
        if not math.isfinite(value):
            return Alert(step, name, value, math.inf, "nonfinite")
        limit = self._limits.get(name)
        if limit is not None:
            recent = self._recent[name]
            recent.append(value)
            if len(recent) == cfg.smooth and (mean := statistics.fmean(recent)) > limit:
                return Alert(step, name, mean, limit, "absolute")
        history = self._history.get(name)
        if history is not None and len(history) >= cfg.min_history:
            median = statistics.median(history)
            threshold = cfg.factor * max(median, cfg.min_median)
            if value > threshold:
                return Alert(step, name, value, threshold, "relative", median)
        return None

    def _save(
        self,
        step: int,
        metrics: Mapping[str, float],
        alerts: list[Alert],
        batch: Mapping[str, Any] | None,
        rank: int,
    ) -> Path | None:
        cfg = self.config
        if self.save_dir is None or self.num_saved >= cfg.max_saved:
            return None
        # A step checked twice (a caller that names no run step labels by the trainer's
        # update count, which scored steps do not advance) keeps each alert in its own
        # folder. Each rank looks for the file it writes itself, so all ranks pick the same.
        mine = f"batch_rank{rank}.pt" if batch is not None else "alert.json"
        folder = Path(self.save_dir) / f"step_{step:06d}"
        repeat = 1
        while (folder / mine).exists():
            folder = Path(self.save_dir) / f"step_{step:06d}_{repeat}"
            repeat += 1
        folder.mkdir(parents=True, exist_ok=True)
        if batch is not None:
            torch.save(dict(batch), folder / f"batch_rank{rank}.pt")
        if rank == 0:
            record = {
                "step": step,
                "alerts": [dataclasses.asdict(a) for a in alerts],
                "metrics": {k: float(v) for k, v in metrics.items()},
            }
            (folder / "alert.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        self.num_saved += 1
        return folder

    def state_dict(self) -> dict[str, Any]:
        """History and counters, for checkpoints."""
        return {
            "history": {k: list(v) for k, v in self._history.items()},
            "recent": {k: list(v) for k, v in self._recent.items()},
            "num_alerts": self.num_alerts,
            "num_saved": self.num_saved,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        for name, values in state.get("history", {}).items():
            if name in self._history:
                self._history[name].clear()
                self._history[name].extend(values)
        for name, values in state.get("recent", {}).items():
            if name in self._recent:
                self._recent[name].clear()
                self._recent[name].extend(values)
        self.num_alerts = int(state.get("num_alerts", 0))
        self.num_saved = int(state.get("num_saved", 0))
