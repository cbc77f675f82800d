"""SFT warm start: the MultiHop oracle, rollout-identical rendering, and a tiny training run."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tir_rl.chat import ChatFormat, assistant_message, parse_assistant_text
from tir_rl.cli import main
from tir_rl.engine.base import FinishReason, GenerateRequest, GenerateResult, ModelInfo
from tir_rl.envs.base import ToolEnv
from tir_rl.envs.multihop import MultiHopEnv
from tir_rl.errors import ConfigError, TirError
from tir_rl.lab.sft import (
    INFO_FILE,
    Demonstration,
    SFTInfo,
    SFTStepRecord,
    SFTTrainSection,
    SFTTrainStats,
    _PrefixCache,
    build_demonstrations,
    load_sft_config,
    mean_loss,
    plan_batches,
    play_demonstration,
    play_turns,
    run_sft,
    sft_lr_factor,
    shared_prefix_length,
)
from tir_rl.models import prepare_bundled_model, prepare_tiny_model
from tir_rl.rollout import EpisodeSpec, Rollout
from tir_rl.types import Message, RolloutStatus

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "sft" / "multihop.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_bundled_model())


# ----------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("horizon", [1, 2, 3, 4, 7])
def test_multihop_oracle_turns_parse_and_earn_full_reward(tokenizer, horizon):
    env = MultiHopEnv(horizon=horizon, split="train")
    for seed in range(3):
        messages, info = env.reset(seed=seed)
        turns = env.demonstration(info["task"])
        assert len(turns) == horizon + 1
        for k, turn in enumerate(turns):
            text = ChatFormat(tokenizer).assistant_text(turn)  # what the model is taught to write
            parsed = parse_assistant_text(text)  # what the rollout's chat parser reads
            assert not parsed.errors
            action = assistant_message(text)
            replies, reward, terminated, truncated, step = env.step(action)
            if k < horizon:
                assert [c.name for c in parsed.tool_calls] == ["lookup"]
                assert step["tool_results"][0].ok, replies[0].content
                assert (reward, terminated) == (0.0, False)
            else:
                assert parsed.tool_calls == ()
                assert (reward, terminated, truncated) == (1.0, True, False)
        assert env.progress(info["task"]) == horizon


def test_another_tasks_demonstration_scores_zero():
    env = MultiHopEnv(horizon=3)
    _, info_a = env.reset(seed=1)
    answer_a = env.demonstration(info_a["task"])[-1]
    _, info_b = env.reset(seed=2)
    assert info_a["task"].answer != info_b["task"].answer
    assert env.step(answer_a)[1] == 0.0


def test_tool_env_has_no_oracle_by_default():
    with pytest.raises(NotImplementedError, match="no demonstration oracle"):
        ToolEnv.demonstration(MultiHopEnv(), None)


# --------------------------------------------------------- rendering equals the rollout's
class FakeOracleEngine:
    """Replies to turn k with the oracle's k-th text, tokenized as a model would write it."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.model_info = ModelInfo(
            model_path="fake",
            dtype="float32",
            max_model_len=4096,
            logprobs_mode="processed_logprobs",
        )

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await asyncio.sleep(0)
        turn = self.tokenizer.decode(request.prompt_token_ids).count("<|im_start|>assistant") - 1
        ids = self.tokenizer(self.texts[turn], add_special_tokens=False)["input_ids"]
        ids = [*ids, self.im_end]
        return GenerateResult(
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            policy_versions=[0] * len(ids),
            finish_reason=FinishReason.STOP,
        )


@pytest.mark.parametrize(("horizon", "seed"), [(1, 0), (3, 5), (4, 11)])
def test_sft_rendering_equals_what_the_rollout_builds(tokenizer, horizon, seed):
    demo = play_demonstration(MultiHopEnv(horizon=horizon), tokenizer, seed=seed)
    env = MultiHopEnv(horizon=horizon)
    _, info = env.reset(seed=seed)
    texts = [ChatFormat(tokenizer).assistant_text(m) for m in env.demonstration(info["task"])]
    engine = FakeOracleEngine(tokenizer, texts)
    rollout = Rollout(engine, tokenizer, Rollout.Config(max_turns=horizon + 2))
    spec = EpisodeSpec(env_factory=lambda: MultiHopEnv(horizon=horizon), task_seed=seed)
    (traj,) = rollout.run_batch_sync([spec])
    assert traj.status == RolloutStatus.FINISHED, traj.error
    assert traj.reward == 1.0 == demo.reward
    assert demo.token_ids == traj.prompt_ids + traj.completion_ids
    assert demo.loss_mask == [0] * len(traj.prompt_ids) + traj.loss_mask
    assert demo.num_loss_tokens == sum(traj.loss_mask) > 0


def _answer_after_one_hop(env: MultiHopEnv):
    def turns(task):  # one lookup, then the entity it led to: a wrong answer
        answer = Message.assistant(f"<answer>{task.data['path'][1]}</answer>")
        return [*env.demonstration(task)[:1], answer]

    return turns


class _EarlyAnsweringMultiHop(MultiHopEnv):
    def demonstration(self, task):
        return _answer_after_one_hop(MultiHopEnv(horizon=3))(task)


def test_a_flawed_demonstrator_is_played_and_its_reward_recorded(tokenizer):
    env = MultiHopEnv(horizon=3)
    demo = play_turns(env, tokenizer, _answer_after_one_hop(env), seed=4)
    oracle = play_demonstration(MultiHopEnv(horizon=3), tokenizer, seed=4)
    assert demo.reward == 0.0 and oracle.reward == 1.0
    assert demo.task_id == oracle.task_id
    assert 0 < demo.num_loss_tokens < oracle.num_loss_tokens
    with pytest.raises(TirError, match="oracle's episode got reward 0.0"):
        play_demonstration(_EarlyAnsweringMultiHop(horizon=3), tokenizer, seed=4)


def test_turns_that_stop_before_the_episode_ends_are_refused(tokenizer):
    env = MultiHopEnv(horizon=3)
    with pytest.raises(TirError, match="did not end after its 2 turns"):
        play_turns(env, tokenizer, lambda task: env.demonstration(task)[:2], seed=4)


def test_demonstrations_mix_horizons_from_the_train_split(tokenizer):
    config = load_sft_config(CONFIG, ["data.num_demos=8", "env.horizons=[1, 3]", "model=tiny"])
    demos = build_demonstrations(config, tokenizer)
    assert [d.task_id.split("/")[1:3] for d in demos[:2]] == [["train", "h1"], ["train", "h3"]]
    assert all(d.reward == 1.0 for d in demos)
    assert len({d.task_id for d in demos}) == 8


# ------------------------------------------------------------------------ batching logic
def _demo(ids: list[int], mask: list[int]) -> Demonstration:
    return Demonstration(token_ids=ids, loss_mask=mask, task_id="t", reward=1.0)


def test_shared_prefix_stops_before_the_first_loss_token():
    a = _demo([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 1])
    b = _demo([1, 2, 3, 9, 5, 6], [0, 0, 0, 0, 1, 1])
    assert shared_prefix_length([a, b]) == 3
    assert shared_prefix_length([a, a]) == 3  # token 4 predicts the first loss token
    c = _demo([1, 2, 3, 4, 5, 6], [0, 1, 1, 1, 1, 1])
    assert shared_prefix_length([a, c]) == 0


def test_batches_cover_every_demo_once_with_the_token_budget():
    import random

    demos = [_demo([0] * 5, [0, 0, 1, 1, 1]) for _ in range(10)]
    batches = plan_batches(demos, batch_tokens=7, rng=random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert [len(b) for b in batches] == [3, 3, 3, 1]


def test_config_hash_ignores_output_dir_and_sees_training_fields():
    base = load_sft_config(CONFIG)
    moved = load_sft_config(CONFIG, ["output_dir=/elsewhere"])
    changed = load_sft_config(CONFIG, ["train.lr=3e-4"])
    assert base.config_hash() == moved.config_hash() != changed.config_hash()
    with pytest.raises(ConfigError, match="split"):
        load_sft_config(CONFIG, ["env.kwargs={split: test}"])


def test_demonstrations_render_in_the_configured_chat_format():
    from chat_tokenizers import llama3_tokenizer

    from tir_rl.chat import ChatFormatName

    tokenizer = llama3_tokenizer()
    chat = ChatFormat.Config(format=ChatFormatName.LLAMA3)
    # the oracle's calls are written as Llama 3 JSON and read back by the env: full reward
    demo = play_demonstration(MultiHopEnv(horizon=2), tokenizer, seed=3, chat_config=chat)
    assert demo.reward == 1.0
    text = tokenizer.decode(demo.token_ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert '<|end_header_id|>\n\n{"name": "lookup", "parameters": {' in text
    assert "<|start_header_id|>ipython<|end_header_id|>" in text
    overrides = ["data.num_demos=1", "chat.tool_instructions=TOOLS {tools}", "model=tiny"]
    (built,) = build_demonstrations(load_sft_config(CONFIG, overrides), tokenizer)
    assert "\n\nTOOLS {" in tokenizer.decode(built.token_ids)  # the config's chat section
    base = load_sft_config(CONFIG)
    assert base.config_hash() == load_sft_config(CONFIG, ["chat.format=auto"]).config_hash()
    assert base.config_hash() != load_sft_config(CONFIG, ["chat.format=llama3"]).config_hash()


# --------------------------------------------------------------------- a tiny real run
def test_prefix_cached_loss_equals_the_full_forward_loss(tokenizer):
    config = load_sft_config(CONFIG, ["data.num_demos=3", "model=tiny"])
    demos = build_demonstrations(config, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(prepare_tiny_model(), dtype=torch.float32)
    prefix = demos[0].token_ids[: shared_prefix_length(demos)]
    assert len(prefix) > 100  # the system turn
    cached = mean_loss(model, demos, _PrefixCache(model, prefix))
    full = mean_loss(model, demos, _PrefixCache(model, []))
    assert cached == pytest.approx(full, rel=1e-5)


def test_sft_on_the_tiny_model_lowers_the_loss_and_saves_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "sft"
    overrides = [
        "model=tiny",
        f"output_dir={out}",
        "data.num_demos=6",
        "env.horizons=[1, 2]",
        "train.epochs=1",
        "train.lr=3e-3",
        "train.batch_tokens=1",
        "train.loss_probe_demos=6",
    ]
    # -v: the routing of library output (tir_rl/console.py) is for a process running one
    # command; in this test process it would stay in place for the tests after this one.
    args = ["-v", "sft", "--config", str(CONFIG)] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 0
    assert f"checkpoint: {out}" in capsys.readouterr().out
    info = json.loads((out / INFO_FILE).read_text())
    assert info["steps"] == 6 and len(info["history"]) == 6
    assert info["loss_after"] < info["loss_before"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("<|im_start|>assistant\n", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(input_ids=ids).logits).all()
    base = AutoModelForCausalLM.from_pretrained(prepare_tiny_model())
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)

    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0  # same config: nothing to do
    assert "up to date" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == before

    other = load_sft_config(CONFIG, [*overrides, "train.lr=1e-3"])
    with pytest.raises(ConfigError, match="--force"):
        run_sft(other)


def test_train_section_rejects_bad_values():
    with pytest.raises(ConfigError, match="epochs"):
        SFTTrainSection(epochs=0).validate()


def test_sft_info_reads_back_what_it_writes():
    stats = SFTTrainStats(
        loss_before=0.8,
        loss_after=0.1,
        steps=2,
        shared_prefix_tokens=445,
        history=[
            SFTStepRecord(step=k, epoch=0, loss=0.5, grad_norm=1.0, sequences=4, seconds=2.0)
            for k in range(2)
        ],
    )
    info = SFTInfo(
        config_hash="abc",
        config={"model": "tiny"},
        base_model="/m",
        num_demos=8,
        demo_tokens=5000,
        loss_tokens=700,
        stats=stats,
        seconds_demos=1.0,
        seconds_train=9.0,
        seconds_total=11.0,
    )
    tree = json.loads(json.dumps(info.to_dict()))
    assert tree["steps"] == 2 and tree["loss_before"] == 0.8 and len(tree["history"]) == 2
    assert SFTInfo.from_dict(tree) == info


def _cosine_with_warmup(step: int, warmup_steps: int, total_steps: int) -> float:
    """SFT's schedule as lab/sft.py wrote it before it called the trainer's `lr_factor`."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    span = max(total_steps - warmup_steps, 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / span))


@pytest.mark.parametrize(
    ("warmup_steps", "total_steps"), [(0, 1), (0, 10), (2, 10), (3, 3), (5, 2), (2, 0), (4, 5)]
)
def test_sft_lr_schedule_is_the_trainers_cosine_with_warmup(warmup_steps, total_steps):
    for step in range(total_steps + 1):  # LambdaLR also asks for the step after the last
        assert sft_lr_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps
        ) == pytest.approx(_cosine_with_warmup(step, warmup_steps, total_steps), abs=1e-12)
