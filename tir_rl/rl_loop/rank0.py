"""Rank 0's side of a run: the rollout producer and its buffer, evaluation, logging.

Every method here runs on rank 0 only (the other ranks hold no runtime); the loop in
`tir_rl.rl_loop.loop` calls them inside its rank coordination.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tir_rl.errors import ConfigError
from tir_rl.mismatch.staleness import mismatch_by_lag, staleness_metrics, token_lags
from tir_rl.report.run_log import (
    EPISODE_ERRORS_FILE,
    TRAJECTORIES_FILE,
    append_episode_errors,
    keep_steps_up_to,
    save_trajectories,
)
from tir_rl.report.sequences import (
    SEQUENCES_FILE,
    append_sequences,
    sequence_records,
)
from tir_rl.report.step_metrics import StepOutcome, episode_row, step_row
from tir_rl.rl_loop.step_plan import (
    PlaceboDrop,
    StepPlan,
    placebo_generator,
    plan_step,
    task_seed,
)
from tir_rl.rl_loop.update import StepWork
from tir_rl.rollout.buffer import AdmissionSchedule, GroupBuffer, TakenStep
from tir_rl.rollout.producer import RolloutProducer

if TYPE_CHECKING:
    from tir_rl.engine.metered import ActivityReading, MeteredEngine
    from tir_rl.report.eval_stats import EvalReport
    from tir_rl.report.metrics_logger import MetricsLogger
    from tir_rl.rollout import EpisodeSpec
    from tir_rl.run_config import RunConfig
    from tir_rl.runtime import Runtime
    from tir_rl.types import Trajectory

logger = logging.getLogger(__name__)


@dataclass
class DataPosition:
    """Where a run stands in its task stream; saved in every checkpoint."""

    step: int
    """Steps done."""
    next_group: int
    """The first task index never admitted."""
    pending_groups: list[int] = field(default_factory=list)
    """Task indices admitted but not trained on (in flight or buffered when the checkpoint
    was written): a resumed run plays them again first."""
    num_updates: int = 0
    """Optimizer updates applied: the policy version of the weights."""

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's `data_position`."""
        return {
            "step": self.step,
            "next_group": self.next_group,
            "pending_groups": list(self.pending_groups),
            "num_updates": self.num_updates,
        }

    @classmethod
    def from_json(cls, data: Any, *, fallback_step: int, groups_per_step: int) -> DataPosition:
        """Read a checkpoint's `data_position` (an older checkpoint holds the step alone)."""
        if isinstance(data, dict):
            return cls(
                step=int(data["step"]),
                next_group=int(data["next_group"]),
                pending_groups=[int(i) for i in data.get("pending_groups", ())],
                num_updates=int(data.get("num_updates", data["step"])),
            )
        step = int(data if data is not None else fallback_step)
        return cls(step=step, next_group=step * groups_per_step, num_updates=step)


class StepTiming:
    """The wall time of each step and what the engine did in it, from one step's end to the next."""

    def __init__(self, engine: MeteredEngine) -> None:
        self.engine = engine
        self.restart()

    def restart(self) -> None:
        """Count from now (the producer has just started)."""
        self._last_end = time.perf_counter()
        self._last_reading: ActivityReading = self.engine.reading()

    def finish(self, *, train_s: float, trained_tokens: float) -> dict[str, float]:
        """The `perf/` columns of the step ending now; the next step counts from here."""
        now = time.perf_counter()
        reading = self.engine.reading()
        interval = max(now - self._last_end, 1e-9)
        busy = reading.busy_s - self._last_reading.busy_s
        sampled = reading.num_sampled_tokens - self._last_reading.num_sampled_tokens
        self._last_end, self._last_reading = now, reading
        return {
            "perf/step_s": interval,
            "perf/engine_busy_fraction": min(busy / interval, 1.0),
            "perf/trainer_busy_fraction": min(train_s / interval, 1.0),
            "perf/trained_tokens_per_s": trained_tokens / interval,
            "perf/rollout_tokens_per_s": sampled / max(busy, 1e-9),
        }


class Rank0Driver:
    """The producer, the buffer, evaluation and the step's metrics row, on rank 0."""

    def __init__(
        self,
        config: RunConfig,
        runtime: Runtime,
        metrics: MetricsLogger,
        position: DataPosition,
    ) -> None:
        from tir_rl.runtime import env_factory

        self.config = config
        self.runtime = runtime
        self.engine: MeteredEngine = runtime.engine
        self.metrics = metrics
        self.run_dir = config.run_dir
        for replayed in (SEQUENCES_FILE, TRAJECTORIES_FILE):  # a resume replays later steps
            keep_steps_up_to(self.run_dir / replayed, position.step)
        self.train_env = env_factory(config.env, config.env.train_split)
        self.eval_env = env_factory(config.env, config.env.eval_split)
        cfg = config.run
        schedule = AdmissionSchedule(  # a finished run resumed admits nothing: no step is left
            groups_per_step=cfg.tasks_per_step,
            max_staleness=cfg.max_staleness,
            num_steps=cfg.steps,
            late_groups=cfg.late_groups,
            first_step=position.step,
            next_index=position.next_group,
            replay=position.pending_groups,
            max_draws_per_step=cfg.max_draws_per_step,
        )
        self.buffer = GroupBuffer(schedule)
        self.producer = RolloutProducer(
            runtime.rollout,
            self.buffer,
            self.group_specs,
            max_concurrent_episodes=config.rollout.max_concurrent_episodes,
        )
        self._started = False
        self._unfinished: tuple[int, list[int]] = (-1, [])
        """The step taken last and its task indices, until the step is done."""
        self.timing = StepTiming(self.engine)

    # ------------------------------------------------------------------ the task stream

    def group_specs(self, index: int) -> list[EpisodeSpec]:
        """The episodes of task `index` of the stream: its seed, group id `index`."""
        from tir_rl.rollout import group_specs

        cfg = self.config.run
        return group_specs(
            self.train_env,
            task_seed(cfg.seed, index),
            group_size=cfg.group_size,
            group_id=index,
        )

    def start(self) -> None:
        """Start the producer (after the first evaluation, which runs alone)."""
        if not self._started:
            self._started = True
            self.producer.start()
            self.timing.restart()

    def stop(self) -> None:
        """Stop the producer; a group in flight is replayed by a resumed run."""
        self.producer.stop()

    def position(self, steps_done: int, num_updates: int) -> DataPosition:
        """The checkpoint's record of the task stream.

        A step taken from the buffer but not done (interrupted before its update) gives its
        groups back to the pending list, so a resumed run trains on them.
        """
        snapshot = self.buffer.snapshot()
        next_group, pending = snapshot.next_index, snapshot.pending
        taken_step, taken = self._unfinished
        if taken_step >= steps_done:
            pending = sorted([*pending, *taken])
        return DataPosition(steps_done, next_group, pending, num_updates)

    # ------------------------------------------------------------------ a step

    def take_step(
        self, step: int, *, world_size: int, trained_version: int
    ) -> tuple[StepPlan, list[StepWork]]:
        """Wait for the step's groups, compute advantages, share the batch out."""
        taken = self.buffer.take()
        if taken.step != step:
            raise ConfigError(f"the buffer handed out step {taken.step} for step {step}")
        self.producer.cancel(taken.dropped)
        self._unfinished = (step, [group.ticket.index for group in taken.groups])
        trajectories = [t for group in taken.groups for t in group.trajectories]
        row = episode_row(trajectories, prefix="rollout")
        row.update(self._async_row(taken))
        row.update(self._refill_row(taken))
        plan, works = plan_step(
            trajectories,
            world_size=world_size,
            drop_degenerate_groups=bool(self.config.run.drop_degenerate_groups),
            placebo=self._placebo(step),
        )
        plan.row = {**row, **plan.row}
        if plan.batch is not None:
            plan.token_lags = token_lags(plan.batch.policy_versions, trained_version)
            plan.row.update(
                staleness_metrics(plan.token_lags, plan.batch.loss_mask, plan.batch.turn_ids)
            )
        return plan, works

    def _refill_row(self, taken: TakenStep) -> dict[str, float]:
        """How many tasks the step drew and how many tied (zero-variance refill); {} if off."""
        bound = self.config.run.max_draws_per_step
        if bound is None:
            return {}
        with_signal = len(taken.groups) - taken.num_tied
        if with_signal < self.config.run.tasks_per_step:
            logger.warning(
                "step %d: drew %d tasks (run.max_tasks_per_step %d) and %d tied; training on "
                "the %d with a learning signal instead of %d",
                taken.step, taken.num_drawn, bound, taken.num_tied, with_signal,
                self.config.run.tasks_per_step,
            )  # fmt: skip
        return {
            "rollout/tasks_drawn": float(taken.num_drawn),
            "rollout/tied_groups": float(taken.num_tied),
            "rollout/groups_with_signal": float(with_signal),
        }

    def _placebo(self, step: int) -> PlaceboDrop | None:
        if self.config.run.placebo_drop is None:
            return None
        p_failed, p_succeeded = self.config.run.placebo_drop
        generator = placebo_generator(self.config.run.seed, step)
        return PlaceboDrop(p_failed, p_succeeded, generator)

    def _async_row(self, taken: TakenStep) -> dict[str, float]:
        snapshot = self.buffer.snapshot()
        return {
            "perf/rollout_s": taken.wait_s,
            "async/dropped_groups": float(len(taken.dropped)),
            "async/dropped_groups_total": float(snapshot.num_dropped),
            "async/buffered_groups": float(snapshot.num_finished),
            "async/in_flight_groups": float(len(self.buffer.running())),
            "async/groups_due_later": float(
                sum(group.ticket.due_step > taken.step for group in taken.groups)
            ),
        }

    def engine_holds(self, steps_done: int) -> None:
        """The engine has the weights of `steps_done` steps: admit groups up to the bound."""
        self.buffer.advance_clock(steps_done)

    def finish_step(
        self,
        step: int,
        plan: StepPlan,
        outcome: StepOutcome,
        *,
        trained_version: int,
    ) -> dict[str, float]:
        """The step's metrics row, logged with sample trajectories and plots."""
        row = self._step_row(plan, outcome)
        steps_done = step + 1
        self.metrics.log(steps_done, row)
        self._write_step_outputs(steps_done, plan, outcome, trained_version)
        return row

    def _step_row(self, plan: StepPlan, outcome: StepOutcome) -> dict[str, float]:
        """The one place a step's metrics row is assembled.

        The plan's and the update's parts, the step's timing, mismatch by policy lag, and the
        servers' health.
        """
        batch, logprobs = plan.batch, outcome.trainer_logprobs
        trained_tokens = float(batch.loss_mask.sum()) if batch is not None else 0.0
        row = step_row(outcome)
        row.update(self.timing.finish(train_s=outcome.train_s, trained_tokens=trained_tokens))
        if batch is not None and logprobs is not None and plan.token_lags is not None:
            row.update(
                mismatch_by_lag(logprobs, batch.sampler_logprobs, batch.loss_mask, plan.token_lags)
            )
        health = self.engine.servers_health()
        if health is not None:
            row["engine/servers_up"] = float(health.servers_up)
            row["engine/failovers_total"] = float(health.failovers)
        return row

    def _write_step_outputs(
        self, steps_done: int, plan: StepPlan, outcome: StepOutcome, trained_version: int
    ) -> None:
        """The step's files: episode errors, per-sequence records, sample trajectories, plots."""
        batch, logprobs = plan.batch, outcome.trainer_logprobs
        append_episode_errors(self.run_dir / EPISODE_ERRORS_FILE, plan.trajectories, steps_done)
        cfg = self.config.run
        if cfg.save_sequences and batch is not None and logprobs is not None:
            append_sequences(
                self.run_dir / SEQUENCES_FILE,
                sequence_records(
                    steps_done,
                    batch,
                    logprobs,
                    advantages=plan.advantages,
                    kept=outcome.kept,
                    weights=outcome.is_weights,
                    trained_version=trained_version,
                ),
            )
        if cfg.save_trajectories and logprobs is not None:
            keep = plan.in_batch[: cfg.save_trajectories]
            save_trajectories(
                self.run_dir / TRAJECTORIES_FILE,
                [plan.trajectories[i] for i in keep],
                steps_done,
                trainer_logprobs=[
                    logprobs[row_i, : len(plan.trajectories[i].completion_ids)].tolist()
                    for row_i, i in enumerate(keep)
                ],
                trained_version=trained_version,
            )
        if cfg.plot_every and steps_done % cfg.plot_every == 0:
            self.plots(steps_done)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> tuple[EvalReport, list[Trajectory]]:
        """Play the held-out tasks with the engine's current weights, alone on the engine."""
        from tir_rl.evaluate import stated_sampling
        from tir_rl.report.eval_stats import build_report
        from tir_rl.runtime import task_specs

        cfg = self.config.run
        with self.producer.held():
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
            sampling=stated_sampling(self.config),
        )
        return report, trajectories

    def log_evaluation(
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

    def plots(self, step: int) -> None:
        """Redraw the PNG plots and send them to the sinks (W&B logs them)."""
        from tir_rl.report.plots import write_plots

        try:
            self.metrics.log_plots(step, write_plots(self.run_dir))
        except Exception as exc:  # noqa: BLE001 (plots must never end a run)
            logger.warning("could not write plots: %s", exc)
