import gymnasium as gym
import pytest

import tir_rl.envs  # noqa: F401 (registers the ids)
from tir_rl.envs.base import ResetInfo, Split
from tir_rl.envs.math_problems import FAMILIES
from tir_rl.envs.math_python import MathPythonEnv, split_of
from tir_rl.errors import ConfigError
from tir_rl.types import Message, Role, ToolCall

_ORACLE_CODE = {
    "big_arithmetic": "print({a} * {b} - {c} ** {e})",
    "power_mod": "print(pow({a}, {b}, {m}))",
    "modular_inverse": "print(pow({a}, -1, {m}))",
    "digit_sum_of_power": "print(sum(int(d) for d in str({base} ** {exponent})))",
}


def test_make_by_id_with_split_and_difficulty():
    env = gym.make("tir_rl/MathPython-v0", split="test", difficulty=2)
    messages, info = env.reset(seed=0)
    assert info["split"] is Split.TEST and info["difficulty"] == 2
    assert [m.role for m in messages] == [Role.SYSTEM, Role.USER]
    assert "python" in messages[0].content and "<answer>" in messages[0].content
    assert [s["function"]["name"] for s in ResetInfo.from_info(info).tool_schemas] == ["python"]
    env.close()


def test_reset_is_deterministic_per_seed():
    a, b = MathPythonEnv(split="test"), MathPythonEnv(split="test")
    for seed in (0, 1, 12345):
        (ma, ia), (mb, ib) = a.reset(seed=seed), b.reset(seed=seed)
        assert ma == mb and ia["task_id"] == ib["task_id"]
        assert ia["task"].answer == ib["task"].answer
    assert len({a.reset(seed=s)[1]["task_id"] for s in range(30)}) > 25


def test_train_and_test_splits_are_disjoint_over_thousands_of_tasks():
    canonical, questions = {}, {}
    for split in Split:
        env = MathPythonEnv(split=split)
        problems = [env.problem(i) for i in range(2500)]
        assert all(split_of(p) == split for p in problems)
        canonical[split] = {p.canonical for p in problems}
        questions[split] = {p.question for p in problems}
    assert not canonical[Split.TRAIN] & canonical[Split.TEST]
    assert not questions[Split.TRAIN] & questions[Split.TEST]
    assert len(canonical[Split.TEST]) > 2000  # the pools are large, not a handful of repeats


def test_every_family_and_difficulty_is_drawn():
    env = MathPythonEnv()
    seen = {(t.data["family"], t.difficulty) for t in map(env.generate_task, range(400))}
    assert {f for f, _ in seen} == set(FAMILIES)
    assert {d for _, d in seen} == {1, 2, 3}


def test_family_and_difficulty_filters():
    env = MathPythonEnv(families=("power_mod",), difficulty=4)
    task = env.reset(seed=0)[1]["task"]
    assert task.data["family"] == "power_mod" and task.difficulty == 4
    with pytest.raises(ConfigError, match="unknown"):
        MathPythonEnv(families=("calculus",))
    with pytest.raises(ConfigError, match="difficulty"):
        MathPythonEnv(difficulty=9)


@pytest.mark.parametrize("family", sorted(_ORACLE_CODE))
def test_oracle_solves_with_the_python_tool(family, fake_sandboxes):
    env = MathPythonEnv(families=(family,), split="test", sandbox_factory=fake_sandboxes)
    for seed in range(3):
        _, info = env.reset(seed=seed)
        code = _ORACLE_CODE[family].format(**info["task"].data["params"])
        replies, reward, terminated, _, step_info = env.step(
            Message.assistant("", [ToolCall("python", {"code": code})])
        )
        assert not terminated and step_info["tool_results"][0].ok, replies[0].content
        printed = replies[0].content.strip()
        _, reward, terminated, _, step_info = env.step(
            Message.assistant(f"Computed it. <answer>{printed}</answer>")
        )
        assert terminated and reward == 1.0 and step_info["reward"].correct == 1.0
    assert len(fake_sandboxes.opened) == 3 and fake_sandboxes.num_open == 1
    env.close()
    assert fake_sandboxes.num_open == 0


def _answer_of(family: str, seed: int = 0) -> tuple[MathPythonEnv, str]:
    env = MathPythonEnv(families=(family,), difficulty=1)
    return env, env.reset(seed=seed)[1]["task"].answer


@pytest.mark.parametrize(
    ("spell", "expected"),
    [
        (lambda a: f"<answer>{a}</answer>", 1.0),
        (lambda a: f"<answer>{int(a):,}</answer>", 1.0),
        (lambda a: f"<answer> $\\boxed{{{a}}}$ </answer>", 1.0),
        (lambda a: f"The answer is \\boxed{{{a}}}.", 1.0),
        (lambda a: f"<answer>{a}.0</answer>", 1.0),
        (lambda a: f"<answer>{int(a) + 1}</answer>", 0.0),
        (lambda a: f"<answer>{a}{a}</answer>", 0.0),
        (lambda a: f"<answer>about {a}</answer>", 0.0),
        (lambda a: f"{a}", 0.0),  # no answer format: nudged, then no answer at all
    ],
)
def test_integer_answer_spellings(spell, expected):
    env, answer = _answer_of("power_mod")
    _, reward, terminated, _, _ = env.step(Message.assistant(spell(answer)))
    if not terminated:  # the nudge; the same turn again ends the episode
        _, reward, terminated, _, _ = env.step(Message.assistant(spell(answer)))
    assert terminated and reward == expected


def test_fraction_answers_compare_exactly():
    env = MathPythonEnv(families=("linear_system",), difficulty=1)
    for seed in range(60):
        answer = env.reset(seed=seed)[1]["task"].answer
        if "/" in answer and int(answer.split("/")[1]) % 3 == 0:  # no finite decimal
            break
    else:
        pytest.fail("no answer with a denominator divisible by 3 in 60 linear systems")
    num, den = map(int, answer.split("/"))
    for spelled, expected in (
        (f"{num}/{den}", 1.0),
        (f"{2 * num}/{2 * den}", 1.0),
        (f"\\frac{{{num}}}{{{den}}}", 1.0) if num > 0 else (f"-\\frac{{{-num}}}{{{den}}}", 1.0),
        (f"{num / den:.6f}", 0.0),
        (f"{num}/{den + 1}", 0.0),
    ):
        env.reset(seed=seed)
        assert env.step(Message.assistant(f"<answer>{spelled}</answer>"))[1] == expected, spelled


def test_format_reward_only_for_the_answer_tag():
    env = MathPythonEnv(families=("power_mod",), format_reward=0.2)
    answer = env.reset(seed=0)[1]["task"].answer
    assert env.step(Message.assistant(f"<answer>{answer}</answer>"))[1] == pytest.approx(1.2)
    env.reset(seed=0)
    assert env.step(Message.assistant(f"\\boxed{{{answer}}}"))[1] == pytest.approx(1.0)


def test_reset_and_answer_never_open_a_sandbox():
    def no_sandbox():
        raise AssertionError("a sandbox was opened")

    env = MathPythonEnv(sandbox_factory=no_sandbox)
    env.reset(seed=0)
    env.step(Message.assistant("<answer>1</answer>"))
    env.close()
