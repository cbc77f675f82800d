"""tir_rl/Dataset-v0 episodes on the real engine (vLLM CPU, tiny random Llama)."""

import pytest

from tir_rl.config import load
from tir_rl.envs.dataset import DatasetEnv
from tir_rl.run_config import RunConfig
from tir_rl.runtime import env_factory, open_runtime, task_specs

pytestmark = pytest.mark.vllm


def test_dataset_episodes_run_on_the_real_engine_from_a_run_config():
    config = load(
        RunConfig,
        None,
        [
            "model=tiny",
            "env.id=tir_rl/Dataset-v0",
            "env.kwargs={tools: [], max_nudges: 0}",
            "rollout.max_turns=1",
            "rollout.max_tokens_per_turn=12",
            "engine.local.max_model_len=2048",
            "engine.local.kv_cache_gib=0.25",
        ],
    )
    factory = env_factory(config.env, config.env.eval_split)
    with open_runtime(config) as runtime:
        trajectories = runtime.run_episodes(task_specs(factory, num_tasks=2, group_size=2))
        tokenizer = runtime.tokenizer
    test_rows = DatasetEnv(split="test").pool
    assert len(trajectories) == 4
    for i, traj in enumerate(trajectories):
        assert not traj.status.is_error, traj.error
        assert traj.num_model_tokens > 0 and traj.reward in (0.0, 1.0)
        prompt = tokenizer.decode(traj.prompt_ids)
        assert test_rows[i // 2].question in prompt  # task i is test row i, in file order
        assert "<tools>" not in prompt  # tools: [] offers none
