"""The root config of `tir-rl train | eval | rollout | doctor`: one YAML file, one tree.

Each section is the nested `Config` of the component it configures; the run-level values
(model, steps, batch shape, output folder) live in `RunSection`. Load with
`tir_rl.config.load(RunConfig, path, overrides)`. This module composes the components'
configs, so it sits with the entry points; `tir_rl.config` (the loader) knows no component.

Its reference, docs/configuration.md, is generated here::

    python -m tir_rl.run_config > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tir_rl.chat import ChatFormat
from tir_rl.config.reference import reference
from tir_rl.engine.base import PROCESSED_LOGPROBS
from tir_rl.engine.engine_config import EngineConfig, EngineKind
from tir_rl.errors import ConfigError
from tir_rl.mismatch import MismatchCorrection
from tir_rl.mismatch.guard import CollapseGuard
from tir_rl.mismatch.injection import RAW_LOGPROBS, MismatchInjection
from tir_rl.report.sinks import DEFAULT_LOGGERS, LoggerName, check_logger_names
from tir_rl.report.wandb_sink import WandbSink, require_wandb
from tir_rl.rollout import Rollout
from tir_rl.rollout.buffer import LateGroups
from tir_rl.rollout.card_sampling import SamplingSource, read_card_sampling
from tir_rl.sandbox import SandboxConfig
from tir_rl.trainer import Trainer
from tir_rl.trainer.loss.choice import PolicyLossConfig
from tir_rl.trainer.lr_schedule import LRSchedule

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RunSection:
    """Run-level settings: size of the job and where its outputs go."""

    name: str = "run"
    """Run name; outputs go to `<out_dir>/<name>/`."""
    out_dir: Path = Path("runs")
    """Parent folder of run folders."""
    steps: int = 10
    """Number of RL steps (rollouts + one optimizer step each)."""
    tasks_per_step: int = 4
    """Tasks (GRPO groups) sampled per step."""
    group_size: int = 4
    """Samples per task; advantages are relative within a group."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0: only before and after training)."""
    eval_tasks: int = 16
    """Number of held-out tasks per evaluation."""
    eval_samples_per_task: int = 1
    """Samples per held-out task (pass@k uses k <= this)."""
    eval_clean_sampler: bool = False
    """With `inject` set, evaluate every held-out point twice: with the run's own (injected)
    sampler, and with the trainer's exact weights sent to the engine for the evaluation
    (logged as `eval_clean/*`). The second is the trained policy as a faithful sampler runs
    it. Refused with `inject.sampler_dtype` (the engine itself computes in that dtype; evaluate
    the checkpoints with `tir-rl eval` instead). Without an injection the run's sampler is
    already clean and its figures are logged under both names."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0: only at the end and on interruption)."""
    save_trajectories: int = 4
    """Sample trajectories saved per step to `trajectories.jsonl`."""
    save_sequences: bool = True
    """Write one record per trained sequence and step to `sequences.jsonl`: its advantage,
    its sampler/trainer log-ratio, the tokens the correction kept and their mean importance
    weight (`tir_rl/report/sequences.py`; about 150 bytes per sequence)."""
    plot_every: int = 1
    """Regenerate PNG plots every N steps."""
    drop_degenerate_groups: bool | None = None
    """Leave groups whose rewards are all equal out of the update (DAPO's dynamic sampling):
    with `loss.kl_coef` 0 they carry no gradient, and keeping them only shrinks the step
    through the token-mean normalizer and costs a backward pass. A step where every group
    is degenerate makes no update but still logs the mismatch metrics. null (the default):
    drop them when `loss.kl_coef` is 0, keep them with a KL penalty, since the KL term gives
    degenerate groups (advantage 0) gradient towards the reference; the saved config records
    the choice. `true` with `loss.kl_coef` > 0 is refused."""
    refill_degenerate_groups: bool = False
    """Zero-variance refill (DAPO's dynamic sampling): a group whose rewards all tie gives its
    place back and another task is drawn for the same step, until the step holds
    `tasks_per_step` groups with a learning signal or has drawn `max_tasks_per_step` tasks;
    then it trains on what it has and logs a warning. Keeps every step's size and noise the
    same whatever the task mix. Metrics: `rollout/tasks_drawn`, `rollout/tied_groups`,
    `rollout/groups_with_signal`. The tied groups are scored and counted, never trained on;
    needs degenerate groups dropped (`drop_degenerate_groups`, so no KL penalty). The task
    stream then no longer maps step s to groups s·tasks_per_step ...: each step draws what it
    needs."""
    max_tasks_per_step: int | None = None
    """The most tasks one step draws with `refill_degenerate_groups` (at least
    `tasks_per_step`). null: 4 × tasks_per_step. Refused without refill."""
    placebo_drop: tuple[float, float] | None = None
    """A control for the collapse lab, not a method: [p_failed, p_succeeded]. After the
    advantages are computed, each failed episode (advantage < 0) leaves the update with
    probability p_failed and each succeeded one (> 0) with p_succeeded, drawn at random from
    `seed` and the step whatever the episode's mismatch: what a sequence mask rejecting those
    shares would do if it did not look at the log-ratio. Counted in
    `train/placebo_dropped_episodes`. null: off."""
    parity_tolerance: float = 1e-3
    """Largest sampler/trainer logprob gap allowed on the probe after each weight sync."""
    seed: int = 0
    """The run's seed. It seeds the task stream (the task of group index g is a function of
    seed and g; with `max_staleness` 0, step s trains on groups s·tasks_per_step ...
    (s+1)·tasks_per_step − 1) and every other random source left unset: `engine.local.seed`
    (the sampler's draws; with `engine.kind: http` the server's `--seed` decides them),
    `trainer.seed` and `inject.noise_seed`. A value set in those sections is kept. The
    held-out tasks do not depend on it, so runs of several seeds are evaluated on the same
    tasks."""
    max_staleness: int = 0
    """k: the most policy versions (optimizer steps) a sampled token may lag the weights it
    is trained from. 0: the synchronous on-policy loop (rollouts, update and weight sync take
    turns). k > 0: rollouts go on while the trainer updates, new weights reach the engine in
    flight, and a group is admitted only if it will be trained within k versions of the
    weights the engine holds (docs/async.md)."""
    time_budget_s: float | None = None
    """Stop after this many seconds of training (evaluations excluded), even before `steps`;
    the final evaluation and checkpoint follow as after the last step. None: run `steps`."""
    late_groups: LateGroups = LateGroups.WAIT
    """What a step does about its groups still being played (k > 0): `wait` for them (every
    admitted group is trained on), or `drop` them and admit new tasks (favours short
    episodes; counted in `async/dropped_groups`)."""
    loggers: list[LoggerName] = field(default_factory=lambda: list(DEFAULT_LOGGERS))
    """Where metrics go: `jsonl` (`metrics.jsonl`, always: plots and `--resume` read it),
    `tensorboard` (`tensorboard/`), `wandb` (Weights & Biases, set up in the `wandb`
    section; `pip install "tir-rl[wandb]"`)."""

    def validate(self) -> None:
        """Check the batch shape, intervals and loggers."""
        check_logger_names(self.loggers)
        for name in ("steps", "tasks_per_step", "group_size", "eval_tasks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"run.time_budget_s must be > 0 or null, got {self.time_budget_s}")
        if self.max_staleness < 0:
            raise ConfigError(
                f"run.max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}"
            )
        for name in ("eval_every", "checkpoint_every", "plot_every", "save_trajectories"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_tasks_per_step is not None:
            if not self.refill_degenerate_groups:
                raise ConfigError(
                    f"run.max_tasks_per_step={self.max_tasks_per_step} bounds the zero-variance "
                    "refill, which is off: set run.refill_degenerate_groups=true, or drop "
                    "run.max_tasks_per_step."
                )
            if self.max_tasks_per_step < self.tasks_per_step:
                raise ConfigError(
                    f"run.max_tasks_per_step ({self.max_tasks_per_step}) must be at least "
                    f"run.tasks_per_step ({self.tasks_per_step})"
                )
        drop = self.placebo_drop
        if drop is not None and not (len(drop) == 2 and all(0 <= p <= 1 for p in drop)):
            raise ConfigError(
                f"run.placebo_drop must be [p_failed, p_succeeded], two probabilities in "
                f"[0, 1], or null for off; got {drop}"
            )

    @property
    def max_draws_per_step(self) -> int | None:
        """Tasks one step may draw with refill (the bound, resolved); None: no refill."""
        if not self.refill_degenerate_groups:
            return None
        return self.max_tasks_per_step or 4 * self.tasks_per_step


@dataclass(kw_only=True)
class EnvSection:
    """Which environment the run trains and evaluates on."""

    id: str = "tir_rl/MathPython-v0"
    """gymnasium id (`tir_rl/...` ids are registered by importing `tir_rl.envs`), or a user
    env as `module:Name-v0` (the module registers it when imported) or `module:ClassName`
    (docs/bring_your_env.md)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `gymnasium.make` (e.g. `difficulty`, `horizon`)."""
    train_split: str = "train"
    """Split the training tasks come from."""
    eval_split: str = "test"
    """Held-out split for evaluation (disjoint from `train_split` by construction)."""


FOLLOWS_MODEL = ""
"""Default of `engine.model_path` and `trainer.model` in a run config: take `model`."""
FOLLOWS_ROLLOUT = None
"""Default of `trainer.temperature` in a run config: take `rollout.temperature`."""


def _refuse_a_second_name(
    key: str, given: object, unset: object, owner: str, value: object, why: str
) -> None:
    """Refuse `key` set to something other than `owner`'s value (`unset`: it follows `owner`).

    Raises:
        ConfigError: `given` is neither `unset` nor `value`.
    """
    if given == unset or given == value:
        return
    raise ConfigError(
        f"{key}={given!r} differs from {owner}={value!r}: {why}, named once by {owner}. "
        f"Set {owner}={given!r} and leave {key} unset."
    )


@dataclass(kw_only=True)
class RunConfig:
    """Everything one run needs."""

    model: str = "bundled"
    """`bundled`, `tiny`, or a local Hugging Face checkpoint; used by engine and trainer."""
    run: RunSection = field(default_factory=RunSection)
    env: EnvSection = field(default_factory=EnvSection)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(model_path=FOLLOWS_MODEL))
    rollout: Rollout.Config = field(default_factory=Rollout.Config)
    chat: ChatFormat.Config = field(default_factory=ChatFormat.Config)
    """The chat format (docs/chat-format.md, docs/bring_your_model.md): its family and the
    system prompt and tool block it renders."""
    trainer: Trainer.Config = field(
        default_factory=lambda: Trainer.Config(model=FOLLOWS_MODEL, temperature=FOLLOWS_ROLLOUT)
    )
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    correction: MismatchCorrection.Config = field(default_factory=MismatchCorrection.Config)
    correction_preset: str | None = None
    """A named correction recipe (see `MismatchCorrection.Config.preset`); fields set in
    `correction` override the preset's."""
    inject: MismatchInjection.Config = field(default_factory=MismatchInjection.Config)
    guard: CollapseGuard.Config = field(default_factory=CollapseGuard.Config)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    wandb: WandbSink.Config = field(default_factory=WandbSink.Config)
    """Weights & Biases settings; used when `run.loggers` names `wandb`."""

    def resolve(self) -> None:
        """Point the sections at the settings they follow, once, before `validate`.

        The loader calls it (`tir_rl.config.loading`): a value that follows another (the
        trainer's temperature and model, the seeds, the engine under an injection, the
        preset folded into `correction`) is filled in here, and a contradicting one is
        refused; the saved config is then explicit. `validate` only checks.
        """
        self._resolve_degenerate_groups()
        self._take_card_sampling()
        self._follow_temperature()
        self._follow_kernels()
        if self.correction_preset is not None:
            default = MismatchCorrection.Config()
            changed = {
                f.name: getattr(self.correction, f.name)
                for f in dataclasses.fields(self.correction)
                if getattr(self.correction, f.name) != getattr(default, f.name)
            }
            self.correction = MismatchCorrection.Config.preset(self.correction_preset, **changed)
            self.correction_preset = None  # folded in: the saved config is explicit
        self._follow_model()
        self._follow_run_seed()
        self._apply_injection()
        if self.trainer.lr_schedule is LRSchedule.COSINE and self.trainer.schedule_steps == 0:
            self.trainer.schedule_steps = self.run.steps  # the documented meaning of 0

    def validate(self) -> None:
        """Cross-section checks of the resolved config; changes nothing."""
        self.run.validate()
        self.trainer.validate()  # a cosine schedule's resolved length against its warm-up
        self._check_wandb()
        if self.trainer.reference_model and self.loss.kl_coef == 0:
            raise ConfigError(
                f"trainer.reference_model={self.trainer.reference_model!r} is set but "
                "loss.kl_coef is 0, so no reference policy is loaded. Set loss.kl_coef > 0 for a "
                "KL penalty to it, or drop trainer.reference_model."
            )
        self._warn_stale_sequence_masks()

    def _resolve_degenerate_groups(self) -> None:
        """`run.drop_degenerate_groups`: null follows the KL penalty; true beside one is refused."""
        kl = self.loss.kl_coef > 0
        if self.run.drop_degenerate_groups is None:
            self.run.drop_degenerate_groups = not kl
        elif self.run.drop_degenerate_groups and kl:
            raise ConfigError(
                f"run.drop_degenerate_groups=true with loss.kl_coef={self.loss.kl_coef}: with a "
                "KL penalty a group whose rewards are all equal still has a gradient (towards "
                "the reference), so dropping it changes the update. Set "
                "run.drop_degenerate_groups=false, or leave it unset (null keeps them with a KL "
                "penalty and drops them without one)."
            )
        if self.run.refill_degenerate_groups and not self.run.drop_degenerate_groups:
            raise ConfigError(
                "run.refill_degenerate_groups draws new tasks for groups whose rewards tie, "
                "which the update leaves out; this config keeps them "
                f"(run.drop_degenerate_groups false, loss.kl_coef {self.loss.kl_coef}). Turn "
                "the refill off, or drop degenerate groups (no KL penalty)."
            )

    def _warn_stale_sequence_masks(self) -> None:
        """A narrow geometric band rejects stale sequences: say so (docs/async.md)."""
        geo = self.correction.geo_mask
        if self.run.max_staleness > 0 and geo is not None and geo[1] / max(geo[0], 1e-12) < 1.01:
            logger.warning(
                "correction geo_mask=%s with run.max_staleness=%d: the band detects numerical "
                "mismatch, and the policy's drift over one update usually leaves it, so stale "
                "sequences will be rejected (watch mismatch/correction/masked_seq_fraction). "
                "docs/async.md: use correction_preset=token_tis, or widen geo_mask.",
                geo, self.run.max_staleness,
            )  # fmt: skip

    def _check_wandb(self) -> None:
        """W&B must be installed when named; its settings are refused when it is not named."""
        if LoggerName.WANDB in self.run.loggers:
            require_wandb()
            return
        default = WandbSink.Config()
        changed = [
            f"wandb.{f.name}"
            for f in dataclasses.fields(self.wandb)
            if getattr(self.wandb, f.name) != getattr(default, f.name)
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)} set but run.loggers={[str(n) for n in self.run.loggers]} "
                "has no 'wandb': add it (e.g. --set 'run.loggers=[jsonl,tensorboard,wandb]') "
                "or drop the wandb settings."
            )

    def _follow_model(self) -> None:
        """Point engine and trainer at `model`; refuse a different checkpoint for either."""
        why = "the sampler and the trainer start from the same weights"
        for key, given in (
            ("engine.model_path", self.engine.model_path),
            ("trainer.model", self.trainer.model),
        ):
            _refuse_a_second_name(key, given, FOLLOWS_MODEL, "model", self.model, why)
        self.engine = dataclasses.replace(self.engine, model_path=self.model)
        self.trainer.model = self.model

    def _take_card_sampling(self) -> None:
        """`rollout.sampling_from: model`: the model card's sampling, folded into `rollout`."""
        if self.rollout.sampling_from is SamplingSource.CONFIG:
            return
        from tir_rl.models import resolve_model

        card = read_card_sampling(resolve_model(self.model))
        default = Rollout.Config()
        for name, value in card.declared().items():
            given = getattr(self.rollout, name)
            if given != getattr(default, name) and given != value:
                raise ConfigError(
                    f"rollout.{name}={given!r} and rollout.sampling_from=model, whose card "
                    f"says {name} {value!r}: give one. Drop rollout.{name} to sample as the "
                    "card says, or set rollout.sampling_from=config to sample as you say."
                )
            setattr(self.rollout, name, value)
        if card.not_applied:
            logger.warning(
                "the model's generation config also asks for %s: tir-rl does not apply it (the "
                "trainer could not replay it, and every importance ratio would carry it)",
                ", ".join(card.not_applied),
            )
        logger.info("sampling as the model's card says: %s", card.declared())
        self.rollout.sampling_from = SamplingSource.CONFIG  # folded in: the saved one is explicit

    def _follow_temperature(self) -> None:
        """The trainer divides its logits by the sampler's temperature, named once."""
        _refuse_a_second_name(
            "trainer.temperature",
            self.trainer.temperature,
            FOLLOWS_ROLLOUT,
            "rollout.temperature",
            self.rollout.temperature,
            "the trainer must divide its logits by the sampler's temperature",
        )
        self.trainer.temperature = self.rollout.temperature

    def _follow_kernels(self) -> None:
        """VLLM's kernels in the trainer need an engine whose decode rounds like its prefill."""
        if self.trainer.kernels == "batch_invariant":
            self._follow_batch_invariant_kernels()
        if self.trainer.kernels != "vllm_cpu":
            return
        if self.engine.kind is not EngineKind.LOCAL or self.engine.local.cpu_attention_split_kv:
            raise ConfigError(
                "trainer.kernels vllm_cpu matches a local vLLM-CPU engine that does not split "
                "its attention's keys over threads; this config has engine.kind "
                f"{self.engine.kind} and engine.local.cpu_attention_split_kv "
                f"{self.engine.local.cpu_attention_split_kv}. Use engine.kind local and leave "
                "engine.local.cpu_attention_split_kv unset, or trainer.kernels torch."
            )
        self.engine = self.engine.with_local(cpu_attention_split_kv=False)

    def _follow_batch_invariant_kernels(self) -> None:
        """The trainer's batch-invariant kernels go with the local engine's, named once."""
        if self.engine.kind is not EngineKind.LOCAL or self.engine.local.batch_invariant is False:
            raise ConfigError(
                "trainer.kernels batch_invariant starts the run's local engine in vLLM's "
                f"batch-invariant mode; this config has engine.kind {self.engine.kind} and "
                f"engine.local.batch_invariant {self.engine.local.batch_invariant}. Use "
                "engine.kind local and leave engine.local.batch_invariant unset, or "
                "trainer.kernels torch."
            )
        self.engine = self.engine.with_local(batch_invariant=True)

    def _follow_run_seed(self) -> None:
        """Seed every random source left unset from `run.seed` (the saved config is explicit)."""
        seed = self.run.seed
        if self.engine.local.seed is None and self.engine.kind is EngineKind.LOCAL:
            self.engine = self.engine.with_local(seed=seed)
        if self.trainer.seed is None:
            self.trainer.seed = seed
        if self.inject.noise_seed is None:
            self.inject = dataclasses.replace(self.inject, noise_seed=seed)

    def _apply_injection(self) -> None:
        """Engine overrides of `inject`; the trainer must stay the fp32 reference."""
        inject = self.inject
        inject.validate()
        if not inject.active:
            return
        if self.run.eval_clean_sampler and inject.sampler_dtype is not None:
            raise ConfigError(
                "run.eval_clean_sampler cannot undo "
                f"inject.sampler_dtype={inject.sampler_dtype!r}: "
                "the engine itself computes in that dtype. Leave run.eval_clean_sampler off and "
                "evaluate the run's checkpoints with `tir-rl eval --checkpoint <step folder>`."
            )
        if self.trainer.dtype != "float32":
            raise ConfigError(
                f"inject is set but trainer.dtype={self.trainer.dtype!r}: injected mismatch is "
                "measured against a float32 trainer. Set trainer.dtype=float32."
            )
        # The injection decides the sampler's dtype and logprobs mode; another explicit value
        # in the engine section contradicts it (float32 and processed logprobs are defaults).
        if inject.sampler_dtype is not None and self.engine.dtype not in (
            "float32",
            inject.sampler_dtype,
        ):
            raise ConfigError(
                f"engine.dtype={self.engine.dtype!r} contradicts "
                f"inject.sampler_dtype={inject.sampler_dtype!r}, which sets the sampler's dtype. "
                "Drop engine.dtype (or set it to the injected dtype)."
            )
        if inject.raw_logprobs and self.engine.logprobs_mode not in (
            PROCESSED_LOGPROBS,
            RAW_LOGPROBS,
        ):
            raise ConfigError(
                f"engine.logprobs_mode={self.engine.logprobs_mode!r} contradicts "
                f"inject.raw_logprobs, which makes the sampler record {RAW_LOGPROBS!r}. Drop "
                "engine.logprobs_mode (or set it to raw_logprobs)."
            )
        if inject.raw_logprobs and self.rollout.temperature == 1.0:
            logger.warning(
                "inject.raw_logprobs has no effect at rollout.temperature=1 (raw and processed "
                "logprobs are equal there); sample at another temperature to see a gap"
            )
        self.engine = MismatchInjection(inject).apply_to_engine_config(self.engine)

    @property
    def run_dir(self) -> Path:
        """This run's output folder."""
        return Path(self.run.out_dir) / self.run.name


def configuration_reference() -> str:
    """docs/configuration.md: every key of `RunConfig`, its type, default and meaning."""
    header = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `python -m tir_rl.run_config`; do not edit.",
        "Every key can be set in the YAML file or with `--set section.key=value`; an unknown",
        "key is an error that names the nearest valid one. `correction_preset` names a recipe",
        "(see docs/mismatch.md) whose fields the `correction` section can override. A mapping",
        "given with `--set` merges into the file's (`--set env.kwargs={horizon: 4}` keeps its",
        "other options); an empty one clears it (`--set env.kwargs={}`). Overrides apply in",
        "the order given: `--set env.kwargs={} --set env.kwargs={horizon: 4}` leaves `horizon`",
        "alone.",
        "",
    ]
    return reference(RunConfig, header=header)


if __name__ == "__main__":
    print(configuration_reference(), end="")
