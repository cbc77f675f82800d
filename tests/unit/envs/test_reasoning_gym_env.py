"""The reasoning-gym adapter, on a fake dataset with reasoning-gym's interface."""

import gymnasium as gym
import pytest

import tir_rl.envs  # noqa: F401 (registers the ids)
from tir_rl.envs import check_env
from tir_rl.envs.base import Split
from tir_rl.envs.reasoning_gym import ReasoningGymEnv, split_of_question
from tir_rl.types import Message


class FakeReasoningGymDataset:
    """Indexable entries with a scorer, like reasoning_gym.dataset.ProceduralDataset."""

    def __init__(self, size: int = 500) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        a, b = idx % 97, idx // 97
        return {"question": f"What is {a} + {b}?", "answer": str(a + b), "metadata": {}}

    def score_answer(self, answer, entry) -> float:
        if answer is None:
            return 0.0
        if answer == "crash":
            raise ValueError("invalid literal for int() with base 10: 'crash'")
        return 1.0 if answer.strip() == entry["answer"] else 0.01


def test_single_turn_episode_uses_the_dataset_scorer():
    env = ReasoningGymEnv(dataset=FakeReasoningGymDataset())
    messages, info = env.reset(seed=0)
    assert info.tool_schemas == []
    entry = info.task.data["entry"]
    assert messages[-1].content == entry["question"]
    _, reward, terminated, _, _ = env.step(Message.assistant(f"<answer>{entry['answer']}</answer>"))
    assert terminated and reward == 1.0
    env.reset(seed=0)
    _, reward, terminated, _, _ = env.step(Message.assistant("<answer>-1</answer>"))
    assert terminated and reward == pytest.approx(0.01)  # partial credit passes through
    env.reset(seed=0)
    _, reward, terminated, _, _ = env.step(Message.assistant("<answer>crash</answer>"))
    assert terminated and reward == 0.0  # a scorer that raises on a bad answer scores 0


def test_splits_never_share_a_question():
    dataset = FakeReasoningGymDataset()
    questions = {}
    for split in Split:
        env = ReasoningGymEnv(split=split, dataset=dataset)
        questions[split] = {env.generate_task(i).question for i in range(400)}
        assert all(split_of_question(q) == split for q in questions[split])
    assert not questions[Split.TRAIN] & questions[Split.TEST]


def test_adapter_passes_check_env():
    check_env(ReasoningGymEnv(dataset=FakeReasoningGymDataset()))


def test_registered_id_with_the_real_package_if_installed():
    pytest.importorskip("reasoning_gym")
    env = gym.make("tir_rl/ReasoningGym-v0", task="chain_sum", split="test")
    check_env(env)
    _, info = env.reset(seed=0)
    answer = info.task.answer
    _, reward, terminated, _, _ = env.step(Message.assistant(f"<answer>{answer}</answer>"))
    assert terminated and reward == 1.0
