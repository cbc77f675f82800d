"""Reading and splitting the data of `tir_rl/Dataset-v0` (see `tir_rl.envs.dataset`).

`load_pools` reads a JSONL file, a parquet file (pyarrow) or a `datasets` save_to_disk folder
into `Row`s, checks every row, and splits them (the data's own split column, or seeded over
distinct questions); it is cached per process on the file's path and modification time.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tir_rl.envs.base import Split
from tir_rl.errors import ConfigError, SetupError, did_you_mean

EXAMPLE_PATH = Path(__file__).parent / "data" / "math_example.jsonl"
"""The example data set shipped with tir-rl (`path: example`)."""


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
