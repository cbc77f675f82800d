"""Play tasks of a verifiers environment through tir-rl's chat endpoint.

Shared by the per-episode `play_one.py` and the long-lived `worker.py`; runs in
`.venv-verifiers`. verifiers does everything inside an episode as in its own `eval`: `load`
builds the environment (`--env`, default this folder's `vf_reverse`) for one split with its
built-in `null` harness (its chat program, which runs the tool loop when the task has
toolsets) on the `subprocess` runtime; `play` runs one task whose calls go through
verifiers' interception server and its eval client to the episode's base URL
(`.../episodes/<id>/v1`, so tir-rl records every call of the episode under it), and
verifiers scores the trace with the task's rubric.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KEY_VARIABLE = "TIR_RL_ENDPOINT_KEY"
"""Where tir-rl puts the endpoint's API key (the model name is not checked)."""


class EpisodeFailed(RuntimeError):
    """verifiers recorded errors on the episode or its trace."""


def prepare_process_env() -> None:
    """Put this venv's `uv` on PATH, its cache in the venv, this folder on sys.path.

    verifiers prepares its chat program with `uv` (installing one under ~/.local when none is
    on PATH); `scripts/setup_verifiers.sh` already synced the program into that cache. It
    starts an environment's tool servers as ``python -m <module>``, so this folder goes on
    PYTHONPATH too.
    """
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("UV_CACHE_DIR", str(Path(sys.prefix) / "uv-cache"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p
    )
    sys.path.insert(0, str(HERE))


def load(env_id: str, split: str, num_tasks: int) -> tuple[Any, list[Any]]:
    """The environment of `split` and its tasks, in order."""
    import verifiers.v1 as vf

    config = vf.SingleAgentEnvConfig(
        taskset={"id": env_id, "split": split, "num_tasks": num_tasks},
        agent={"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    )
    env = vf.load_environment(config)
    return env, list(env.taskset)


async def play(env: Any, tasks: list[Any], index: int, base_url: str) -> dict[str, Any]:
    """Play task `index` against `base_url` (inside `env.serving()`); what verifiers recorded.

    Raises:
        EpisodeFailed: verifiers recorded errors, or the index is outside the split.
    """
    import verifiers.v1 as vf

    if not 0 <= index < len(tasks):
        raise EpisodeFailed(f"task index {index} is outside the split's {len(tasks)} tasks")
    client = vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE)
    episode = await env.run_episode(tasks[index], vf.ModelContext(model="policy", client=client))
    if not episode.ok or len(episode.traces) != 1:
        errors = [e.message for e in episode.errors] + [
            e.message for trace in episode.traces for e in trace.errors
        ]
        raise EpisodeFailed(f"the verifiers episode failed: {errors}")
    (trace,) = episode.traces
    return {
        "index": index,
        "reward": trace.reward,
        "rewards": {k: v.model_dump() for k, v in trace.rewards.items() if v is not None},
        "reply": trace.last_reply,
        "num_calls": len(trace.calls),
        "turns": [
            {
                "content": message.content,
                "tool_calls": [
                    {"name": call.name, "arguments": call.arguments}
                    for call in message.tool_calls or ()
                ],
            }
            for message in trace.assistant_messages
        ],
    }


def episode_id(base_url: str) -> str:
    """The endpoint's episode key in an episode base URL (`.../episodes/<id>/v1`)."""
    return base_url.rstrip("/").split("/")[-2]
