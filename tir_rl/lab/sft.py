"""SFT warm start: teach a model an environment's tool protocol from oracle episodes.

A policy that never calls a tool gets reward 0 on every sample, so GRPO has no signal. This
step fine-tunes it on demonstrations first::

    env.reset ──► env.demonstration(task) ──► each assistant turn's text "sampled" into a
        Conversation (the tokenizer's own ids + end of turn, mask 1) ──► env.step(message)
        ──► the env's own tool messages appended (mask 0) ──► ... ──► reward must be full
    demos ──► cross-entropy on mask-1 tokens (AdamW, fp32) ──► HF checkpoint (model + tokenizer)

The optimizer, gradient clipping and seeding are the RL trainer's (`tir_rl.trainer.optimizer`); the
checkpoint folder is written as a training checkpoint's model is (`tir_rl.trainer.checkpoint`).

The token ids and loss mask of a demonstration are exactly those a rollout builds for the
same assistant texts: the same `ChatFormat` (the `chat` section, which should be the RL
run's, and tool schemas from `ResetInfo.tool_schemas`) and the same `Conversation` calls as
`tir_rl.rollout.episode`. Demonstrations come from the train split only.

Shared prefix: every demonstration of one environment starts with the same system turn
(hundreds of tokens). With `TrainSection.cache_shared_prefix` its keys and values are
computed once per optimizer step without gradient and reused by every sequence of the step.
The forward pass is exact (current weights); the gradient leaves out the path through the
prefix's keys and values (which carry no loss of their own), for about 2.5x less compute
here.

`run_sft` is idempotent: when the output folder already holds a checkpoint made from the
same config (same hash, output folder excluded) it returns it without training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl.chat import ChatFormat
from tir_rl.config import to_dict
from tir_rl.errors import ConfigError, TirError
from tir_rl.lab.sft_config import (
    SFTConfig,
    SFTDataSection,
    SFTEnvSection,
    SFTTrainSection,
    load_sft_config,
)
from tir_rl.trainer import checkpoint
from tir_rl.trainer.lr_schedule import LRSchedule, lr_factor
from tir_rl.trainer.optimizer import build_adamw, clip_gradients, grad_norm, seed_everything

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

    from tir_rl.chat.tokens import Tokenizer
    from tir_rl.envs.base import Task, ToolEnv
    from tir_rl.types import Message

logger = logging.getLogger(__name__)

INFO_FILE = "sft_info.json"
"""Written last into the checkpoint folder: config, its hash, losses, timings."""


@dataclass(frozen=True)
class Demonstration:
    """One oracle episode, rendered as a rollout renders it."""

    token_ids: list[int]
    """Prompt and completion token ids."""
    loss_mask: list[int]
    """1 on assistant tokens (what the model would sample), 0 on prompt and env tokens."""
    task_id: str
    """The env's task id."""
    reward: float
    """The env's reward for the episode."""

    @property
    def num_loss_tokens(self) -> int:
        """Number of mask-1 tokens."""
        return sum(self.loss_mask)


@dataclass(frozen=True)
class SFTStepRecord:
    """One optimizer step of `train_on_demonstrations`."""

    step: int
    epoch: int
    loss: float
    """Mean cross-entropy per loss token of the step's sequences."""
    grad_norm: float
    """Gradient L2 norm before clipping."""
    sequences: int
    seconds: float


@dataclass(frozen=True)
class SFTTrainStats:
    """What `train_on_demonstrations` reports."""

    loss_before: float | None
    """Mean loss on the probe demonstrations before training; None without probes."""
    loss_after: float | None
    steps: int
    shared_prefix_tokens: int
    """Tokens of the prefix computed once per step without gradient (0: not cached)."""
    history: list[SFTStepRecord]


@dataclass(frozen=True, kw_only=True)
class SFTInfo:
    """The record `sft_info.json` holds next to a fine-tuned checkpoint."""

    config_hash: str
    """`SFTConfig.config_hash` of the config that made it (the idempotency key)."""
    config: dict[str, Any]
    """That config, serialised."""
    base_model: str
    num_demos: int
    demo_tokens: int
    """Tokens of all demonstrations."""
    loss_tokens: int
    """Assistant tokens (loss mask 1) among them."""
    stats: SFTTrainStats
    seconds_demos: float
    seconds_train: float
    seconds_total: float = 0.0
    """Everything, the save included (filled in after the save)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (`stats` flattened into the top level, as in earlier files)."""
        tree = dataclasses.asdict(self)
        tree.update(tree.pop("stats"))
        return tree

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> SFTInfo:
        """Read `to_dict`'s form back."""
        tree = dict(tree)
        history = [SFTStepRecord(**record) for record in tree.pop("history")]
        stats = SFTTrainStats(
            loss_before=tree.pop("loss_before"),
            loss_after=tree.pop("loss_after"),
            steps=tree.pop("steps"),
            shared_prefix_tokens=tree.pop("shared_prefix_tokens"),
            history=history,
        )
        return cls(stats=stats, **tree)


@dataclass(frozen=True)
class SFTResult:
    """What `run_sft` produced."""

    checkpoint: Path
    """The HF checkpoint folder."""
    trained: bool
    """False when an up-to-date checkpoint was already there."""
    info: SFTInfo
    """What `sft_info.json` records (config hash, losses, timings)."""


# ------------------------------------------------------------------------ demonstrations
def demonstration_seed(seed: int, index: int) -> int:
    """Reset seed of demonstration `index`."""
    return zlib.crc32(f"tir_rl/sft/{seed}/{index}".encode()) & 0x7FFFFFFF


def play_demonstration(
    env: ToolEnv,
    tokenizer: Tokenizer,
    *,
    seed: int,
    chat_config: ChatFormat.Config | None = None,
) -> Demonstration:
    """Reset `env`, play its oracle's turns through `step`, render like a rollout.

    Args:
        env: The environment, with a `demonstration` oracle.
        tokenizer: The model's tokenizer.
        seed: Reset seed of the task.
        chat_config: The chat format (default: `auto`, as a run's default `chat` section).

    Raises:
        TirError: The oracle's episode did not end with full reward (a broken oracle).
        ChatFormatError: The tokenizer cannot carry the configured chat format.
    """
    demo = play_turns(env, tokenizer, env.demonstration, seed=seed, chat_config=chat_config)
    if demo.reward < 1.0:
        raise TirError(
            f"{demo.task_id}: the oracle's episode got reward {demo.reward}; "
            f"{type(env).__name__}.demonstration must solve its task"
        )
    return demo


def play_turns(
    env: ToolEnv,
    tokenizer: Tokenizer,
    turns_for: Callable[[Task], list[Message]],
    *,
    seed: int,
    chat_config: ChatFormat.Config | None = None,
) -> Demonstration:
    """Reset `env`, play the assistant turns `turns_for(task)` through `step`, render them.

    The turns need not solve the task (a deliberately flawed demonstrator); the episode's
    reward is recorded in `Demonstration.reward`.

    Raises:
        TirError: The episode ended before the last turn, or did not end after it.
        ChatFormatError: The tokenizer cannot carry the configured chat format.
    """
    from tir_rl.envs.episode import ResetInfo

    messages, reset_info = env.reset(seed=seed)
    info = ResetInfo.from_info(reset_info)
    fmt = ChatFormat(tokenizer, tool_schemas=info.tool_schemas, config=chat_config)
    conv = fmt.conversation(messages)
    turns = turns_for(info.task)
    reward, terminated = 0.0, False
    for k, turn in enumerate(turns):
        ids = fmt.encode_assistant_text(fmt.assistant_text(turn)) + [fmt.end_of_turn_id]
        conv.append_sampled(ids, [0.0] * len(ids))
        replies, step_reward, terminated, truncated, _ = env.step(conv.messages[-1])
        reward += float(step_reward)
        if terminated or truncated:
            if k != len(turns) - 1:
                raise TirError(f"{info.task_id}: the episode ended after turn {k + 1}")
            break
        conv.append_messages(replies)
    if not terminated:
        raise TirError(f"{info.task_id}: the episode did not end after its {len(turns)} turns")
    trajectory = conv.to_trajectory(reward=reward)
    return Demonstration(
        token_ids=trajectory.prompt_ids + trajectory.completion_ids,
        loss_mask=[0] * len(trajectory.prompt_ids) + trajectory.loss_mask,
        task_id=info.task_id,
        reward=reward,
    )


def build_demonstrations(config: SFTConfig, tokenizer: Tokenizer) -> list[Demonstration]:
    """The config's demonstrations, from the train split of the real environment."""
    from tir_rl.envs.resolve import env_maker

    build = env_maker(config.env.id)  # a registered id, `module:Name-v0` or `module:Class`
    horizons = config.env.horizons or [None]
    envs: dict[int | None, ToolEnv] = {}
    demos = []
    try:
        for i in range(config.data.num_demos):
            horizon = horizons[i % len(horizons)]
            if horizon not in envs:
                extra = {} if horizon is None else {"horizon": horizon}
                kwargs = {**config.env.kwargs, **extra, "split": "train"}
                envs[horizon] = build(**kwargs).unwrapped
            seed = demonstration_seed(config.data.seed, i)
            demos.append(
                play_demonstration(envs[horizon], tokenizer, seed=seed, chat_config=config.chat)
            )
    except NotImplementedError as exc:
        raise ConfigError(f"{config.env.id} has no demonstration oracle: {exc}") from exc
    finally:
        for env in envs.values():
            env.close()
    return demos


def shared_prefix_length(demos: Sequence[Demonstration]) -> int:
    """Tokens every demonstration starts with that no loss position depends on.

    The logit predicting token t comes from position t - 1, so the prefix stops one token
    before the first loss token of any demonstration.
    """
    first = demos[0].token_ids
    length = len(first)
    for demo in demos[1:]:
        n = min(length, len(demo.token_ids))
        length = next((i for i in range(n) if demo.token_ids[i] != first[i]), n)
    first_loss = min(d.loss_mask.index(1) for d in demos if 1 in d.loss_mask)
    return max(0, min(length, first_loss - 1))


def plan_batches(
    demos: Sequence[Demonstration], batch_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Shuffled demonstration indices, cut into steps of about `batch_tokens` loss tokens."""
    order = list(range(len(demos)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        current.append(i)
        tokens += demos[i].num_loss_tokens
        if tokens >= batch_tokens:
            batches.append(current)
            current, tokens = [], 0
    if current:
        batches.append(current)
    return batches


# ------------------------------------------------------------------------------ training
class _PrefixCache:
    """Keys and values of the shared prefix under the current weights (no gradient)."""

    def __init__(self, model: PreTrainedModel, prefix: list[int]) -> None:
        self.model = model
        self.prefix = prefix
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def refresh(self) -> None:
        import torch

        if not self.prefix:
            return
        with torch.no_grad():
            out = self.model.get_decoder()(input_ids=torch.tensor([self.prefix]), use_cache=True)
        self._kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]

    def fresh(self) -> DynamicCache | None:
        """A new cache holding the prefix (the forward pass appends to it)."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=self._kv) if self.prefix else None


def sequence_loss(
    model: PreTrainedModel, demo: Demonstration, cache: _PrefixCache
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the mask-1 tokens of `demo`, and their count."""
    import torch

    start = len(cache.prefix)
    ids = torch.tensor([demo.token_ids[start:]])
    positions = torch.arange(start, len(demo.token_ids)).unsqueeze(0)
    hidden = model.get_decoder()(
        input_ids=ids,
        position_ids=positions,
        past_key_values=cache.fresh(),
        use_cache=start > 0,
    ).last_hidden_state[0]
    mask = torch.tensor(demo.loss_mask[start + 1 :], dtype=torch.bool)
    targets = torch.tensor(demo.token_ids[start + 1 :])[mask]
    logits = model.get_output_embeddings()(hidden[:-1][mask]).float()
    loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return loss, int(mask.sum())


def mean_loss(model: PreTrainedModel, demos: Sequence[Demonstration], cache: _PrefixCache) -> float:
    """Token-mean loss over `demos` (no gradient)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        cache.refresh()
        for demo in demos:
            loss, n = sequence_loss(model, demo, cache)
            total, count = total + float(loss), count + n
    return total / max(count, 1)


def sft_lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The lr multiplier at SFT optimizer step `step`.

    The trainer's cosine schedule (`tir_rl.trainer.lr_schedule`): `warmup_steps` of linear
    warm-up, then decay to 0 at `total_steps` (right after the warm-up when the run is no
    longer than it).
    """
    return lr_factor(
        step,
        LRSchedule.COSINE,
        warmup_steps=warmup_steps,
        schedule_steps=max(total_steps, warmup_steps + 1),
    )


def train_on_demonstrations(
    model: PreTrainedModel, demos: Sequence[Demonstration], config: SFTTrainSection
) -> SFTTrainStats:
    """Fine-tune `model` in place; return loss history and counts."""
    import torch

    seed_everything(config.seed)
    rng = random.Random(config.seed)
    prefix = demos[0].token_ids[: shared_prefix_length(demos)] if config.cache_shared_prefix else []
    cache = _PrefixCache(model, prefix)
    probe = list(demos[: config.loss_probe_demos])
    loss_before = mean_loss(model, probe, cache) if probe else None

    epochs = [plan_batches(demos, config.batch_tokens, rng) for _ in range(config.epochs)]
    total_steps = sum(len(e) for e in epochs)
    optimizer = build_adamw(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: sft_lr_factor(s, warmup_steps=config.warmup_steps, total_steps=total_steps),
    )
    model.train()
    history: list[SFTStepRecord] = []
    step = 0
    for epoch, batches in enumerate(epochs):
        for batch in batches:
            t0 = time.perf_counter()
            cache.refresh()
            num_tokens = sum(demos[i].num_loss_tokens for i in batch)
            step_loss = 0.0
            for i in batch:
                loss, _ = sequence_loss(model, demos[i], cache)
                (loss / num_tokens).backward()
                step_loss += loss.item()
            norm = grad_norm(model.parameters())
            clip_gradients(model.parameters(), config.max_grad_norm, norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            record = SFTStepRecord(
                step=step,
                epoch=epoch,
                loss=step_loss / num_tokens,
                grad_norm=norm,
                sequences=len(batch),
                seconds=time.perf_counter() - t0,
            )
            history.append(record)
            logger.info(
                "sft step %d/%d (epoch %d): loss %.4f, grad norm %.2f, %d seqs, %.1f s",
                step + 1,
                total_steps,
                epoch,
                record.loss,
                norm,
                len(batch),
                record.seconds,
            )
            step += 1
    model.eval()
    loss_after = mean_loss(model, probe, cache) if probe else None
    return SFTTrainStats(
        loss_before=loss_before,
        loss_after=loss_after,
        steps=total_steps,
        shared_prefix_tokens=len(prefix),
        history=history,
    )


# ----------------------------------------------------------------------------- pipeline
def load_info(folder: Path) -> SFTInfo | None:
    """The `sft_info.json` of a finished checkpoint folder, or None."""
    path = Path(folder) / INFO_FILE
    if not path.is_file():
        return None
    return SFTInfo.from_dict(json.loads(path.read_text()))


def run_sft(config: SFTConfig, *, force: bool = False) -> SFTResult:
    """Build demonstrations, fine-tune, save the checkpoint; skip if already done.

    Args:
        config: the SFT config.
        force: retrain and replace a checkpoint made from another config.

    Raises:
        ConfigError: `output_dir` holds something else than a checkpoint of this config
            (and `force` is False).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tir_rl.models import resolve_model

    config.validate()
    out = Path(config.output_dir)
    digest = config.config_hash()
    info = load_info(out)
    if info is not None and info.config_hash == digest and not force:
        return SFTResult(out, trained=False, info=info)
    if out.exists() and not force:
        found = "a checkpoint of another config" if info is not None else "other files"
        raise ConfigError(
            f"{out} holds {found}; choose another output_dir (--set output_dir=...) or pass "
            "--force to replace it"
        )

    started = time.perf_counter()
    if config.train.threads is not None:
        torch.set_num_threads(config.train.threads)
    base = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    demos = build_demonstrations(config, tokenizer)
    built = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    stats = train_on_demonstrations(model, demos, config.train)
    trained = time.perf_counter()

    info = SFTInfo(
        config_hash=digest,
        config=to_dict(config),
        base_model=str(base),
        num_demos=len(demos),
        demo_tokens=sum(len(d.token_ids) for d in demos),
        loss_tokens=sum(d.num_loss_tokens for d in demos),
        stats=stats,
        seconds_demos=built - started,
        seconds_train=trained - built,
    )
    _save_atomically(out, model, tokenizer, info)
    info = dataclasses.replace(info, seconds_total=time.perf_counter() - started)
    (out / INFO_FILE).write_text(json.dumps(info.to_dict(), indent=2) + "\n")
    return SFTResult(out, trained=True, info=info)


def _save_atomically(
    out: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, info: SFTInfo
) -> None:
    """Write into a hidden sibling folder and rename it, so no half checkpoint is left.

    The same steps as a training checkpoint (`tir_rl.trainer.checkpoint`): a Hugging Face model
    folder with the tokenizer, written into `temp_folder_for(out)`, then put in place.
    """
    tmp = checkpoint.temp_folder_for(out)
    checkpoint.save_hf_model(tmp, model, tokenizer)
    (tmp / INFO_FILE).write_text(json.dumps(info.to_dict(), indent=2) + "\n")
    checkpoint.put_in_place(tmp, out)


__all__ = [
    "Demonstration",
    "SFTConfig",
    "SFTDataSection",
    "SFTEnvSection",
    "SFTInfo",
    "SFTResult",
    "SFTStepRecord",
    "SFTTrainStats",
    "SFTTrainSection",
    "build_demonstrations",
    "load_sft_config",
    "play_demonstration",
    "play_turns",
    "run_sft",
    "train_on_demonstrations",
]
