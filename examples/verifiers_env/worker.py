"""A verifiers worker that stays up, for `WorkerAgentEnv`.

It imports verifiers once, loads each split's environment once, and plays many episodes at
once:

    .venv-verifiers/bin/python examples/verifiers_env/worker.py [--env ID] [--record DIR]

It speaks `WorkerAgentEnv`'s protocol (tir_rl/envs/agent_worker.py): one JSON request per
line on standard input (``{"id", "base_url", "split", "index"}`` to play, ``{"cancel": id}``
to stop), one JSON answer per line on standard output (``{"id", "reward"}`` or
``{"id", "error"}``), and it exits when its input closes. Anything else that writes to
standard output (verifiers, its harness) is sent to standard error, so answers stay whole.
`vf_play.py` says what each episode does; `--record DIR` writes what verifiers saw to
`DIR/<episode id>.json`, as `play_one.py --record` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import vf_play


def parse_args() -> argparse.Namespace:
    """The options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="vf_reverse", help="the verifiers taskset id")
    parser.add_argument("--num-tasks", type=int, default=32, help="tasks in each split")
    parser.add_argument("--record", type=Path, help="folder for <episode id>.json records")
    return parser.parse_args()


def answers_channel() -> TextIO:
    """A private copy of standard output for answers; fd 1 then points at standard error."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


class Worker:
    """The loaded environments and the episodes in play."""

    def __init__(self, args: argparse.Namespace, answers: TextIO, stack: Any) -> None:
        self.args, self.answers, self.stack = args, answers, stack
        self.splits: dict[str, asyncio.Task] = {}
        self.playing: dict[str, asyncio.Task] = {}

    async def _load(self, split: str) -> tuple[Any, list[Any]]:
        env, tasks = vf_play.load(self.args.env, split, self.args.num_tasks)
        await self.stack.enter_async_context(env.serving())
        return env, tasks

    def environment(self, split: str) -> asyncio.Task:
        """The split's environment, loaded by the first episode that needs it."""
        if split not in self.splits:
            self.splits[split] = asyncio.create_task(self._load(split))
        return self.splits[split]

    def answer(self, episode_id: str, **fields: Any) -> None:
        """Write an episode's answer line."""
        self.answers.write(json.dumps({"id": episode_id, **fields}) + "\n")

    async def play(self, request: dict[str, Any]) -> None:
        """Play one requested episode and answer it, whatever happens."""
        episode_id = request["id"]
        try:
            env, tasks = await asyncio.shield(self.environment(request["split"]))
            result = await vf_play.play(env, tasks, int(request["index"]), request["base_url"])
        except asyncio.CancelledError:
            self.answer(episode_id, error="cancelled")
        except Exception as exc:  # one episode's failure, answered; the worker goes on
            self.answer(episode_id, error=f"{type(exc).__name__}: {exc}")
        else:
            if self.args.record is not None:
                self.args.record.mkdir(parents=True, exist_ok=True)
                record = {"split": request["split"], "worker_pid": os.getpid(), **result}
                (self.args.record / f"{episode_id}.json").write_text(json.dumps(record))
            self.answer(episode_id, reward=result["reward"])
        finally:
            self.playing.pop(episode_id, None)

    def handle(self, line: str) -> None:
        """Start the episode a request line asks for, or cancel one."""
        try:
            request = json.loads(line)
        except json.JSONDecodeError:
            request = None
        if not isinstance(request, dict) or not ({"id", "cancel"} & request.keys()):
            print(f"not a request: {line[:200]!r}", file=sys.stderr)
            return
        if "cancel" in request:
            task = self.playing.get(request["cancel"])
            if task is not None:
                task.cancel()
            return
        self.playing[request["id"]] = asyncio.create_task(self.play(request))


async def serve(args: argparse.Namespace, answers: TextIO) -> None:
    """Read requests until standard input closes; then cancel what is still in play."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with contextlib.AsyncExitStack() as stack:
        worker = Worker(args, answers, stack)
        while line := await reader.readline():  # b"" once tir-rl closes the pipe
            worker.handle(line.decode())
        for task in list(worker.playing.values()):
            task.cancel()
        await asyncio.gather(*worker.playing.values(), return_exceptions=True)


def main() -> None:
    """Import verifiers once, then serve."""
    args = parse_args()
    answers = answers_channel()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    vf_play.prepare_process_env()
    import verifiers.v1  # noqa: F401 (once, before the first episode)

    asyncio.run(serve(args, answers))


if __name__ == "__main__":
    main()
