"""The Weights & Biases sink: the run's config, every metrics row and the plots.

Optional: `wandb` is imported only when a run names `wandb` in `run.loggers`
(`pip install "tir-rl[wandb]"`). Local W&B files go to `run_dir/wandb/` (in offline mode
that folder is the whole W&B run; `wandb sync run_dir/wandb/offline-run-*` uploads it).

- **Steps.** Every row carries the training step as the `step` key, declared as the x axis
  of every chart (`define_metric("*", step_metric="step")`), rather than W&B's own `_step`,
  which must only grow: an evaluation row shares its step with the training row before it,
  and after `--resume` from an earlier checkpoint the steps repeat.
- **Resume.** The W&B run id is kept in `run_dir/wandb_run_id`; `tir-rl train --resume`
  reopens that run (`resume="allow"`), so one training run is one W&B run.
- **Plots.** Each PNG written to `plots/` is logged as an image `plots/<name>` at its step.
"""

from __future__ import annotations

import importlib.util
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from tir_rl.errors import ConfigError
from tir_rl.report.sinks import MetricsRow

RUN_ID_FILE = "wandb_run_id"
STEP_KEY = "step"
INSTALL_HINT = 'pip install "tir-rl[wandb]"'


class WandbMode(StrEnum):
    """W&B's `mode`: where the run's data goes."""

    ONLINE = "online"
    """Stream to the W&B server (needs `wandb login` or `WANDB_API_KEY`)."""
    OFFLINE = "offline"
    """Write only local files under `run_dir/wandb/`; upload later with `wandb sync`."""
    DISABLED = "disabled"
    """Log nothing (every W&B call is a no-op)."""


def require_wandb() -> None:
    """Check that `wandb` is importable, without importing it.

    Raises:
        ConfigError: it is not installed; the message names the install command.
    """
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"run.loggers names 'wandb' but the wandb package is not installed: {INSTALL_HINT} "
            "(or drop 'wandb' from run.loggers)."
        )


def new_run_id() -> str:
    """A fresh W&B run id: 8 random lowercase letters and digits (W&B's own form)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbSink:
    """One W&B run per training run, resumed with it.

    Example:
        >>> sink = WandbSink(WandbSink.Config(mode=WandbMode.OFFLINE), run_dir=Path("runs/a"))
        >>> sink.log(MetricsRow(step=1, time=0.0, values={"train/loss": 0.5}))
        >>> sink.close()
    """

    @dataclass(kw_only=True)
    class Config:
        """W&B settings, used when `run.loggers` names `wandb`."""

        project: str = "tir-rl"
        """W&B project the run goes to."""
        entity: str | None = None
        """W&B team or user; null: the account's default entity."""
        name: str | None = None
        """Display name of the W&B run; null: the run's name (`run.name`)."""
        mode: WandbMode | None = None
        """`online`, `offline` (local files only, `wandb sync` later) or `disabled`; null:
        W&B's own choice (the `WANDB_MODE` variable, else online)."""
        tags: list[str] = field(default_factory=list)
        """Tags of the W&B run."""

    def __init__(self, config: WandbSink.Config, *, run_dir: Path, resume: bool = False) -> None:
        """Start (or, with `resume`, continue) the W&B run of `run_dir`.

        Raises:
            ConfigError: `wandb` is not installed, or W&B refused to start the run (not
                logged in, an unknown entity).
        """
        try:
            import wandb
        except ImportError:
            require_wandb()
            raise
        self._wandb = wandb
        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = new_run_id()
            id_file.write_text(run_id + "\n")
        self.run_id = run_id
        try:
            self._run = wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.name or run_dir.name,
                mode=None if config.mode is None else str(config.mode),
                tags=list(config.tags),
                dir=str(run_dir),
                id=run_id,
                resume="allow",
            )
        except wandb.errors.Error as exc:
            raise ConfigError(
                f"W&B could not start the run ({type(exc).__name__}: {exc}). Log in with "
                "`wandb login` (or set WANDB_API_KEY), check wandb.project/wandb.entity, or "
                "set wandb.mode=offline and upload later with `wandb sync`."
            ) from exc
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def log(self, row: MetricsRow) -> None:
        """One W&B history row: the values and `step`."""
        self._run.log({STEP_KEY: row.step, **row.values})

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's config as the W&B config (a resumed run may change values)."""
        self._run.config.update(dict(config), allow_val_change=True)

    def log_plots(self, step: int, paths: Sequence[Path]) -> None:
        """Each PNG as an image `plots/<file stem>` at `step`."""
        images = {f"plots/{Path(p).stem}": self._wandb.Image(str(p)) for p in paths}
        self._run.log({STEP_KEY: step, **images})

    def flush(self) -> None:
        """Nothing: W&B's service process writes in the background."""

    def close(self) -> None:
        """Finish the W&B run (idempotent)."""
        if self._run is not None:
            self._run.finish()
            self._run = None
