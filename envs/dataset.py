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

import hashlib
import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from tir_rl.envs.answers import ANSWER_INSTRUCTIONS, normalize_name
from tir_rl.envs.base import Task, ToolEnv
from tir_rl.envs.dataset_rows import EXAMPLE_PATH, Row, load_pools, resolve_path
from tir_rl.errors import ConfigError, did_you_mean
from tir_rl.types import Message

if TYPE_CHECKING:
    from tir_rl.tools import ToolRegistry

__all__ = ["EXAMPLE_PATH", "AnswerChecker", "DatasetEnv"]


class AnswerChecker(StrEnum):
    """How a final answer is compared with the reference."""

    MATH = "math"
    """math-verify: the same number or expression, however written."""
    EXACT = "exact"
    """The same text, ignoring case, spaces, quotes and a trailing period."""


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
