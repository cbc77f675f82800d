"""`run_eval`: held-out evaluation of a checkpoint (pass@1, pass@k with confidence intervals)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tir_rl.errors import ConfigError
from tir_rl.models import NAMED_MODELS
from tir_rl.report.eval_stats import EvalReport, EvalSampling, build_report, format_table
from tir_rl.run_config import RunConfig


def resolve_checkpoint(checkpoint: str) -> str:
    """Map a `--checkpoint` value to a model the engine can load.

    Accepts a named model (`bundled`, `tiny`, `lab`, `lab-sft`), a Hugging Face checkpoint folder, a
    tir-rl checkpoint folder (`runs/NAME/checkpoints/step_N`, whose weights live in its
    `model/` subfolder) or a run folder (its newest checkpoint).
    """
    if checkpoint in NAMED_MODELS:
        return checkpoint
    path = Path(checkpoint).expanduser()
    if (path / "model" / "config.json").is_file():
        return str(path / "model")
    if (path / "config.json").is_file():
        return str(path)
    if (path / "checkpoints").is_dir():
        from tir_rl.trainer.checkpoint import latest_checkpoint

        latest = latest_checkpoint(path)
        if latest is not None:
            return str(latest / "model")
    raise ConfigError(
        f"--checkpoint {checkpoint!r} is not a named model ('bundled', 'tiny', 'lab'), a run "
        "folder, a checkpoint folder (runs/NAME/checkpoints/step_N) or a Hugging Face model "
        "folder. Leave --checkpoint out to evaluate the config's `model`."
    )


def stated_sampling(config: RunConfig) -> EvalSampling:
    """The sampling settings an evaluation of `config` runs with, for its report."""
    rollout = config.rollout
    return EvalSampling(rollout.temperature, rollout.top_p, rollout.top_k, rollout.min_p)


@dataclass
class EvalOutcome:
    """A finished evaluation: the report and where it was written."""

    report: EvalReport
    report_path: Path | None


def run_eval(
    config: RunConfig,
    *,
    num_tasks: int,
    k: int,
    samples_per_task: int | None = None,
    report_path: Path | None = None,
) -> EvalOutcome:
    """Play `num_tasks` held-out tasks with `samples_per_task` samples each and summarise.

    Args:
        config: the run config (model, env, engine, rollout, sandbox sections are used).
        num_tasks: number of tasks of `config.env.eval_split` (task indices 0..num_tasks-1).
        k: the k of pass@k; needs `samples_per_task >= k`.
        samples_per_task: samples per task (default: k).
        report_path: where to write the JSON report (None: not written).
    """
    from tir_rl.runtime import check_env_starts, env_factory, open_runtime, task_specs

    samples = samples_per_task or k
    if samples < k:
        raise ConfigError(f"--samples {samples} must be >= --k {k}")
    check_env_starts(config.env, config.env.eval_split)
    factory = env_factory(config.env, config.env.eval_split)
    started = time.perf_counter()
    with open_runtime(config) as runtime:
        specs = task_specs(factory, num_tasks=num_tasks, group_size=samples)
        trajectories = runtime.run_episodes(specs)
    report = build_report(
        trajectories,
        env_id=config.env.id,
        split=config.env.eval_split,
        k=k,
        wall_time_s=time.perf_counter() - started,
        sampling=stated_sampling(config),
    )
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(report.to_json() + "\n")
    return EvalOutcome(report, report_path)


__all__ = ["EvalOutcome", "format_table", "resolve_checkpoint", "run_eval", "stated_sampling"]
