"""Play one task of a verifiers environment through tir-rl's chat endpoint; print its reward.

Run by `CommandAgentEnv` once per episode, inside the verifiers virtual environment
(`scripts/setup_verifiers.sh` builds `.venv-verifiers`; verifiers 0.4.0 needs openai<3, the
project's environment has openai 3)::

    .venv-verifiers/bin/python examples/verifiers_env/play_one.py BASE_URL SPLIT INDEX

BASE_URL is the episode's OpenAI base URL (`.../episodes/<id>/v1`), so every model call of
the episode is recorded under it. verifiers does the rest as in its own `eval`: it loads the
environment (`--env`, default this folder's `vf_reverse`), takes task INDEX of SPLIT, runs
its built-in `null` harness (its tool-less chat program, in a local subprocess) whose calls
go through verifiers' interception server and its eval client to BASE_URL, then scores the
trace with the task's rubric. The last line printed is ``{"reward": r}``, the trace's
weighted reward sum. A failed episode (an error on the trace) exits 1 with the error on
standard error, and tir-rl records the episode as `error_agent`.

`--record DIR` also writes what verifiers saw, `DIR/<episode id>.json` (rewards, reply,
calls), so a test can check it against what the endpoint recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    """The command line: base URL, split, index and the options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base_url", help="the episode's OpenAI base URL (.../episodes/<id>/v1)")
    parser.add_argument("split", help="train or test")
    parser.add_argument("index", type=int, help="the task's index in the split")
    parser.add_argument("--env", default="vf_reverse", help="the verifiers taskset id")
    parser.add_argument("--num-tasks", type=int, default=32, help="tasks in the split")
    parser.add_argument("--record", type=Path, help="folder for <episode id>.json records")
    return parser.parse_args()


def prepare_process_env() -> None:
    """Put this venv's `uv` on PATH and its cache in the venv, and the examples on sys.path.

    verifiers prepares its chat program with `uv` (installing one under ~/.local when none is
    on PATH); `scripts/setup_verifiers.sh` already synced the program into that cache.
    """
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("UV_CACHE_DIR", str(Path(sys.prefix) / "uv-cache"))
    sys.path.insert(0, str(HERE))


async def play(args: argparse.Namespace) -> dict:
    """One verifiers episode of the chosen task; what verifiers recorded of it."""
    import verifiers.v1 as vf

    config = vf.SingleAgentEnvConfig(
        taskset={"id": args.env, "split": args.split, "num_tasks": args.num_tasks},
        agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    )
    env = vf.load_environment(config)
    tasks = list(env.taskset)
    if not 0 <= args.index < len(tasks):
        raise SystemExit(f"task index {args.index} is outside the split's {len(tasks)} tasks")
    # tir-rl puts the endpoint's key in TIR_RL_ENDPOINT_KEY; the model name is not checked.
    client = vf.EvalClientConfig(base_url=args.base_url, api_key_var="TIR_RL_ENDPOINT_KEY")
    context = vf.ModelContext(model="policy", client=client)
    async with env.serving():
        episode = await env.run_episode(tasks[args.index], context)
    if not episode.ok or len(episode.traces) != 1:
        errors = [e.message for e in episode.errors] + [
            e.message for trace in episode.traces for e in trace.errors
        ]
        print(f"the verifiers episode failed: {errors}", file=sys.stderr)
        raise SystemExit(1)
    (trace,) = episode.traces
    return {
        "split": args.split,
        "index": args.index,
        "reward": trace.reward,
        "rewards": {k: v.model_dump() for k, v in trace.rewards.items() if v is not None},
        "reply": trace.last_reply,
        "num_calls": len(trace.calls),
    }


def main() -> None:
    """Play, record, print the reward last."""
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    prepare_process_env()
    result = asyncio.run(play(args))
    if args.record is not None:
        episode_id = args.base_url.rstrip("/").split("/")[-2]
        args.record.mkdir(parents=True, exist_ok=True)
        (args.record / f"{episode_id}.json").write_text(json.dumps(result))
    print(json.dumps({"reward": result["reward"]}))


if __name__ == "__main__":
    main()
