"""`run_train(config)`: the RL loop, top to bottom.

::

    ┌──────────────► rollouts: B tasks × G samples, many episodes in flight (Rollout + vLLM)
    │                   │ trajectories (token ids, loss mask, sampler logprobs, turn ids)
    │                   ▼
    │                 rewards ─► group advantages (GRPO)
    │                   ▼
    │                 Trainer.train_step: recompute ℓ^old ─► mismatch metrics ─► correction
    │                   │                  ─► PPO-clip loss ─► clip ─► AdamW (or skip)
    │                   ▼
    └── weight sync: trainer state dict ─► engine.update_weights ─► parity probe

Every step writes `metrics.jsonl` (+ TensorBoard), sample trajectories and plots to the run
folder; held-out accuracy is measured before training, every `run.eval_every` steps and at
the end. Ctrl-C saves a checkpoint and stops cleanly; `resume` continues from the newest one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tir_rl import checkpoint
from tir_rl.config import dump, load
from tir_rl.errors import ConfigError, ParityError, TirError
from tir_rl.run_config import RunConfig
from tir_rl.types import Trajectory

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_SEED_STRIDE = 1_000_003
_MAX_FAILED_STEPS = 3


@dataclass
class TrainSummary:
    """What a finished (or interrupted) run reports."""

    run_dir: Path
    steps_done: int
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    interrupted: bool = False
    stopped_by_guard: bool = False
    wall_time_s: float = 0.0
    checkpoints: list[Path] = field(default_factory=list)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest `checkpoints/step_N` folder of a run, if any."""
    folder = Path(run_dir) / CHECKPOINTS
    found = [p for p in folder.glob("step_*") if (p / "trainer_state.json").is_file()]
    return max(found, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_resume_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The saved config of `run_dir` with `overrides` applied."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: is it a tir-rl run folder?")
    return load(RunConfig, path, overrides)


def run_train(config: RunConfig, *, resume: bool = False) -> TrainSummary:
    """Train `config.model` with GRPO on `config.env`; see the module docstring."""
    from tir_rl.runtime import open_runtime

    run_dir = config.run_dir
    if run_dir.exists() and not resume and latest_checkpoint(run_dir) is not None:
        raise ConfigError(
            f"{run_dir} already holds checkpoints. Continue it with `tir-rl train --resume "
            f"{run_dir}`, or pick another name with --set run.name=NEW."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump(config, run_dir / "config.yaml")
    started = time.perf_counter()
    with open_runtime(config) as runtime:
        loop = _TrainLoop(config, runtime, resume=resume)
        summary = loop.run()
    summary.wall_time_s = time.perf_counter() - started
    return summary


class _TrainLoop:
    """The state of one training run; `run` is the loop."""

    def __init__(self, config: RunConfig, runtime: Any, *, resume: bool) -> None:
        from tir_rl.collapse_guard import CollapseGuard
        from tir_rl.engine.parity import probe_ids_from_text
        from tir_rl.grpo import GRPOLoss
        from tir_rl.metrics import MetricsLogger
        from tir_rl.runtime import env_factory
        from tir_rl.trainer import Trainer

        self.config = config
        self.runtime = runtime
        self.run_dir = config.run_dir
        self.trainer = Trainer(
            config.trainer,
            loss_fn=GRPOLoss(config.loss),
            correction_config=config.correction,
        )
        guard_config = config.guard
        if guard_config.save_dir is None:
            guard_config.save_dir = self.run_dir / "alerts"
        self.guard = CollapseGuard(guard_config)
        self.train_env = env_factory(config.env, config.env.train_split)
        self.eval_env = env_factory(config.env, config.env.eval_split)
        self.probe_ids = probe_ids_from_text(runtime.tokenizer)
        self.start_step = 0
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise ConfigError(f"{self.run_dir} has no checkpoint to resume from.")
            state = checkpoint.load(ckpt, self.trainer, guard=self.guard)
            self.start_step = int(state.step)
            logger.info("resumed from %s (step %d)", ckpt, self.start_step)
            self._sync_weights()
        self.metrics = MetricsLogger(
            MetricsLogger.Config(
                run_dir=self.run_dir, resume_after_step=self.start_step if resume else None
            )
        )
        self.summary = TrainSummary(self.run_dir, self.start_step)
        self._all_failed_steps = 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> TrainSummary:
        from tqdm import tqdm

        cfg = self.config.run
        try:
            self.summary.accuracy_before = self._evaluate(self.start_step, "before")
            bar = tqdm(range(self.start_step, cfg.steps), desc="train", unit="step")
            for step in bar:
                row, stop = self._step(step)
                self.summary.steps_done = step + 1
                bar.set_postfix(
                    reward=f"{row['rollout/reward_mean']:.3f}",
                    kl=f"{row.get('mismatch/kl', float('nan')):.1e}",
                    tok_s=f"{row['perf/rollout_tokens_per_s']:.0f}",
                )
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                    self._evaluate(done, "periodic")
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                    self._checkpoint(done)
                if stop:
                    logger.warning("collapse guard asked to stop at step %d", step)
                    self.summary.stopped_by_guard = True
                    break
            self.summary.accuracy_after = self._evaluate(self.summary.steps_done, "after")
        except KeyboardInterrupt:
            logger.warning("interrupted: saving a checkpoint at step %d", self.summary.steps_done)
            self.summary.interrupted = True
        except ParityError:
            self._checkpoint(self.summary.steps_done)
            raise
        finally:
            self._checkpoint(self.summary.steps_done)
            self.metrics.close()
            self._plots()
        return self.summary

    def _step(self, step: int) -> tuple[dict[str, float], bool]:
        from tir_rl.batch import TrainBatch
        from tir_rl.grpo import group_advantages
        from tir_rl.metrics import save_trajectories
        from tir_rl.mismatch import mismatch_metrics
        from tir_rl.runtime import task_specs

        cfg = self.config.run
        t0 = time.perf_counter()
        base = cfg.seed * _SEED_STRIDE + step * cfg.tasks_per_step
        specs = task_specs(
            self.train_env,
            num_tasks=cfg.tasks_per_step,
            group_size=cfg.group_size,
            first_group_id=step * cfg.tasks_per_step,
            seed_of=lambda i: base + i,
        )
        trajectories = self.runtime.run_episodes(specs)
        t_rollout = time.perf_counter() - t0

        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        groups = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
        adv = group_advantages(rewards, groups, normalize_std=True)
        # Episodes that sampled nothing (e.g. the env failed to reset) carry no gradient;
        # they still count in their group's baseline above, as the failures they are.
        sampled = [i for i, t in enumerate(trajectories) if t.num_model_tokens > 0]
        trainable = sampled
        if cfg.drop_degenerate_groups and self.config.loss.kl_coef == 0:
            trainable = [i for i in sampled if not bool(adv.degenerate[i])]
        row = _rollout_metrics(trajectories, prefix="rollout")
        row["train/dropped_episodes"] = float(len(trajectories) - len(trainable))
        t1 = time.perf_counter()
        result, old_logprobs, parity = None, None, None
        # With no learning signal anywhere, still score what was sampled: the mismatch
        # metrics are watched every step.
        in_batch = trainable or sampled
        if in_batch:
            self._all_failed_steps = 0
            batch = TrainBatch.from_trajectories([trajectories[i] for i in in_batch])
            old_logprobs = self.trainer.compute_logprobs(batch)
            if trainable:
                result = self.trainer.train_step(
                    batch, adv.advantages[trainable], old_logprobs=old_logprobs, guard=self.guard
                )
            else:
                row.update(
                    mismatch_metrics(
                        old_logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
                    )
                )
        else:
            self._all_failed_steps += 1
            errors = [t.error for t in trajectories if t.error]
            logger.warning(
                "step %d: no episode sampled any token; skipping the update. First error: %s",
                step, errors[0] if errors else "none recorded",
            )  # fmt: skip
            if self._all_failed_steps >= _MAX_FAILED_STEPS:
                raise TirError(
                    f"{_MAX_FAILED_STEPS} steps in a row produced no trainable episode. First "
                    f"error: {errors[0] if errors else 'none recorded'}. Run `tir-rl rollout "
                    "--config ...` or `tir-rl doctor --config ...` to inspect the episodes."
                )
        t_train = time.perf_counter() - t1

        t2 = time.perf_counter()
        if result is not None and not result.skipped:
            parity = self._sync_weights()
        t_sync = time.perf_counter() - t2

        if result is not None:
            row.update(result.metrics)
        row.update(
            {
                "train/loss": result.loss if result else float("nan"),
                "train/grad_norm": result.grad_norm if result else float("nan"),
                "train/skipped": float(result is None or result.skipped),
                "train/degenerate_groups": float(adv.num_degenerate_groups),
                "perf/rollout_s": t_rollout,
                "perf/train_s": t_train,
                "perf/sync_s": t_sync,
                "perf/rollout_tokens_per_s": row["rollout/model_tokens"] / max(t_rollout, 1e-9),
            }
        )
        if parity is not None:
            row["sync/parity_max_abs_diff"] = parity.max_abs_diff
            row["sync/parity_mean_abs_diff"] = parity.mean_abs_diff
        self.metrics.log(step + 1, row)
        if cfg.save_trajectories and old_logprobs is not None:
            keep = in_batch[: cfg.save_trajectories]
            save_trajectories(
                self.run_dir / "trajectories.jsonl",
                [trajectories[i] for i in keep],
                step + 1,
                trainer_logprobs=[
                    old_logprobs[row_i, : len(trajectories[i].completion_ids)].tolist()
                    for row_i, i in enumerate(keep)
                ],
            )
        if cfg.plot_every and (step + 1) % cfg.plot_every == 0:
            self._plots()
        return row, result is not None and result.stop

    # ------------------------------------------------------------------ pieces

    def _evaluate(self, step: int, when: str) -> float:
        from tir_rl.eval_stats import build_report
        from tir_rl.runtime import task_specs

        cfg = self.config.run
        t0 = time.perf_counter()
        specs = task_specs(
            self.eval_env, num_tasks=cfg.eval_tasks, group_size=cfg.eval_samples_per_task
        )
        trajectories = self.runtime.run_episodes(specs)
        report = build_report(
            trajectories,
            env_id=self.config.env.id,
            split=self.config.env.eval_split,
            k=cfg.eval_samples_per_task,
            wall_time_s=time.perf_counter() - t0,
        )
        accuracy = report.pass_at_1.value
        row = {"eval/pass_at_1": accuracy, "eval/mean_reward": report.mean_reward}
        row.update(_rollout_metrics(trajectories, prefix="eval"))
        self.metrics.log(step, row)
        (self.run_dir / f"eval_step_{step}.json").write_text(report.to_json() + "\n")
        print(f"held-out pass@1 {when} training (step {step}): {accuracy:.3f} "
              f"({report.num_tasks} tasks × {report.samples_per_task})", flush=True)  # fmt: skip
        return accuracy

    def _sync_weights(self) -> Any:
        from tir_rl.engine.parity import probe_parity, transformers_logprobs

        state = self.trainer.rank0_full_state_dict()
        engine = self.runtime.engine
        model = self.trainer.model

        async def sync() -> Any:
            await engine.update_weights(state)
            return await probe_parity(
                engine,
                lambda ids: transformers_logprobs(model, ids).tolist(),
                self.probe_ids,
                tolerance=self.config.run.parity_tolerance,
            )

        return asyncio.run(sync())

    def _checkpoint(self, step: int) -> None:
        path = self.run_dir / CHECKPOINTS / f"step_{step}"
        if path in self.summary.checkpoints:
            return
        checkpoint.save(
            path, self.trainer, data_position=step, config=self.config, guard=self.guard
        )
        self.summary.checkpoints.append(path)

    def _plots(self) -> None:
        from tir_rl.plots import write_plots

        try:
            write_plots(self.run_dir)
        except Exception as exc:  # noqa: BLE001 (plots must never end a run)
            logger.warning("could not write plots: %s", exc)


def _rollout_metrics(trajectories: list[Trajectory], *, prefix: str) -> dict[str, float]:
    n = max(len(trajectories), 1)
    rewards = [t.reward for t in trajectories]
    statuses = Counter(str(t.status) for t in trajectories)
    row = {
        f"{prefix}/reward_mean": sum(rewards) / n,
        f"{prefix}/reward_max": max(rewards, default=0.0),
        f"{prefix}/model_tokens": float(sum(t.num_model_tokens for t in trajectories)),
        f"{prefix}/completion_tokens_mean": sum(len(t.completion_ids) for t in trajectories) / n,
        f"{prefix}/tool_calls_mean": sum(t.num_tool_calls for t in trajectories) / n,
        f"{prefix}/tool_errors_mean": sum(t.num_tool_errors for t in trajectories) / n,
    }
    for status, count in statuses.items():
        row[f"{prefix}/status/{status}"] = count / n
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in row.items()}
