"""`tir_rl/Dataset-v0`: loading, splits, field errors, tools, and math-verify scoring."""

import json
import threading
import time

import gymnasium as gym
import pytest

import tir_rl.envs  # noqa: F401 (registers tir_rl/Dataset-v0)
from tir_rl.envs import ResetInfo, check_env
from tir_rl.envs.dataset import EXAMPLE_PATH, DatasetEnv
from tir_rl.envs.symbolic import SymbolicChecker
from tir_rl.errors import ConfigError
from tir_rl.types import Message


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def answer(text: str) -> Message:
    return Message.assistant(f"<answer>{text}</answer>")


def final_reward(env: DatasetEnv, text: str, *, task_index: int = 0) -> float:
    env.reset(seed=0, options={"task_index": task_index})
    return env.step(answer(text))[1]


# ----------------------------------------------------------------- loading and splits


def test_the_shipped_example_splits_into_disjoint_seeded_pools():
    train, test = DatasetEnv(split="train").pool, DatasetEnv(split="test").pool
    rows = [json.loads(line) for line in EXAMPLE_PATH.read_text().splitlines()]
    assert (len(train), len(test)) == (24, 6)  # round(0.2 * 30)
    assert sorted(r.index for r in train + test) == list(range(len(rows)))
    assert not {r.question for r in train} & {r.question for r in test}
    assert [r.answer for r in test] == [rows[r.index]["answer"] for r in test]
    other = DatasetEnv(split="test", split_seed=1).pool
    assert {r.index for r in other} != {r.index for r in test}
    assert DatasetEnv(split="test").pool == test  # deterministic


def test_repeated_questions_stay_in_one_split(tmp_path):
    rows = [{"question": f"q{i % 5}", "answer": str(i % 5)} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train = {r.question for r in DatasetEnv(path=path, split="train").pool}
    test = DatasetEnv(path=path, split="test").pool
    assert len({r.question for r in test}) == 1 and len(test) == 4  # one of 5 questions
    assert not train & {r.question for r in test}


def test_a_split_column_assigns_rows_and_task_indices_walk_it_in_order(tmp_path):
    rows = [
        {"q": "one?", "a": 1, "part": "train"},
        {"q": "two?", "a": 2, "part": "test"},
        {"q": "three?", "a": 3.5, "part": "test"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    kw = {"path": path, "question_field": "q", "answer_field": "a", "split_field": "part"}
    env = DatasetEnv(split="test", **kw)
    assert [(r.index, r.answer) for r in env.pool] == [(1, "2"), (2, "3.5")]
    questions = []
    for index in range(2):
        messages, info = env.reset(options={"task_index": index})
        questions.append(messages[-1].content)
    assert questions == ["two?", "three?"]
    assert ResetInfo.from_info(info).task.split == "test"
    with pytest.raises(ConfigError, match="task_index=2 but the test split .* has 2 rows"):
        env.reset(options={"task_index": 2})  # a fixed eval set never counts a row twice
    assert env.generate_task(2).question == "two?"  # seeds: index mod len(pool)
    assert [r.question for r in DatasetEnv(split="train", **kw).pool] == ["one?"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"q": "a?", "a": 1, "part": "validation"}], r"\['validation'\] are neither"),
        (
            [{"q": "a?", "a": 1, "part": "train"}, {"q": "a?", "a": 1, "part": "test"}],
            "in both splits",
        ),
        ([{"q": "a?", "a": 1, "part": "train"}], "the test split is empty"),
    ],
)
def test_a_bad_split_column_is_refused(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    env = DatasetEnv(
        path=path, question_field="q", answer_field="a", split_field="part", split="test"
    )
    with pytest.raises(ConfigError, match=message):
        env.reset(seed=0)


@pytest.mark.parametrize(
    ("rows", "overrides", "message"),
    [
        (
            [{"problem": "a?", "answer": "1"}],
            {},
            r"row 0 has no field 'question' \(its fields: \['answer', 'problem'\]\)",
        ),
        ([{"problem": "a?", "solution": "1"}], {"question_field": "problm"}, "'problem'?"),
        ([{"question": "a?", "answer": [1, 2]}], {}, "a reference answer is a string or a"),
        ([{"question": "a?", "answer": " "}], {}, "row 0's 'answer' is empty"),
        ([{"question": "", "answer": "1"}], {}, "not a non-empty string"),
        ([], {}, "holds no rows"),
    ],
)
def test_field_and_row_errors_name_the_row_and_the_fix(tmp_path, rows, overrides, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=message):
        DatasetEnv(path=path, **overrides).reset(seed=0)


def test_file_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        DatasetEnv(path=str(tmp_path / "missing.jsonl")).reset(seed=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a?", "answer": 1}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not a JSON object"):
        DatasetEnv(path=str(bad)).reset(seed=0)
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match="unknown data file type '.csv'"):
        DatasetEnv(path=str(tmp_path / "d.csv")).reset(seed=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"test_fraction": 1.0}, r"must be in \[0, 1\)"),
        ({"answer_field": ""}, "answer_field is empty"),
        ({"checker": "fuzzy"}, "'fuzzy' is not a valid AnswerChecker"),
        ({"spilt_seed": 1}, "did you mean 'split_seed'"),
        ({"tools": "python"}, r"a list of tool names, e.g. tools: \[python\]"),
    ],
)
def test_bad_settings_are_refused_at_construction(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        gym.make("tir_rl/Dataset-v0", **overrides)


def test_a_zero_test_fraction_leaves_no_test_split_and_says_so():
    assert len(DatasetEnv(test_fraction=0.0).pool) == 30
    with pytest.raises(ConfigError, match="test_fraction=0.0 leaves it empty"):
        DatasetEnv(test_fraction=0.0, split="test").reset(seed=0)


def test_num_tasks_beyond_the_pool_is_refused():
    with pytest.raises(ConfigError, match="num_tasks=7 but the test split .* has 6 rows"):
        DatasetEnv(split="test", num_tasks=7).reset(seed=0)


def test_parquet_files_load(tmp_path):
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    parquet.write_table(pa.table({"question": ["x?", "y?"], "answer": ["1", "2"]}), path)
    env = DatasetEnv(path=str(path), test_fraction=0.5)
    assert len(env.pool) == 1 and env.pool[0].question in ("x?", "y?")


def hf_dataset(datasets, columns: dict, name: str):
    """`datasets.Dataset.from_dict` without its fingerprint hash (datasets 5.2.0 fails to
    pickle pyarrow's MonthDayNano type while hashing in this environment; loading is fine)."""
    from datasets.table import InMemoryTable

    return datasets.Dataset(InMemoryTable.from_pydict(columns), fingerprint=name)


def test_save_to_disk_folders_load_and_a_dataset_dict_brings_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    columns = {"question": ["x?", "y?", "z?"], "answer": [1, 2, 3]}
    hf_dataset(datasets, columns, "plain").save_to_disk(str(tmp_path / "plain"))
    assert len(DatasetEnv(path=str(tmp_path / "plain"), split="test").pool) == 1
    parts = datasets.DatasetDict(
        train=hf_dataset(datasets, {"question": ["x?", "y?"], "answer": ["1", "2"]}, "tr"),
        test=hf_dataset(datasets, {"question": ["z?"], "answer": ["\\sqrt{3}"]}, "te"),
    )
    parts.save_to_disk(str(tmp_path / "dict"))
    test = DatasetEnv(path=str(tmp_path / "dict"), split="test").pool
    assert [(r.question, r.answer) for r in test] == [("z?", "\\sqrt{3}")]
    with pytest.raises(ConfigError, match="DatasetDict with its own splits"):
        DatasetEnv(path=str(tmp_path / "dict"), split_field="part").reset(seed=0)


# ----------------------------------------------------------------- scoring


@pytest.fixture
def latex_env(tmp_path):
    rows = [
        {"question": "x^2 = 2, x > 0?", "answer": "\\sqrt{2}", "s": "test"},
        {"question": "cos t = 1/2, smallest t > 0?", "answer": "\\pi/3", "s": "test"},
        {"question": "half?", "answer": 0.5, "s": "test"},
        {"question": "capital of France?", "answer": "Paris", "s": "train"},
    ]
    path = write_jsonl(tmp_path / "latex.jsonl", rows)
    return lambda **kw: DatasetEnv(path=path, split_field="s", split="test", tools=(), **kw)


@pytest.mark.parametrize(
    ("task_index", "written", "reward"),
    [
        (0, "\\sqrt{2}", 1.0),
        (0, "2^{1/2}", 1.0),
        (0, "\\boxed{\\sqrt{2}}", 1.0),
        (0, "$\\sqrt 2$", 1.0),
        (0, "1.41421356", 1.0),
        (0, "1.414", 0.0),
        (0, "2", 0.0),
        (1, "\\frac{\\pi}{3}", 1.0),
        (1, "π/3", 1.0),
        (1, "60", 0.0),
        (1, "\\pi/6", 0.0),
        (2, "\\frac{1}{2}", 1.0),
        (2, "1/2", 1.0),
        (2, "0.25", 0.0),
    ],
)
def test_math_verify_scores_latex_answers(latex_env, task_index, written, reward):
    assert final_reward(latex_env(), written, task_index=task_index) == reward


def test_every_shipped_reference_answer_earns_full_reward():
    for split in ("train", "test"):
        env = DatasetEnv(split=split)
        for index in range(len(env.pool)):
            env.reset(options={"task_index": index})
            assert env.step(answer(env.task.answer))[1] == 1.0, env.task


def test_the_exact_checker_compares_words_where_math_verify_would_not(tmp_path):
    path = write_jsonl(tmp_path / "w.jsonl", [{"question": "capital?", "answer": "Paris"}] * 2)
    exact = DatasetEnv(path=path, checker="exact", test_fraction=0.0, tools=())
    assert final_reward(exact, " paris. ") == 1.0 and final_reward(exact, "Sirap") == 0.0
    # math-verify reads words as products of symbols: the anagram scores (documented)
    math = DatasetEnv(path=path, test_fraction=0.0, tools=())
    assert final_reward(math, "Sirap") == 1.0


def test_scoring_works_from_a_worker_thread(latex_env):
    env, rewards = latex_env(), []
    env.reset(options={"task_index": 1})
    thread = threading.Thread(target=lambda: rewards.append(env.step(answer("π/3"))[1]))
    thread.start()
    thread.join()
    assert rewards == [1.0]


def test_a_hostile_answer_times_out_scores_zero_and_the_checker_recovers():
    checker = SymbolicChecker(timeout_s=2.0)
    try:
        assert checker.equal("\\sqrt{2}", "2^{1/2}")
        started = time.monotonic()
        assert not checker.equal("9^{9^{9^{9}}}", "1")  # sympy would never finish
        assert time.monotonic() - started < 10
        assert checker.equal("\\frac{\\pi}{3}", "\\pi/3")
        checker._proc.kill()  # a helper that died between checks is restarted
        checker._proc.wait()
        assert checker.equal("3", "x = 3")
    finally:
        checker.close()
        checker.close()


# ----------------------------------------------------------------- tools and the API


def test_the_python_tool_is_the_default_and_tools_can_be_none_or_user_tools():
    assert DatasetEnv().tools.names == ["python"]
    assert DatasetEnv(tools=()).tools.names == []
    assert "python" not in DatasetEnv(tools=()).instructions(None)
    custom = DatasetEnv(tools=("tir_rl.tools.stats:ToolStats",))
    with pytest.raises(ConfigError, match="is not a @tool function"):
        custom.tools  # noqa: B018
    with pytest.raises(ConfigError, match="neither 'python' nor 'module:function'"):
        DatasetEnv(tools=("calculator",)).tools  # noqa: B018


def test_a_user_tool_is_offered(tmp_path, monkeypatch):
    (tmp_path / "byo_tools.py").write_text(
        "from tir_rl.tools import tool\n\n"
        "@tool\n"
        "def double(x: int) -> int:\n"
        '    """Double a number.\n\n    Args:\n        x: the number\n    """\n'
        "    return 2 * x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = DatasetEnv(tools=("byo_tools:double",))
    assert env.tools.names == ["double"]
    check_env(env)


@pytest.mark.parametrize("tools", [("python",), ()])
def test_check_env_passes(tools):
    check_env(DatasetEnv(tools=tools))
    check_env(gym.make("tir_rl/Dataset-v0", split="test", tools=tools))


def test_a_custom_system_prompt_keeps_the_answer_protocol():
    env = DatasetEnv(system_prompt="You are a geometry tutor.")
    assert env.instructions(None).startswith("You are a geometry tutor. When you are done")


def test_the_demonstration_is_the_reference_answer():
    env = DatasetEnv(split="test")
    env.reset(options={"task_index": 0})
    (turn,) = env.demonstration(env.task)
    assert env.step(turn)[1] == 1.0


def test_the_example_run_config_builds_the_dataset_env():
    from pathlib import Path

    from tir_rl.config import load
    from tir_rl.run_config import RunConfig
    from tir_rl.runtime import env_factory

    examples = Path(__file__).resolve().parents[3] / "examples"
    config = load(RunConfig, examples / "dataset.yaml", ["env.kwargs.split_seed=3"])
    env = env_factory(config.env, config.env.eval_split)()
    assert isinstance(env, DatasetEnv) and env.config.split_seed == 3
    assert config.run.eval_tasks <= len(env.pool)
    check_env(env)
