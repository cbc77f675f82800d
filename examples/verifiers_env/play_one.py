"""Play one task of a verifiers environment through tir-rl's chat endpoint; print its reward.

Run by `CommandAgentEnv` once per episode, inside the verifiers virtual environment
(`scripts/setup_verifiers.sh` builds `.venv-verifiers`; verifiers 0.4.0 needs openai<3, the
project's environment has openai 3)::

    .venv-verifiers/bin/python examples/verifiers_env/play_one.py BASE_URL SPLIT INDEX

Each run imports verifiers and loads the environment again (about 8 s here); `worker.py`
does that once and plays many episodes (`WorkerAgentEnv`). BASE_URL is the episode's OpenAI
base URL (`.../episodes/<id>/v1`); `vf_play.py` says what verifiers does with it. The last
line printed is ``{"reward": r}``, the trace's weighted reward sum. A failed episode (an
error on the trace) exits 1 with the error on standard error, and tir-rl records the episode
as `error_agent`.

`--record DIR` also writes what verifiers saw, `DIR/<episode id>.json` (rewards, reply,
calls), so a test can check it against what the endpoint recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

import vf_play


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


async def play(args: argparse.Namespace) -> dict:
    """One verifiers episode of the chosen task; what verifiers recorded of it."""
    env, tasks = vf_play.load(args.env, args.split, args.num_tasks)
    async with env.serving():
        result = await vf_play.play(env, tasks, args.index, args.base_url)
    return {"split": args.split, **result}


def main() -> None:
    """Play, record, print the reward last."""
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    vf_play.prepare_process_env()
    try:
        result = asyncio.run(play(args))
    except vf_play.EpisodeFailed as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(1) from None
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        (args.record / f"{vf_play.episode_id(args.base_url)}.json").write_text(json.dumps(result))
    print(json.dumps({"reward": result["reward"]}))


if __name__ == "__main__":
    main()
