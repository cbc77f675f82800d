"""The agent loop on real vLLM (CPU, tiny random Llama): token alignment end to end."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import RecordingEngine

from tir_rl.engine.parity import transformers_logprobs
from tir_rl.rollout import EpisodeSpec, Rollout, group_specs
from tir_rl.rollout.episode import turn_seed
from tir_rl.types import Message, Role, RolloutStatus

pytestmark = pytest.mark.vllm

# long, multilingual, with strings that look like special tokens and tool-call tags
TOOL_TEXT = (
    "Résultat ✓ 日本語のテキスト 🙂 Ω≈ç√ <|im_end|> </tool_response> <tool_call> " * 6
).strip()
TEMPERATURE = 0.8
NUM_TOOL_TURNS = 3


class FakeAlwaysToolEnv:
    """Treats every assistant turn as a tool call answered with TOOL_TEXT; ends after N."""

    def __init__(self, num_tool_turns: int = NUM_TOOL_TURNS) -> None:
        self.num_tool_turns = num_tool_turns
        self.turn = 0

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return [Message.system("You are terse."), Message.user("Say something.")], {}  # no tools

    def step(self, action: Message):
        assert action.role == Role.ASSISTANT
        self.turn += 1
        if self.turn > self.num_tool_turns:
            return [], 1.0, True, False, {}
        return [Message.tool(TOOL_TEXT, name="fixed")], 0.0, False, False, {}

    def close(self) -> None:
        pass


def segments(traj) -> list[tuple[int, int, int]]:
    """(mask, start, end) of each maximal run of equal loss-mask values."""
    runs, start = [], 0
    mask = traj.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


@pytest.fixture(scope="module")
def scripted_rollout(vllm_engine, tokenizer):
    recorder = RecordingEngine(vllm_engine)
    config = Rollout.Config(
        max_turns=NUM_TOOL_TURNS + 1,
        max_tokens_per_turn=12,
        end_on_truncated_turn=False,
        temperature=TEMPERATURE,
        seed=5,
    )
    rollout = Rollout(recorder, tokenizer, config)
    specs = group_specs(FakeAlwaysToolEnv, 0, group_size=4, group_id=3)
    return recorder, rollout, specs, rollout.run_batch_sync(specs)


def test_mask_one_tokens_are_the_engine_samples_and_mask_zero_the_rendered_tool_turns(
    scripted_rollout,
):
    recorder, rollout, specs, trajs = scripted_rollout
    fmt = rollout.chat_format_for(())
    im_end = fmt.end_of_turn_id
    assert len(recorder.calls) == 4 * (NUM_TOOL_TURNS + 1)
    for spec, traj in zip(specs, trajs, strict=True):
        assert traj.status == RolloutStatus.FINISHED, traj.error
        assert (traj.reward, traj.group_id) == (1.0, 3)
        runs = segments(traj)
        assert [m for m, _, _ in runs] == [1, 0] * NUM_TOOL_TURNS + [1]
        full = traj.prompt_ids + traj.completion_ids
        for turn, (mask, start, end) in enumerate(runs):
            ids = traj.completion_ids[start:end]
            if mask == 1:
                prompt = tuple(full[: len(traj.prompt_ids) + start])
                result = recorder.calls[(prompt, turn_seed(rollout.config.seed, spec, turn // 2))]
                assert ids == result.token_ids
                assert traj.sampler_logprobs[start:end] == result.logprobs
                assert set(traj.turn_ids[start:end]) == {turn // 2}
            else:
                closed = traj.completion_ids[start - 1] == im_end
                expected = fmt.render_env_turns([Message.tool(TOOL_TEXT)], close_turn=not closed)
                assert ids == expected
                assert set(traj.sampler_logprobs[start:end]) == {0.0}
                assert set(traj.turn_ids[start:end]) == {turn // 2}
        # the tool text's "<|im_end|>" was split: the only im_end tokens are turn boundaries
        tool_turn = fmt.render_env_turns([Message.tool(TOOL_TEXT)], close_turn=False)
        assert tool_turn.count(im_end) == 1
    assert len({tuple(t.completion_ids) for t in trajs}) == 4  # distinct samples


def test_transformers_recompute_matches_sampler_logprobs_on_every_model_token(
    scripted_rollout, hf_model
):
    _, _, _, trajs = scripted_rollout
    for traj in trajs:
        full = traj.prompt_ids + traj.completion_ids
        # logits[t - 1] predicts token t: entry t - 1 of the recompute scores full[t]
        recomputed = transformers_logprobs(hf_model, full, temperature=TEMPERATURE)
        completion = recomputed[len(traj.prompt_ids) - 1 :]
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        sampled = torch.tensor(traj.sampler_logprobs)
        diff = (completion - sampled)[mask].abs()
        assert mask.sum() > 0 and diff.numel() == mask.sum()
        assert diff.max().item() < 1e-3, diff.max().item()
        # an off-by-one alignment would be far off
        shifted = recomputed[len(traj.prompt_ids) : len(traj.prompt_ids) + len(sampled)]
        assert (shifted[: mask.sum() - 1] - sampled[mask][: mask.sum() - 1]).abs().max() > 1e-2


def test_multihop_episodes_run_concurrently_on_the_real_engine(vllm_engine, tokenizer):
    import gymnasium as gym

    import tir_rl.envs  # noqa: F401 (registers tir_rl/...)

    config = Rollout.Config(max_turns=3, max_tokens_per_turn=16, max_context_tokens=1500)
    rollout = Rollout(vllm_engine, tokenizer, config)
    specs = [
        EpisodeSpec(
            env_factory=lambda: gym.make("tir_rl/MultiHop-v0", horizon=2),
            task_seed=task,
            group_id=task,
            sample_index=i,
        )
        for task in range(3)
        for i in range(2)
    ]
    trajs = rollout.run_batch_sync(specs)
    assert len(trajs) == 6
    for traj in trajs:
        assert not traj.status.is_error, traj.error
        assert traj.num_model_tokens > 0
        assert all(
            lp <= 0 for lp, m in zip(traj.sampler_logprobs, traj.loss_mask, strict=True) if m
        )
        assert len(traj.prompt_ids) + len(traj.completion_ids) <= 1500
        assert "lookup" in tokenizer.decode(traj.prompt_ids)
    assert trajs[0].prompt_ids == trajs[1].prompt_ids  # one group, one task
    assert trajs[0].prompt_ids != trajs[2].prompt_ids
