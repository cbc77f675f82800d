"""`run_train(config)`: the RL loop, top to bottom.

::

    ┌──────────────► rollouts: B tasks × G samples, many episodes in flight (Rollout + vLLM)
    │                   │ trajectories (token ids, loss mask, sampler logprobs, turn ids)
    │                   ▼
    │                 rewards ─► group advantages (GRPO)
    │                   ▼
    │                 Trainer.train_step: ℓ^old (update forward) ─► mismatch metrics ─► correction
    │                   │                  (ℓ^ref from the frozen reference when loss.kl_coef > 0)
    │                   │                  ─► PPO-clip loss (+ β·KL) ─► clip ─► AdamW (or skip)
    │                   ▼
    └── weight sync (WeightSync): trainer state dict ─► engine.update_weights ─► parity probe

Every step sends its metrics row to the sinks `run.loggers` names (`metrics.jsonl`, always;
TensorBoard, W&B) and writes sample trajectories and plots to the run folder; held-out
accuracy is measured before training, every `run.eval_every` steps and at the end. Ctrl-C
saves a checkpoint and stops cleanly; `resume` continues from the newest one.

Under `torchrun` (world size W > 1) rank 0 owns the runtime (engine, envs, sandbox), eval,
metrics, plots, trajectories and the progress bar; every rank holds an FSDP2 shard of the
trainer. Each step rank 0 scatters the batch (about B/W sequences and their advantages per
rank, `distributed.scatter_object`); the loss normalizer is a global token count, so the step
equals the world-size-1 step. Rank-0-only work (rollouts, eval, engine sync) runs inside
`distributed.rank0_share`, which also hands its failure to the other ranks (Ctrl-C,
ParityError, any error), so every rank reaches the same collective checkpoint; outside it
rank 0 defers Ctrl-C and the other ranks ignore it (`distributed.interrupt_handling`). The
step's metrics row is built by `tir_rl.report.step_metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from tir_rl import distributed as tdist
from tir_rl.config import dump, load, to_dict
from tir_rl.errors import ConfigError, ParityError, TirError
from tir_rl.mismatch.injection import MismatchInjection
from tir_rl.report.eval_stats import bootstrap_paired_change
from tir_rl.report.step_metrics import StepOutcome, episode_row, step_row
from tir_rl.run_config import RunConfig
from tir_rl.trainer import checkpoint
from tir_rl.trainer.checkpoint import latest_checkpoint, step_folder
from tir_rl.types import Trajectory
from tir_rl.weight_sync import WeightSync

if TYPE_CHECKING:
    from tir_rl.engine.parity import ParityReport
    from tir_rl.report.eval_stats import Estimate, EvalReport
    from tir_rl.runtime import Runtime
    from tir_rl.trainer import StepResult
    from tir_rl.trainer.batch import TrainBatch

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003
_MAX_FAILED_STEPS = 3
_COLLECTIVE_TIMEOUT_S = 6 * 3600.0
"""Multi-rank runs: how long ranks > 0 wait on rank 0 (rollouts and eval take minutes)."""


@dataclass
class TrainSummary:
    """What a finished (or interrupted) run reports."""

    run_dir: Path
    steps_done: int
    accuracy_before: Estimate | None = None
    """Held-out pass@1 before the first step, with its 95% bootstrap interval over tasks."""
    accuracy_after: Estimate | None = None
    """The same after the last step."""
    accuracy_change: Estimate | None = None
    """After minus before, task by task over the same held-out tasks, with its 95% bootstrap
    interval (`bootstrap_paired_change`): the run improved the policy when it lies above 0."""
    interrupted: bool = False
    stopped_by_guard: bool = False
    wall_time_s: float = 0.0
    checkpoints: list[Path] = field(default_factory=list)
    rank: int = 0
    """This process's rank; only rank 0 measures the accuracies."""
    world_size: int = 1

    @property
    def exit_status(self) -> int:
        """130 for an interrupted one-process run, else 0.

        The ranks of an interrupted multi-rank run exit 0 (their checkpoint is written): for
        torchrun a non-zero status is a failed rank, whose peers it ends at once.
        """
        return 130 if self.interrupted and self.world_size == 1 else 0


def load_resume_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The saved config of `run_dir` with `overrides` applied."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: is it a tir-rl run folder?")
    return load(RunConfig, path, overrides)


def run_train(config: RunConfig, *, resume: bool = False) -> TrainSummary:
    """Train `config.model` with GRPO on `config.env`; see the module docstring.

    Under torchrun (`WORLD_SIZE` > 1) every rank calls this; it creates the process group
    (and destroys it at the end) unless one exists already.
    """
    owns_group = not tdist.is_initialized() and tdist.init_process_group(
        device=_collective_device(config), timeout_s=_COLLECTIVE_TIMEOUT_S
    )
    try:
        return _run_train(config, resume=resume)
    finally:
        if owns_group:
            tdist.destroy_process_group()


def _run_train(config: RunConfig, *, resume: bool) -> TrainSummary:
    from tir_rl.runtime import open_runtime

    run_dir = config.run_dir
    if run_dir.exists() and not resume and latest_checkpoint(run_dir) is not None:
        raise ConfigError(
            f"{run_dir} already holds checkpoints. Continue it with `tir-rl train --resume "
            f"{run_dir}`, or pick another name with --set run.name=NEW."
        )
    rank0 = tdist.is_rank0()
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump(config, run_dir / "config.yaml")
    if tdist.world_size() > 1 and rank0 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # In process, vLLM would take the trainer's process group for its own.
        logger.warning("VLLM_ENABLE_V1_MULTIPROCESSING=0 ignored: multi-rank runs need 1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    started = time.perf_counter()
    loop: _TrainLoop | None = None
    try:
        with open_runtime(config) if rank0 else contextlib.nullcontext() as runtime:
            loop = _TrainLoop(config, runtime, resume=resume)
            summary = loop.run()
    finally:
        if loop is not None and loop.ended_together:
            _leave_together()
    summary.wall_time_s = time.perf_counter() - started
    return summary


def _leave_together() -> None:
    """Wait until rank 0 has closed its engine before any rank exits.

    torchrun ends the other ranks as soon as one exits with an error (a ParityError, an
    interrupt), which would cut rank 0's engine shutdown short. Called only when every rank
    ended the run the same way, so none waits for a rank that is not coming.
    """
    with contextlib.suppress(Exception):  # a broken group must not hide the run's own error
        tdist.barrier()


def exec_under_torchrun(
    nproc_per_node: int,
    config: str | None,
    overrides: list[str],
    *,
    resume: str | None = None,
    verbose: bool = False,
) -> NoReturn:
    """Replace this process by `torchrun --standalone --nproc-per-node N -m tir_rl.cli train`.

    The ranks get the same `--config`, `--set` and `--resume` arguments. Unless
    `OMP_NUM_THREADS` is set, each rank gets `cores // N` torch threads.

    Raises:
        ConfigError: already running under torchrun.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        raise ConfigError("--nproc-per-node starts torchrun itself; under torchrun, drop it.")
    args = [*(["-v"] if verbose else []), "train"]
    args += ["--config", config] if config else []
    args += ["--resume", resume] if resume else []
    for override in overrides:
        args += ["--set", override]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // nproc_per_node)))
    command = tdist.torchrun_command(nproc_per_node, "tir_rl.cli", args)
    logger.info("running %s", " ".join(command))
    os.execv(command[0], command)


def _collective_device(config: RunConfig) -> torch.device:
    if config.trainer.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@dataclass
class _StepWork:
    """What one rank gets from rank 0 for a step: its share of the batch, or none."""

    batch: TrainBatch | None
    """This rank's sequences; None when no episode of the step sampled a token."""
    advantages: torch.Tensor | None
    """[b] advantages of `batch`; None when the step only scores the batch (no signal)."""
    first_error: str = ""
    """The first episode error of a step without any sampled token."""


@dataclass
class _StepPlan:
    """Rank 0's view of a step after its rollouts."""

    trajectories: list[Trajectory]
    in_batch: list[int]
    """Indices of the trajectories in the batch (scored, and trained on when they carry signal)."""
    batch: TrainBatch | None
    row: dict[str, float]
    num_degenerate_groups: int


class _TrainLoop:
    """The state of one training run; `run` is the loop."""

    def __init__(self, config: RunConfig, runtime: Runtime | None, *, resume: bool) -> None:
        """Build the trainer, guard and metrics sinks; `runtime` is None off rank 0."""
        from tir_rl.engine.parity import probe_ids_from_text
        from tir_rl.mismatch.guard import CollapseGuard
        from tir_rl.report.metrics_logger import MetricsLogger
        from tir_rl.runtime import env_factory
        from tir_rl.trainer import Trainer
        from tir_rl.trainer.loss import GRPOLoss

        self.config = config
        self.runtime = runtime
        self.run_dir = config.run_dir
        self.world = tdist.world_size()
        self.rank0 = tdist.is_rank0()
        self._gate: tdist.Rank0InterruptGate | None = None
        self.trainer = Trainer(
            config.trainer,
            loss_fn=GRPOLoss(config.loss),
            correction_config=config.correction,
        )
        guard_config = config.guard
        if guard_config.save_dir is None:
            guard_config.save_dir = self.run_dir / "alerts"
        self.guard = CollapseGuard(guard_config)
        self.injection = MismatchInjection(config.inject)
        self.num_updates = 0
        if self.rank0 and config.inject.active:
            logger.warning("%s", self.injection.describe())
        if self.rank0:
            self.train_env = env_factory(config.env, config.env.train_split)
            self.eval_env = env_factory(config.env, config.env.eval_split)
        probe_ids = probe_ids_from_text(runtime.tokenizer) if self.rank0 else None
        self.weight_sync = WeightSync(
            self.injection,
            probe_ids=tdist.broadcast_object(probe_ids),  # type: ignore[arg-type]
            parity_tolerance=config.run.parity_tolerance,
            keep_stale_copy=config.run.eval_clean_sampler,
        )
        self.start_step = 0
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise ConfigError(f"{self.run_dir} has no checkpoint to resume from.")
            state = checkpoint.load(ckpt, self.trainer, guard=self.guard)
            # The loop's position, not the trainer's count of updates (a step without a
            # trainable episode makes none).
            position = state.data_position
            self.start_step = int(position if position is not None else state.step)
            logger.info("resumed from %s (step %d)", ckpt, self.start_step)
            self._sync_weights(force=True)
        elif self.injection.transforms_weights:
            self._sync_weights(force=True)  # the engine loaded the untouched checkpoint
        self.metrics: MetricsLogger | None = None
        if self.rank0:
            self.metrics = MetricsLogger.open(
                MetricsLogger.Config(
                    run_dir=self.run_dir,
                    loggers=config.run.loggers,
                    wandb=config.wandb,
                    resume_after_step=self.start_step if resume else None,
                )
            )
            self.metrics.log_config(to_dict(config))
        self.summary = TrainSummary(
            self.run_dir, self.start_step, rank=tdist.rank(), world_size=self.world
        )
        self._all_failed_steps = 0
        self.ended_together = False
        """Whether every rank ended `run` the same way (finished, or an error shared by
        `_share`), so that all of them reach the exit barrier."""

    # ------------------------------------------------------------------ the loop

    def run(self) -> TrainSummary:
        with tdist.interrupt_handling() as self._gate:
            return self._run()

    def _run(self) -> TrainSummary:
        from tqdm import tqdm

        cfg = self.config.run
        try:
            before = self._evaluate_shared(self.start_step, "before")
            self.summary.accuracy_before = before.pass_at_1 if before is not None else None
            steps = range(self.start_step, cfg.steps)
            bar = tqdm(steps, desc="train", unit="step") if self.rank0 else None
            for step in bar if bar is not None else steps:
                row, stop = self._step(step)
                self.summary.steps_done = step + 1
                if bar is not None:
                    bar.set_postfix(
                        reward=f"{row['rollout/reward_mean']:.3f}",
                        kl=f"{row.get('mismatch/kl', float('nan')):.1e}",
                        tok_s=f"{row['perf/rollout_tokens_per_s']:.0f}",
                    )
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                    self._evaluate_shared(done, "periodic")
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                    self._checkpoint(done)
                if stop:
                    logger.warning("collapse guard asked to stop at step %d", step)
                    self.summary.stopped_by_guard = True
                    break
            after = self._evaluate_shared(self.summary.steps_done, "after")
            self.summary.accuracy_after = after.pass_at_1 if after is not None else None
            if before is not None and after is not None:
                self.summary.accuracy_change = bootstrap_paired_change(
                    before.task_pass_at_1, after.task_pass_at_1
                )
            self.ended_together = True
        except KeyboardInterrupt:
            logger.warning("interrupted: saving a checkpoint at step %d", self.summary.steps_done)
            self.summary.interrupted = True
            self.ended_together = True
        except ParityError:
            self.ended_together = True
            self._checkpoint(self.summary.steps_done)
            raise
        finally:
            self._checkpoint(self.summary.steps_done)
            if self.metrics is not None:
                self._plots(self.summary.steps_done)
                self.metrics.close()
        return self.summary

    def _share(self, fn: Callable[[], tuple[Any, list[Any]]]) -> tuple[Any, Any]:
        """`tdist.rank0_share`; a failure it shares ends every rank the same way."""
        return tdist.rank0_share(fn, gate=self._gate, on_shared_failure=self._ended_together)

    def _ended_together(self) -> None:
        self.ended_together = True

    def _evaluate_shared(self, step: int, when: str) -> EvalReport | None:
        """Held-out evaluation on rank 0 (None on the other ranks)."""
        clean = self.config.run.eval_clean_sampler
        separate_clean = clean and self.injection.changes_sampling

        def evaluate() -> tuple[EvalReport, list[None]]:
            report, trajectories = self._evaluate()
            self._log_evaluation(step, when, "eval", report, trajectories)
            if clean and not separate_clean:  # the run's sampler is the clean one
                self._log_evaluation(step, when, "eval_clean", report, trajectories)
            return report, [None] * self.world

        report, _ = self._share(evaluate)
        if separate_clean:
            self._evaluate_clean_shared(step, when)
        return report

    def _evaluate_clean_shared(self, step: int, when: str) -> None:
        """Held-out evaluation of the trainer's exact weights (`run.eval_clean_sampler`).

        The engine gets the trainer's state for the evaluation, then the sampler's weights
        back (`WeightSync.rank0_exact_weights`).
        """
        full = self.trainer.rank0_full_state_dict()

        def clean() -> tuple[None, list[None]]:
            engine = self.runtime.engine
            with self.weight_sync.rank0_exact_weights(engine, full, self.num_updates):
                self._log_evaluation(step, when, "eval_clean", *self._evaluate())
            return None, [None] * self.world

        self._share(clean)

    def _step(self, step: int) -> tuple[dict[str, float], bool]:
        """One RL step: rollout → advantages → recompute → mismatch → update → sync → log."""
        plan, work = self._share(lambda: self._rollouts(step))  # rank 0 plays, every rank gets work
        train_started = time.perf_counter()
        result, local_logprobs = self._update(step, work)
        # Identical on every rank (global metrics); rank 0's verdict is taken all the same.
        updated, stop = tdist.broadcast_object(
            (result is not None and not result.skipped, result is not None and result.stop)
        )  # type: ignore[misc]
        # The trainer has taken this step: a failure from here on (Ctrl-C, a ParityError in
        # the sync) checkpoints it as done, and `--resume` goes on with the next one.
        self.summary.steps_done = step + 1
        batch = plan.batch if plan is not None else None
        trainer_logprobs = tdist.rank0_gather_rows(
            local_logprobs,
            num_rows=batch.num_sequences if batch is not None else 0,
            shape=batch.completion_ids.shape if batch is not None else (),
        )
        train_s = time.perf_counter() - train_started

        sync_started = time.perf_counter()
        parity = None
        if updated:
            self.num_updates += 1
            parity = self._sync_weights()
        sync_s = time.perf_counter() - sync_started
        if not self.rank0:
            return {}, stop

        outcome = StepOutcome(
            rollout_row=plan.row,
            batch=batch,
            result=result,
            trainer_logprobs=trainer_logprobs,
            updated=updated,
            num_degenerate_groups=plan.num_degenerate_groups,
            train_s=train_s,
            sync_s=sync_s,
            parity=parity,
        )
        row = step_row(outcome)
        self._log(step + 1, row, plan, trainer_logprobs)
        return row, stop

    def _update(self, step: int, work: _StepWork) -> tuple[StepResult | None, torch.Tensor | None]:
        """This rank's share: recompute ℓ^old, measure and correct the mismatch, update.

        Returns the trainer's result (a scoring pass, `Trainer.score_step`, when the batch
        carries no learning signal) and this rank's [b, T] trainer logprobs; both None when
        no episode sampled a token.
        """
        if work.batch is None:
            self._all_failed_steps += 1
            if self.rank0:
                logger.warning(
                    "step %d: no episode sampled any token; skipping the update. First error: %s",
                    step, work.first_error or "none recorded",
                )  # fmt: skip
            if self._all_failed_steps >= _MAX_FAILED_STEPS:
                raise TirError(
                    f"{_MAX_FAILED_STEPS} steps in a row produced no trainable episode. First "
                    f"error: {work.first_error or 'none recorded'}. Run `tir-rl rollout "
                    "--config ...` or `tir-rl doctor --config ...` to inspect the episodes."
                )
            return None, None
        self._all_failed_steps = 0
        if work.advantages is None:  # no signal: score the batch; the guard still watches it
            scored = self.trainer.score_step(work.batch, guard=self.guard)
            return scored, scored.logprobs
        # One forward per micro-batch; its detached logprobs are ℓ^old.
        result = self.trainer.train_step(work.batch, work.advantages, guard=self.guard)
        return result, result.logprobs

    def _log(
        self, steps_done: int, row: dict[str, float], plan: _StepPlan, logprobs: torch.Tensor | None
    ) -> None:
        """Rank 0: the metrics row, a few trajectories with their trainer logprobs, plots."""
        from tir_rl.report.run_log import save_trajectories

        cfg = self.config.run
        self.metrics.log(steps_done, row)
        if cfg.save_trajectories and logprobs is not None:
            keep = plan.in_batch[: cfg.save_trajectories]
            save_trajectories(
                self.run_dir / "trajectories.jsonl",
                [plan.trajectories[i] for i in keep],
                steps_done,
                trainer_logprobs=[
                    logprobs[row_i, : len(plan.trajectories[i].completion_ids)].tolist()
                    for row_i, i in enumerate(keep)
                ],
            )
        if cfg.plot_every and steps_done % cfg.plot_every == 0:
            self._plots(steps_done)

    def _rollouts(self, step: int) -> tuple[_StepPlan, list[_StepWork]]:
        """Rank 0: play the step's episodes, compute advantages, share the batch out."""
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
        row = episode_row(trajectories, prefix="rollout")
        row["perf/rollout_s"] = t_rollout
        plan, works = plan_step(
            trajectories,
            world_size=self.world,
            # With a KL penalty a degenerate group (advantage 0) still has a gradient: keep it.
            drop_degenerate_groups=cfg.drop_degenerate_groups and self.config.loss.kl_coef == 0,
        )
        plan.row = {**row, **plan.row}
        return plan, works

    # ------------------------------------------------------------------ pieces

    def _evaluate(self) -> tuple[EvalReport, list[Trajectory]]:
        """Play the held-out tasks with the engine's current weights."""
        from tir_rl.report.eval_stats import build_report
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
        return report, trajectories

    def _log_evaluation(
        self,
        step: int,
        when: str,
        prefix: str,
        report: EvalReport,
        trajectories: list[Trajectory],
    ) -> None:
        """Metrics row, `<prefix>_step_<step>.json` and one logged line for an evaluation."""
        accuracy = report.pass_at_1
        row = {
            f"{prefix}/pass_at_1": accuracy.value,
            f"{prefix}/pass_at_1_low": accuracy.low,
            f"{prefix}/pass_at_1_high": accuracy.high,
            f"{prefix}/mean_reward": report.mean_reward,
        }
        row.update(episode_row(trajectories, prefix=prefix))
        self.metrics.log(step, row)
        (self.run_dir / f"{prefix}_step_{step}.json").write_text(report.to_json() + "\n")
        sampler = " (clean sampler)" if prefix == "eval_clean" else ""
        logger.info(
            "held-out pass@1%s %s training (step %d): %s (%d tasks × %d)",
            sampler, when, step, accuracy, report.num_tasks, report.samples_per_task,
        )  # fmt: skip

    def _sync_weights(self, *, force: bool = False) -> ParityReport | None:
        """Trainer weights -> engine, then the parity probe (every rank calls this).

        With `inject` set, the engine gets the injected sampler weights (or nothing, on a
        stale step: returns None) and the probe logs the gap instead of raising.
        """
        if not self.weight_sync.due(self.num_updates, force=force):
            return None  # stale sampler: every rank skips the same syncs
        prepared = self.weight_sync.prepare(self.trainer, self.num_updates)

        def send() -> tuple[ParityReport, list[None]]:
            report = asyncio.run(self.weight_sync.rank0_send(self.runtime.engine, prepared))
            return report, [None] * self.world

        report, _ = self._share(send)
        return report

    def _checkpoint(self, step: int) -> None:
        path = step_folder(self.run_dir, step)
        if path in self.summary.checkpoints:
            return
        checkpoint.save(
            path, self.trainer, data_position=step, config=self.config, guard=self.guard
        )
        self.summary.checkpoints.append(path)

    def _plots(self, step: int) -> None:
        """Rank 0: redraw the PNG plots and send them to the sinks (W&B logs them)."""
        from tir_rl.report.plots import write_plots

        try:
            self.metrics.log_plots(step, write_plots(self.run_dir))
        except Exception as exc:  # noqa: BLE001 (plots must never end a run)
            logger.warning("could not write plots: %s", exc)


def plan_step(
    trajectories: list[Trajectory], *, world_size: int = 1, drop_degenerate_groups: bool = True
) -> tuple[_StepPlan, list[_StepWork]]:
    """Advantages, the batch and each rank's share of it, from one step's trajectories.

    Rank r trains on the r-th of `world_size` contiguous, near-equal slices of the batch.
    When there are fewer sequences than ranks, a rank without one gets a copy of the first
    sequence with an empty loss mask: it runs the passes FSDP2 needs and adds nothing to
    the loss or the token count (its per-rank metrics still enter the rank average).
    """
    from tir_rl.trainer.batch import TrainBatch
    from tir_rl.trainer.loss import group_advantages

    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajectories], dtype=torch.long)
    adv = group_advantages(rewards, groups, normalize_std=True)
    # Episodes that sampled nothing (e.g. the env failed to reset) carry no gradient;
    # they still count in their group's baseline above, as the failures they are.
    sampled = [i for i, t in enumerate(trajectories) if t.num_model_tokens > 0]
    trainable = sampled
    if drop_degenerate_groups:
        trainable = [i for i in sampled if not bool(adv.degenerate[i])]
    in_batch = trainable or sampled
    row = {"train/dropped_episodes": float(len(trajectories) - len(trainable))}
    batch = TrainBatch.from_trajectories([trajectories[i] for i in in_batch]) if in_batch else None
    plan = _StepPlan(trajectories, in_batch, batch, row, int(adv.num_degenerate_groups))
    if batch is None:
        errors = [t.error for t in trajectories if t.error]
        return plan, [_StepWork(None, None, errors[0] if errors else "")] * world_size
    advantages = adv.advantages[trainable] if trainable else None
    if world_size == 1:
        return plan, [_StepWork(batch, advantages)]
    works = []
    for piece in tdist.even_split(batch.num_sequences, world_size):
        if len(piece):
            share = batch.select(piece)
            part = advantages[piece.start : piece.stop] if advantages is not None else None
        else:
            share = batch.select([0])
            share.loss_mask = torch.zeros_like(share.loss_mask)
            part = torch.zeros(1) if advantages is not None else None
        works.append(_StepWork(share, part))
    return plan, works
