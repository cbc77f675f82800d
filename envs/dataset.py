r"""`tir_rl/Dataset-v0`: question/answer pairs from your own data file, checked by math-verify.

::

    gym.make("tir_rl/Dataset-v0", path="data/algebra.jsonl", question_field="problem",
             answer_field="solution", split="test")

Data (`Config.path`): a JSONL file (one JSON object per line), a parquet file (needs
``pyarrow``), or a folder written by ``datasets``' ``save_to_disk`` (needs ``datasets``);
nothing is downloaded. ``example`` names the small file shipped with tir-rl
(`EXAMPLE_PATH`). Files are read once per process and cached.

Splits, by construction disjoint:

* with `Config.split_field`, each row's value of that column (``train`` or ``test``) is its
  split; a saved ``DatasetDict`` works the same way, its ``train`` and ``test`` splits;
* otherwise a seeded split: the distinct questions are shuffled with
  ``Random(f"tir_rl/Dataset/{split_seed}")`` and the first ``round(test_fraction · n)`` (at
  least one) are test; rows that repeat a question follow it, so no question is in both.

Task ``index`` is row ``index mod len(pool)`` of the split's pool, in file order, so the
evaluation's task indices ``0..n-1`` walk the first n test rows (an explicit
``options["task_index"]`` past the pool is refused: evaluate at most ``len(pool)`` tasks).

Reward: ``correct`` is 1 when the final answer equals the reference: with
``checker="math"`` (default) by math-verify (`tir_rl.envs.symbolic`: ``\sqrt{2}``,
``2^{1/2}``, ``\frac{\pi}{3}`` and ``π/3`` all score), with ``checker="exact"`` by the text
(case, spaces, quotes and a trailing period ignored), for answers that are words: math-verify
reads ``Paris`` as the product of symbols ``P·a·r·i·s``, so an anagram would score.

Tools (`Config.tools`): ``python`` (the sandboxed interpreter, the default), or any
``@tool`` function named ``module:function``; none makes the episode single-turn.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl.envs.answers import ANSWER_INSTRUCTIONS, normalize_name
from tir_rl.envs.base import Split, Task, ToolEnv
from tir_rl.errors import ConfigError, SetupError, did_you_mean
from tir_rl.types import Message

if TYPE_CHECKING:
    from tir_rl.tools import ToolRegistry

EXAMPLE_PATH = Path(__file__).parent / "data" / "math_example.jsonl"
"""The example data set shipped with tir-rl (`path: example`)."""


class AnswerChecker(StrEnum):
    """How a final answer is compared with the reference."""

    MATH = "math"
    """math-verify: the same number or expression, however written."""
    EXACT = "exact"
    """The same text, ignoring case, spaces, quotes and a trailing period."""


@dataclass(frozen=True)
class Row:
    """One question of the data set."""

    index: int
    """Position in the file (0-based; rows of every split counted)."""
    question: str
    answer: str


@dataclass(frozen=True)
class Pools:
    """The rows of each split, in file order."""

    train: tuple[Row, ...]
    test: tuple[Row, ...]

    def of(self, split: Split) -> tuple[Row, ...]:
        """The pool of `split`."""
        return self.train if split is Split.TRAIN else self.test


class DatasetEnv(ToolEnv):
    """Questions and reference answers from a local data set."""

    @dataclass(kw_only=True)
    class Config(ToolEnv.Config):
        """Dataset settings."""

        path: str = "example"
        """JSONL file, parquet file, or a `datasets` `save_to_disk` folder; `example` is the
        small math file shipped with tir-rl."""
        question_field: str = "question"
        """Column holding the question (the user message)."""
        answer_field: str = "answer"
        """Column holding the reference answer (a string or a number)."""
        split_field: str | None = None
        """Column whose value, `train` or `test`, is the row's split; None: a seeded split
        by `test_fraction` and `split_seed` (a saved `DatasetDict` brings its own splits)."""
        test_fraction: float = 0.2
        """Share of the distinct questions that form the test split (seeded split only)."""
        split_seed: int = 0
        """Seed of the seeded split."""
        tools: tuple[str, ...] = ("python",)
        """Tools offered: `python` (sandboxed interpreter) or `module:function` of a `@tool`
        function; empty: no tools (single-turn)."""
        checker: AnswerChecker = AnswerChecker.MATH
        """`math` (math-verify) or `exact` (text; for answers that are words)."""
        system_prompt: str | None = None
        """Instructions before the answer protocol sentence; None: a default naming the
        tools."""

        def validate(self) -> None:
            """Check values; raise `ConfigError` naming the bad field."""
            super().validate()
            if not 0.0 <= self.test_fraction < 1.0:
                raise ConfigError(f"test_fraction={self.test_fraction}: must be in [0, 1)")
            if not self.path:
                raise ConfigError("path is empty: name a JSONL/parquet file or a folder")
            for name in ("question_field", "answer_field"):
                if not getattr(self, name):
                    raise ConfigError(f"{name} is empty: name a column of the data set")
            if isinstance(self.tools, str):
                raise ConfigError(
                    f"tools={self.tools!r}: a list of tool names, e.g. tools: [{self.tools}]"
                )
            self.checker = AnswerChecker(self.checker)

    config: Config

    # ----------------------------------------------------------------- data
    @property
    def pool(self) -> tuple[Row, ...]:
        """This env's split of the data set (loaded on first use, cached per process)."""
        c = self.config
        path = resolve_path(c.path)
        pools = load_pools(
            str(path), path.stat().st_mtime_ns, c.question_field, c.answer_field,
            c.split_field, c.test_fraction, c.split_seed,
        )  # fmt: skip
        pool = pools.of(self.split)
        if not pool:
            how = (
                f"no row has {c.split_field}={self.split.value!r}"
                if c.split_field
                else f"test_fraction={c.test_fraction} leaves it empty"
            )
            raise ConfigError(f"{c.path}: the {self.split.value} split is empty ({how})")
        if c.num_tasks is not None and c.num_tasks > len(pool):
            raise ConfigError(
                f"num_tasks={c.num_tasks} but the {self.split.value} split of {c.path} has "
                f"{len(pool)} rows: lower num_tasks"
            )
        return pool

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode (see `ToolEnv.reset`); an explicit task index must be a row.

        Seeds pick any row; ``options["task_index"]`` (a fixed evaluation set) past the end of
        the pool is refused rather than wrapped, so no task is counted twice.
        """
        index = (options or {}).get("task_index")
        if isinstance(index, int) and index >= len(self.pool):
            raise ConfigError(
                f"task_index={index} but the {self.split.value} split of {self.config.path} has "
                f"{len(self.pool)} rows: evaluate at most {len(self.pool)} tasks "
                "(run.eval_tasks, or --tasks of tir-rl eval)"
            )
        return super().reset(seed=seed, options=options)

    # ----------------------------------------------------------------- ToolEnv hooks
    def build_tools(self) -> ToolRegistry:
        """The configured tools."""
        from tir_rl.tools import ToolRegistry

        return ToolRegistry([_resolve_tool(name) for name in self.config.tools])

    def generate_task(self, index: int) -> Task:
        """Row ``index mod len(pool)`` of this env's split."""
        pool = self.pool
        row = pool[index % len(pool)]
        digest = hashlib.sha256(row.question.encode()).hexdigest()[:8]
        return Task(
            id=f"dataset/{self.split}/{row.index}/{digest}",
            question=row.question,
            answer=row.answer,
            split=self.split,
            difficulty=1,
            data={"row": row.index},
        )

    def instructions(self, task: Task) -> str:
        """The configured system prompt (or the default), then the answer protocol."""
        if self.config.system_prompt is not None:
            return self.config.system_prompt.rstrip() + " " + ANSWER_INSTRUCTIONS
        if "python" in self.config.tools:
            intro = (
                "Solve the problem. You have a `python` tool that runs code in a persistent "
                "session and returns what you print; use it whenever computing helps. "
            )
        elif self.config.tools:
            intro = "Solve the problem; use the tools whenever they help. "
        else:
            intro = "Solve the problem. Think step by step if it helps. "
        return intro + ANSWER_INSTRUCTIONS

    def score(self, task: Task, answer: str) -> float:
        """1.0 when `answer` equals the reference under the configured checker."""
        if self.config.checker is AnswerChecker.EXACT:
            return float(normalize_name(answer) == normalize_name(task.answer))
        from tir_rl.envs.symbolic import shared_checker

        return float(shared_checker().equal(answer, task.answer))

    def demonstration(self, task: Task) -> list[Message]:
        """The reference answer in one turn (no tool call)."""
        return [Message.assistant(f"<answer>{task.answer}</answer>")]


def resolve_path(path: str) -> Path:
    """`example` or a path, checked to exist."""
    resolved = EXAMPLE_PATH if path == "example" else Path(path).expanduser()
    if not resolved.exists():
        raise ConfigError(
            f"path={path!r}: {resolved} does not exist (a JSONL or parquet file, a "
            "`save_to_disk` folder, or `example`)"
        )
    return resolved


@functools.lru_cache(maxsize=8)
def load_pools(
    path: str,
    mtime_ns: int,
    question_field: str,
    answer_field: str,
    split_field: str | None,
    test_fraction: float,
    split_seed: int,
) -> Pools:
    """Read the data set and split it (cached on the file's path and modification time)."""
    records, own_splits = _read(Path(path))
    if own_splits is not None and split_field is not None:
        raise ConfigError(
            f"{path} is a saved DatasetDict with its own splits {sorted(set(own_splits))}; "
            f"leave split_field unset (it is {split_field!r})"
        )
    rows: list[Row] = []
    splits: list[str] = []
    for index, record in enumerate(records):
        rows.append(_row(index, record, question_field, answer_field, path))
        if split_field is not None:
            splits.append(_field(record, split_field, index, path, "split_field"))
    if not rows:
        raise ConfigError(f"{path} holds no rows")
    if own_splits is not None:
        splits = own_splits
    if split_field is not None or own_splits is not None:
        unknown = sorted({str(s) for s in splits} - {"train", "test"})
        if unknown:
            raise ConfigError(
                f"{path}: split values {unknown} are neither 'train' nor 'test'; rename them "
                "or drop those rows"
            )
        test = {r.question for r, s in zip(rows, splits, strict=True) if s == "test"}
        train = {r.question for r, s in zip(rows, splits, strict=True) if s == "train"}
        both = sorted(test & train)
        if both:
            raise ConfigError(
                f"{path}: {len(both)} question(s) are in both splits (first: {both[0][:80]!r}); "
                "a held-out score needs disjoint splits"
            )
        in_test = [s == "test" for s in splits]
    else:
        test = _seeded_test_questions(rows, test_fraction, split_seed)
        in_test = [r.question in test for r in rows]
    return Pools(
        train=tuple(r for r, t in zip(rows, in_test, strict=True) if not t),
        test=tuple(r for r, t in zip(rows, in_test, strict=True) if t),
    )


def _seeded_test_questions(rows: list[Row], test_fraction: float, seed: int) -> set[str]:
    questions = list(dict.fromkeys(r.question for r in rows))
    if test_fraction == 0:
        return set()
    random.Random(f"tir_rl/Dataset/{seed}").shuffle(questions)
    num_test = max(1, round(test_fraction * len(questions)))
    return set(questions[:num_test])


def _row(index: int, record: Any, question_field: str, answer_field: str, path: str) -> Row:
    if not isinstance(record, Mapping):
        raise ConfigError(f"{path}: row {index} is {type(record).__name__}, not an object")
    question = _field(record, question_field, index, path, "question_field")
    answer = _field(record, answer_field, index, path, "answer_field")
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"{path}: row {index}'s {question_field!r} is not a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ConfigError(
            f"{path}: row {index}'s {answer_field!r} is {answer!r}; a reference answer is a "
            "string or a number"
        )
    if not str(answer).strip():
        raise ConfigError(f"{path}: row {index}'s {answer_field!r} is empty")
    return Row(index, question.strip(), str(answer).strip())


def _field(record: Mapping[str, Any], name: str, index: int, path: str, key: str) -> Any:
    if name not in record:
        fields = sorted(map(str, record))
        hint = did_you_mean(name, fields)
        raise ConfigError(
            f"{path}: row {index} has no field {name!r} (its fields: {fields}).{hint} "
            f"Set {key} to the column's name."
        )
    return record[name]


def _read(path: Path) -> tuple[list[Any], list[str] | None]:
    """The records, and each record's split when the data set brings its own splits."""
    if path.is_dir():
        return _read_saved_dataset(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return list(_read_jsonl(path)), None
    if suffix == ".parquet":
        parquet = _optional("pyarrow.parquet", "parquet files", "pyarrow")
        return parquet.read_table(path).to_pylist(), None
    raise ConfigError(
        f"{path}: unknown data file type {suffix or '(none)'!r}; use .jsonl, .parquet or a "
        "`datasets` save_to_disk folder"
    )


def _read_jsonl(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not a JSON object: {exc}") from exc


def _read_saved_dataset(path: Path) -> tuple[list[Any], list[str] | None]:
    datasets = _optional("datasets", "save_to_disk folders", "datasets")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{path} is a folder but not one written by `datasets` save_to_disk: {exc}"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        records, splits = [], []
        for name, part in loaded.items():
            rows = part.to_list()
            records += rows
            splits += [name] * len(rows)
        return records, splits
    return loaded.to_list(), None


def _optional(module: str, what: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SetupError(
            f"tir_rl/Dataset-v0 reads {what} with {package}: pip install {package} "
            "(or pip install 'tir-rl[data]')"
        ) from exc


def _resolve_tool(name: str) -> Any:
    if name == "python":
        from tir_rl.tools.python import python

        return python
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"tools: {name!r} is neither 'python' nor 'module:function' (a @tool function)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"tools: cannot import {module_name!r} for {name!r}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None or not hasattr(found, "spec"):
        raise ConfigError(
            f"tools: {name!r} is not a @tool function of {module_name!r}"
            f"{did_you_mean(attr, dir(module))}"
        )
    return found
