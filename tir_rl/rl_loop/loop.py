"""`run_train(config)`: the RL loop, top to bottom.

::

      rank 0                                                 every rank
    ┌───────────────────────────────────────────────┐
    │ RolloutProducer (its own thread and loop)      │
    │   admits groups under the staleness bound k,   │
    │   plays them on the engine ─► GroupBuffer       │
    └──────────────────────┬────────────────────────┘
                           │ step t takes B finished groups (due at t first)
                           ▼
    rewards ─► group advantages (GRPO) ─► batch ──scatter──►  Update: ℓ^old (the update
                                                              forward) ─► mismatch metrics
                                                              ─► correction ─► PPO-clip loss
                                                              ─► clip ─► AdamW (or skip)
    engine.update_weights(version t+1), in flight  ◄─gather── trainer state dict (WeightSync)
      ─► parity probe ─► the buffer's clock advances: groups due up to t+1+k are admitted

With `run.max_staleness` k = 0 a group is admitted only once the engine holds the weights
it will be trained from: rollouts, update and sync alternate as in a synchronous loop (with
`rollout.seed` set it samples the same tokens and makes the same update). With k > 0 the
producer keeps playing while the trainer computes and while weights reach the engine; every
token records the policy version that sampled it (`Trajectory.policy_versions`) and no
token lags the weights it is trained from by more than k versions (`tir_rl.rollout.buffer`).
docs/async.md has the settings and measurements.

Every step sends its metrics row to the sinks `run.loggers` names (`metrics.jsonl`, always;
TensorBoard, W&B) and writes sample trajectories and plots to the run folder; held-out
accuracy is measured before training, every `run.eval_every` steps and at the end, each
time alone on the engine with that step's weights. Ctrl-C stops the producer (its groups in
flight are played again by `--resume`), saves a checkpoint and stops cleanly.

Under `torchrun` (world size W > 1) rank 0 owns the runtime (engine, envs, sandbox,
producer), eval, metrics, plots, trajectories and the progress bar (`Rank0Driver`); every
rank holds an FSDP2 shard of the trainer and runs `Update` on its share of the batch (about
B/W sequences and their advantages, `distributed.scatter_object`); the loss normalizer is a
global token count, so the step equals the world-size-1 step. Rank-0-only work runs inside
`distributed.rank0_share` (or `rank0_run`), which also hands its failure to the other ranks (Ctrl-C,
ParityError, any error), so every rank reaches the same collective checkpoint; outside it
rank 0 defers Ctrl-C and the other ranks ignore it (`distributed.interrupt_handling`). The
step's metrics row is built by `tir_rl.report.step_metrics` and the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from tir_rl import distributed as tdist
from tir_rl.config import dump, load, to_dict
from tir_rl.engine.weights.sync import WeightSync
from tir_rl.errors import ConfigError, ParityError, RankLostError, TirError
from tir_rl.mismatch.injection import MismatchInjection
from tir_rl.process import termination
from tir_rl.process.cpu_cores import available_cores, restored_affinity
from tir_rl.process.torchrun import Nodes, torchrun_command
from tir_rl.report.eval_stats import bootstrap_paired_change
from tir_rl.report.step_metrics import StepOutcome, progress_fields
from tir_rl.rl_loop.rank0 import DataPosition, Rank0Driver
from tir_rl.rl_loop.step_plan import StepPlan
from tir_rl.rl_loop.update import StepWork, Update
from tir_rl.run_config import RunConfig
from tir_rl.trainer import checkpoint
from tir_rl.trainer.checkpoint import latest_checkpoint, step_folder

if TYPE_CHECKING:
    from tir_rl.engine.parity import ParityReport
    from tir_rl.report.eval_stats import Estimate, EvalReport
    from tir_rl.runtime import Runtime

logger = logging.getLogger(__name__)

Kept = TypeVar("Kept")

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
    stopped_by_time_budget: bool = False
    train_time_s: float = 0.0
    """Seconds of training: the run's wall time without its evaluations."""
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
    if tdist.world_size() > 1:  # which machine holds which rank, for the job's log
        logger.info("rank %d of %d on %s", tdist.rank(), tdist.world_size(), socket.gethostname())
    try:
        return _run_train(config, resume=resume)
    except Exception as exc:
        if tdist.world_size() > 1 and tdist.is_lost_peer(exc):
            raise RankLostError(
                f"another rank of this {tdist.world_size()}-rank job stopped answering during "
                f"a collective ({str(exc).splitlines()[0][:200]}). The run stops here; its "
                f"newest checkpoint is in {config.run_dir}. Find why in the other ranks' logs, "
                f"then continue on every node with: tir-rl train --resume {config.run_dir}"
            ) from exc
        raise
    finally:
        if owns_group:
            tdist.destroy_process_group()


def _run_train(config: RunConfig, *, resume: bool) -> TrainSummary:
    from tir_rl.runtime import check_env_starts, open_runtime

    run_dir = config.run_dir
    if run_dir.exists() and not resume and latest_checkpoint(run_dir) is not None:
        raise ConfigError(
            f"{run_dir} already holds checkpoints. Continue it with `tir-rl train --resume "
            f"{run_dir}`, or pick another name with --set run.name=NEW."
        )
    rank0 = tdist.is_rank0()
    _refuse_seeds_the_engine_cannot_keep(config)  # before any engine starts
    for split in dict.fromkeys((config.env.train_split, config.env.eval_split)):
        check_env_starts(config.env, split)
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
        with (
            restored_affinity(),  # trainer.cpu_cores pins the process for this run only
            open_runtime(config) if rank0 else contextlib.nullcontext() as runtime,
        ):
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
    nodes: Nodes | None = None,
) -> NoReturn:
    """Replace this process by `torchrun --nproc-per-node N -m tir_rl.cli train`.

    The ranks get the same `--config`, `--set` and `--resume` arguments. Unless
    `OMP_NUM_THREADS` is set, each rank gets `cores // N` torch threads. Without `nodes`
    the job is this machine's (`--standalone`); with it, this node's part of a job across
    `nodes.count` nodes, each launched with the same arguments and its own node rank.

    Raises:
        ConfigError: already running under torchrun.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        raise ConfigError(
            "--nproc-per-node and --nnodes start torchrun themselves; under torchrun, drop them."
        )
    args = [*(["-v"] if verbose else []), "train"]
    args += ["--config", config] if config else []
    args += ["--resume", resume] if resume else []
    for override in overrides:
        args += ["--set", override]
    cores = len(available_cores())
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc_per_node)))
    command = torchrun_command(nproc_per_node, "tir_rl.cli", args, nodes=nodes)
    logger.info("running %s", " ".join(command))
    os.execv(command[0], command)


def _collective_device(config: RunConfig) -> torch.device:
    if config.trainer.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class _TrainLoop:
    """The state of one training run; `run` is the loop."""

    def __init__(self, config: RunConfig, runtime: Runtime | None, *, resume: bool) -> None:
        """Build the trainer, guard, weight sync and, on rank 0, the driver."""
        from tir_rl.engine.parity import probe_ids_from_text
        from tir_rl.mismatch.guard import CollapseGuard
        from tir_rl.report.metrics_logger import MetricsLogger
        from tir_rl.trainer import Trainer
        from tir_rl.trainer.loss import build_policy_loss

        self.config = config
        self.runtime = runtime
        self.run_dir = config.run_dir
        self.world = tdist.world_size()
        self.rank0 = tdist.is_rank0()
        self._gate: tdist.Rank0InterruptGate | None = None
        self.trainer = Trainer(
            config.trainer,
            loss_fn=build_policy_loss(config.loss),
            correction_config=config.correction,
            truncation=config.rollout.truncation if config.trainer.replay_kept_set else None,
        )
        self.guard = CollapseGuard(config.guard, run_dir=self.run_dir)
        self.update = Update(self.trainer, self.guard)
        self.injection = MismatchInjection(config.inject)
        if self.rank0 and config.inject.active:
            logger.warning("%s", self.injection.describe())
        probe_ids = probe_ids_from_text(runtime.tokenizer) if self.rank0 else None
        self.weight_sync = WeightSync(
            self.injection,
            probe_ids=tdist.broadcast_object(probe_ids),  # type: ignore[arg-type]
            parity_tolerance=config.run.parity_tolerance,
            keep_stale_copy=config.run.eval_clean_sampler,
        )
        position = DataPosition(step=0, next_group=0)
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise ConfigError(f"{self.run_dir} has no checkpoint to resume from.")
            state = checkpoint.load(ckpt, self.trainer, guard=self.guard)
            # The loop's position, not the trainer's count of train_step calls (a step
            # without a trainable episode makes none).
            position = DataPosition.from_json(
                state.data_position,
                fallback_step=state.step,
                groups_per_step=config.run.tasks_per_step,
            )
            logger.info("resumed from %s (step %d)", ckpt, position.step)
        self.start_step = position.step
        self.num_updates = position.num_updates
        """Optimizer updates applied so far: the policy version of the trainer's weights."""
        if resume or self.injection.transforms_weights:
            self._sync_weights(force=True)  # the engine loaded the untouched checkpoint
        self.driver: Rank0Driver | None = None
        if self.rank0:
            assert runtime is not None
            metrics = MetricsLogger.open(
                MetricsLogger.Config(
                    run_dir=self.run_dir,
                    loggers=config.run.loggers,
                    wandb=config.wandb,
                    resume_after_step=self.start_step if resume else None,
                )
            )
            metrics.log_config(to_dict(config))
            self.driver = Rank0Driver(config, runtime, metrics, position)
        self.summary = TrainSummary(
            self.run_dir, self.start_step, rank=tdist.rank(), world_size=self.world
        )
        self._eval_s = 0.0
        """Seconds spent in evaluations so far (not training time)."""
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
            if self.driver is not None:
                self.driver.start()
            train_started = time.perf_counter()
            self._eval_s = 0.0  # the first evaluation came before
            steps = range(self.start_step, cfg.steps)
            bar = tqdm(steps, desc="train", unit="step") if self.rank0 else None
            for step in bar if bar is not None else steps:
                termination.raise_if_terminated()
                row, stop = self._step(step)
                if bar is not None:
                    bar.set_postfix(progress_fields(row))
                done = step + 1
                self.summary.train_time_s = time.perf_counter() - train_started - self._eval_s
                out_of_time = self._out_of_time()
                last = done == cfg.steps or out_of_time or stop
                if cfg.eval_every and done % cfg.eval_every == 0 and not last:
                    self._evaluate_shared(done, "periodic")
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                    self._checkpoint(done)
                if stop:
                    logger.warning("collapse guard asked to stop at step %d", step)
                    self.summary.stopped_by_guard = True
                    break
                if out_of_time:
                    logger.info("run.time_budget_s reached after step %d", step)
                    self.summary.stopped_by_time_budget = True
                    break
            self._stop_producer()
            self._refuse_if_nothing_sampled()
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
        except SystemExit:
            if termination.requested():
                logger.warning(
                    "terminated (SIGTERM): saving a checkpoint at step %d; resume the run with "
                    "--resume",
                    self.summary.steps_done,
                )
            raise
        except ParityError:
            self.ended_together = True
            self._stop_producer()
            self._checkpoint(self.summary.steps_done)
            raise
        finally:
            self._stop_producer()
            self._checkpoint(self.summary.steps_done)
            if self.driver is not None:
                self.driver.plots(self.summary.steps_done)
                self.driver.metrics.close()
        return self.summary

    def _refuse_if_nothing_sampled(self) -> None:
        try:
            self.update.check_sampled(self.summary.steps_done - self.start_step)
        except TirError:
            self.ended_together = True  # every rank skipped the same steps and raises alike
            raise

    def _step(self, step: int) -> tuple[dict[str, float], bool]:
        """One RL step: take the groups → advantages → update → sync in flight → log."""
        trained_version = self.num_updates
        plan, work = self._share(lambda: self._rank0_take(step, trained_version))
        train_started = time.perf_counter()
        result = self.update(step, work)
        # Identical on every rank (global metrics); rank 0's verdict is taken all the same.
        updated, stop = tdist.broadcast_object((not result.skipped, result.stop))  # type: ignore[misc]
        # The trainer has taken this step: a failure from here on (Ctrl-C, a ParityError in
        # the sync) checkpoints it as done, and `--resume` goes on with the next one.
        self.summary.steps_done = step + 1
        batch = plan.batch if plan is not None else None
        trainer_logprobs, kept, is_weights = tdist.rank0_gather_rows(
            result.gathered_rows(),
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
        if self.driver is None:
            return {}, stop
        self.driver.engine_holds(step + 1)  # synced, or unchanged by a step without update
        outcome = StepOutcome(
            rollout_row=plan.row,
            batch=batch,
            result=result,
            trainer_logprobs=trainer_logprobs,
            num_degenerate_groups=plan.num_degenerate_groups,
            train_s=train_s,
            sync_s=sync_s,
            parity=parity,
            kept=kept,
            is_weights=is_weights,
        )
        row = self.driver.finish_step(step, plan, outcome, trained_version=trained_version)
        return row, stop

    def _out_of_time(self) -> bool:
        """Whether `run.time_budget_s` is spent (rank 0's clock decides, for every rank)."""
        budget = self.config.run.time_budget_s
        if budget is None:
            return False
        return bool(tdist.broadcast_object(self.summary.train_time_s >= budget))

    def _rank0_take(self, step: int, trained_version: int) -> tuple[StepPlan, list[StepWork]]:
        assert self.driver is not None
        return self.driver.take_step(step, world_size=self.world, trained_version=trained_version)

    def _share(self, fn: Callable[[], tuple[Any, list[Any]]]) -> tuple[Any, Any]:
        """`tdist.rank0_share`; a failure it shares ends every rank the same way."""
        return tdist.rank0_share(fn, gate=self._gate, on_shared_failure=self._ended_together)

    def _on_rank0(self, fn: Callable[[], Kept]) -> Kept | None:
        """`tdist.rank0_run`; a failure it shares ends every rank the same way."""
        return tdist.rank0_run(fn, gate=self._gate, on_shared_failure=self._ended_together)

    def _ended_together(self) -> None:
        self.ended_together = True

    def _stop_producer(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    # ------------------------------------------------------------------ evaluation

    def _evaluate_shared(self, step: int, when: str) -> EvalReport | None:
        """Held-out evaluation on rank 0 (None on the other ranks); its time is not training's."""
        started = time.perf_counter()
        try:
            return self._evaluate_both(step, when)
        finally:
            self._eval_s += time.perf_counter() - started

    def _evaluate_both(self, step: int, when: str) -> EvalReport | None:
        clean = self.config.run.eval_clean_sampler
        separate_clean = clean and self.injection.changes_sampling

        def evaluate() -> EvalReport:
            assert self.driver is not None
            report, trajectories = self.driver.evaluate()
            self.driver.log_evaluation(step, when, "eval", report, trajectories)
            if clean and not separate_clean:  # the run's sampler is the clean one
                self.driver.log_evaluation(step, when, "eval_clean", report, trajectories)
            return report

        report = self._on_rank0(evaluate)
        if separate_clean:
            self._evaluate_clean_shared(step, when)
        return report

    def _evaluate_clean_shared(self, step: int, when: str) -> None:
        """Held-out evaluation of the trainer's exact weights (`run.eval_clean_sampler`).

        The engine gets the trainer's state for the evaluation, then the sampler's weights
        back (`WeightSync.rank0_exact_weights`); the producer is held meanwhile.
        """
        full = self.trainer.rank0_full_state_dict()

        def clean() -> None:
            assert self.driver is not None and self.runtime is not None
            engine = self.runtime.engine
            with (
                self.driver.producer.held(),
                self.weight_sync.rank0_exact_weights(engine, full, self.num_updates),
            ):
                report, trajectories = self.driver.evaluate()
                self.driver.log_evaluation(step, when, "eval_clean", report, trajectories)

        self._on_rank0(clean)

    # ------------------------------------------------------------------ pieces

    def _sync_weights(self, *, force: bool = False) -> ParityReport | None:
        """Trainer weights -> engine, in flight, then the parity probe (every rank calls this).

        With `inject` set, the engine gets the injected sampler weights (or nothing, on a
        stale step: returns None) and the probe logs the gap instead of raising.
        """
        if not self.weight_sync.due(self.num_updates, force=force):
            return None  # stale sampler: every rank skips the same syncs
        prepared = self.weight_sync.prepare(self.trainer, self.num_updates)

        def send() -> ParityReport:
            assert self.runtime is not None
            return asyncio.run(
                self.weight_sync.rank0_send(self.runtime.engine, prepared, self.num_updates)
            )

        return self._on_rank0(send)

    def _checkpoint(self, step: int) -> None:
        path = step_folder(self.run_dir, step)
        if path in self.summary.checkpoints:
            return
        position = None
        if self.driver is not None:
            position = self.driver.position(step, self.num_updates).to_json()
        checkpoint.save(  # every rank writes its part; rank 0 the data position
            path,
            self.trainer,
            data_position=position,
            config=self.config,
            guard=self.guard,
        )
        self.summary.checkpoints.append(path)


def _refuse_seeds_the_engine_cannot_keep(config: RunConfig) -> None:
    """Seeded sampling with in-flight updates kills vLLM-CPU's engine: refuse it up front."""
    from tir_rl.engine.engine_config import EngineKind
    from tir_rl.engine.vllm_local import seeded_requests_survive_updates

    if (
        config.run.max_staleness > 0
        and config.rollout.seed is not None
        and config.engine.kind is EngineKind.LOCAL
        and not seeded_requests_survive_updates()
    ):
        raise ConfigError(
            f"rollout.seed={config.rollout.seed} with run.max_staleness="
            f"{config.run.max_staleness}: weights land while seeded requests are in flight, "
            "and vLLM-CPU 0.32 kills its engine when it resumes one ('CPU Generator does not "
            "use offset'). Set rollout.seed=null, or run.max_staleness=0 (synchronous)."
        )
