"""The lab model plays MultiHop from its written weights alone (transformers, greedy)."""

from __future__ import annotations

import gymnasium
import pytest
import torch

import tir_rl.envs  # noqa: F401 (registers tir_rl/MultiHop-v0)
from tir_rl.chat import ChatFormat
from tir_rl.envs.episode import ResetInfo
from tir_rl.errors import ConfigError
from tir_rl.lab.model import BUILD_STAGES, LabModelSpec, build_lab_model
from tir_rl.models import prepare_bundled_model


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_bundled_model())


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_lab_model(tokenizer, LabModelSpec())


def play_greedy(model, tokenizer, *, horizon: int, seed: int, max_turns: int = 12) -> float:
    """Reward of one greedy episode on the test split, through the real chat format."""
    env = gymnasium.make("tir_rl/MultiHop-v0", horizon=horizon, split="test").unwrapped
    messages, info = env.reset(seed=seed)
    chat = ChatFormat(tokenizer, tool_schemas=ResetInfo.from_info(info).tool_schemas)
    conversation = chat.conversation(messages)
    reward = 0.0
    for _ in range(max_turns):
        sampled: list[int] = []
        inputs, cache = torch.tensor([conversation.token_ids]), None
        with torch.no_grad():
            for _ in range(64):
                out = model(input_ids=inputs, past_key_values=cache, use_cache=True)
                next_id = int(out.logits[0, -1].argmax())
                sampled.append(next_id)
                if next_id == chat.end_of_turn_id:
                    break
                inputs, cache = torch.tensor([[next_id]]), out.past_key_values
        conversation.append_sampled(sampled, [0.0] * len(sampled))
        replies, step_reward, terminated, truncated, _ = env.step(conversation.messages[-1])
        reward += float(step_reward)
        if terminated or truncated:
            break
        conversation.append_messages(replies)
    env.close()
    return reward


@pytest.mark.parametrize(("horizon", "seed"), [(1, 0), (4, 1)])
def test_the_written_policy_solves_multihop_greedily(model, tokenizer, horizon, seed):
    assert play_greedy(model, tokenizer, horizon=horizon, seed=seed) == 1.0


def test_without_the_entity_head_the_policy_fails(tokenizer):
    broken = build_lab_model(tokenizer, LabModelSpec())
    with torch.no_grad():  # layer 2 head 0 fetches the entity a call names
        broken.model.layers[2].self_attn.o_proj.weight[:, :128] = 0.0
    assert play_greedy(broken, tokenizer, horizon=1, seed=0) == 0.0


def test_the_logit_scale_is_the_final_norm_and_only_scales_logits(model, tokenizer):
    sharper = build_lab_model(tokenizer, LabModelSpec(logit_scale=0.86))
    ids = torch.tensor([tokenizer.encode("<|im_start|>assistant\n<tool_call>\n")])
    with torch.no_grad():
        base, doubled = model(input_ids=ids).logits, sharper(input_ids=ids).logits
    assert torch.allclose(doubled, 2 * base, rtol=1e-4, atol=1e-3)


def test_the_same_seed_builds_the_same_weights_and_another_seed_does_not(model, tokenizer):
    stages = []
    again = build_lab_model(tokenizer, LabModelSpec(), on_stage=stages.append)
    assert tuple(stages) == BUILD_STAGES  # what the progress bar of `models prepare lab` shows
    other = build_lab_model(tokenizer, LabModelSpec(seed=1))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"logit_scale": 0.0}, "logit_scale"), ({"output_gain": 9.0}, "output_gain")],
)
def test_bad_specs_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        LabModelSpec(**changes).validate()
