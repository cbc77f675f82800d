"""The reasoning-gym adapter: its logic on a fake dataset, then real reasoning-gym tasks.

The real-package tests run whenever ``reasoning_gym`` is importable (they skip only when it
is not installed); they take about a second, most of it importing the package.
"""

import sys

import gymnasium as gym
import pytest

import tir_rl.envs  # noqa: F401 (registers the ids)
from tir_rl.envs import check_env
from tir_rl.envs.base import ResetInfo, Split
from tir_rl.envs.reasoning_gym import ReasoningGymEnv, split_of_question
from tir_rl.errors import ConfigError, SetupError
from tir_rl.types import Message, ToolCall


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
    assert ResetInfo.from_info(info).tool_schemas == []
    entry = info["task"].data["entry"]
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


def test_missing_package_raises_setup_error_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes the import fail
    env = ReasoningGymEnv()
    with pytest.raises(SetupError, match="pip install reasoning-gym"):
        env.reset(seed=0)


# ------------------------------------------------------------------ the real package
@pytest.fixture(scope="module")
def reasoning_gym():
    return pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")


def _answer(text: str) -> Message:
    return Message.assistant(f"<answer>{text}</answer>")


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic"])
def test_real_single_turn_scores_right_and_wrong_answers(reasoning_gym, task):
    env = gym.make("tir_rl/ReasoningGym-v0", task=task, split="test")
    check_env(env)
    for seed in range(3):
        messages, info = env.reset(seed=seed)
        assert (
            ResetInfo.from_info(info).tool_schemas == []
            and messages[-1].content == info["task"].question
        )
        assert split_of_question(info["task"].question) == Split.TEST
        answer = info["task"].answer
        assert answer == str(info["task"].data["entry"]["answer"]) and answer
        _, reward, terminated, _, step_info = env.step(_answer(answer))
        assert terminated and reward == 1.0 and step_info["reward"].correct == 1.0
        env.reset(seed=seed)
        _, reward, terminated, _, step_info = env.step(_answer(str(int(answer) + 1)))
        assert terminated and reward == 0.0 and step_info["answer"] == str(int(answer) + 1)


def test_real_multi_turn_with_the_python_tool(reasoning_gym, fake_sandboxes):
    env = ReasoningGymEnv(task="chain_sum", use_python=True, sandbox_factory=fake_sandboxes)
    check_env(env)
    for seed, right in [(0, True), (1, False)]:
        _, info = env.reset(seed=seed)
        assert [s["function"]["name"] for s in ResetInfo.from_info(info).tool_schemas] == ["python"]
        expression = info["task"].data["entry"]["metadata"]["expression"]
        call = Message.assistant("", [ToolCall("python", {"code": f"print({expression})"})])
        replies, reward, terminated, _, step_info = env.step(call)
        assert not terminated and reward == 0.0 and step_info["tool_results"][0].ok
        printed = replies[0].content.strip()
        assert printed == info["task"].answer
        final = printed if right else str(int(printed) + 1)
        _, reward, terminated, _, _ = env.step(_answer(final))
        assert terminated and reward == (1.0 if right else 0.0)
    assert len(fake_sandboxes.opened) == 2
    env.close()
    assert fake_sandboxes.num_open == 0


def test_real_substring_partial_credit_and_how_to_turn_it_off(reasoning_gym):
    for partial_credit in (True, False):
        env = ReasoningGymEnv(task="chain_sum", partial_credit=partial_credit)
        answer = env.reset(seed=0)[1]["task"].answer
        padded = f"{answer} 7"  # wrong, but contains the reference: upstream gives credit
        _, reward, _, _, _ = env.step(_answer(padded))
        assert reward == (pytest.approx(len(answer) / len(padded)) if partial_credit else 0.0)


def test_real_task_config_reaches_the_dataset(reasoning_gym):
    env = ReasoningGymEnv(task="chain_sum", task_config={"min_terms": 4, "max_terms": 4})
    for seed in range(3):
        metadata = env.reset(seed=seed)[1]["task"].data["entry"]["metadata"]
        assert metadata["num_terms"] == 4


def test_real_scorer_that_raises_on_a_bad_answer_gives_zero(reasoning_gym):
    env = ReasoningGymEnv(task="prime_factorization")
    _, info = env.reset(seed=0)
    with pytest.raises(ValueError):  # the upstream scorer itself raises on a word
        env.dataset.score_answer("xyz", info["task"].data["entry"])
    _, reward, terminated, _, _ = env.step(_answer("xyz"))
    assert terminated and reward == 0.0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"task": "chain_sun"}, "unknown reasoning-gym task 'chain_sun'.*chain_sum"),
        ({"task_config": {"bogus": 1}}, "TypeError.*bogus"),
        ({"task_config": {"min_terms": 5, "max_terms": 2}}, "AssertionError.*max_terms"),
    ],
)
def test_real_bad_settings_raise_config_error(reasoning_gym, overrides, match):
    env = ReasoningGymEnv(**overrides)
    with pytest.raises(ConfigError, match=match):
        env.reset(seed=0)


def test_real_demonstration_earns_full_reward(reasoning_gym):
    env = ReasoningGymEnv(task="basic_arithmetic")
    _, info = env.reset(seed=3)
    (turn,) = env.demonstration(info["task"])
    _, reward, terminated, _, _ = env.step(turn)
    assert terminated and reward == 1.0


def test_real_task_without_reference_answer_has_no_demonstration(reasoning_gym):
    env = ReasoningGymEnv(task="graph_color")  # any valid colouring counts
    _, info = env.reset(seed=0)
    assert info["task"].data["entry"]["answer"] is None and info["task"].answer == ""
    with pytest.raises(NotImplementedError, match="no reference answer"):
        env.demonstration(info["task"])
