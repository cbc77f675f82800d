"""Soak: 100 rollout episodes with faults injected at random; does the run survive, clean?

Real parts: vLLM on the tiny model, the Docker sandbox, the rollout loop, the Hermes parser.
The tiny model writes no tool calls, so `FaultScriptEngine` (a fake around the real engine,
named as such) replaces each sampled turn with the turn the episode's script asks for; the
real engine still runs every request, and the `engine_error` fault sends it one request it
really rejects. Each episode draws one fault (or none) from a seeded RNG:

=================  =========================================================================
fault              what happens
=================  =========================================================================
hang               a tool that sleeps past ``tool_call_timeout_s``
raise              a tool that raises
big_result         a tool that returns 1 MB
kill_container     the episode's sandbox container is ``docker kill``ed from outside between
                   two python calls (the container's hostname travels in the tool result)
engine_error       vLLM rejects the episode's request (a prompt beyond ``max_model_len``)
malformed_call     a ``<tool_call>`` block that is not JSON
=================  =========================================================================

The soak runs in a child process; the parent counts what the child left behind after it
exited: sandbox containers (by the owner label), engine processes (by
``TIR_RL_ENGINE_OWNER``) and the engine's watchdog. Usage::

    nice -n 19 .venv/bin/python bench/soak.py [--episodes 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FAULTS = ("hang", "raise", "big_result", "kill_container", "engine_error", "malformed_call")
FAULT_SHARE = 0.4
"""Share of episodes that get a fault; the others are the control group."""
TOOL_TIMEOUT_S = 5.0
_MARK = re.compile(r"\[fault=(\w+)\]")
_HOST = re.compile(r"HOST=([0-9a-f]{12})")


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PRINT_42 = _call("python", {"code": "print(6 * 7)"})
ANSWER = "<answer>42</answer>"
SCRIPTS = {
    "none": [PRINT_42, ANSWER],
    "hang": [_call("hang", {}), ANSWER],
    "raise": [_call("boom", {}), ANSWER],
    "big_result": [_call("big", {}), ANSWER],
    "kill_container": [
        _call("python", {"code": "import socket; print('HOST=' + socket.gethostname())"}),
        PRINT_42,
        ANSWER,
    ],
    "engine_error": [PRINT_42, ANSWER],
    "malformed_call": ['<tool_call>\n{"name": "python", "arguments": \n</tool_call>', ANSWER],
}
"""The assistant turns of each episode, by its fault."""


def build_env_class():  # noqa: ANN201 (imports tir_rl lazily: the parent process never does)
    from tir_rl.envs import Task, ToolEnv
    from tir_rl.envs.answers import ANSWER_INSTRUCTIONS
    from tir_rl.tools import ToolRegistry, tool
    from tir_rl.tools.python import python

    @tool(timeout_s=3600)
    def hang() -> str:
        """Never returns (in time)."""
        time.sleep(3600)
        return "late"

    @tool
    def boom() -> str:
        """Raises."""
        raise RuntimeError("boom: the tool failed")

    @tool
    def big() -> str:
        """Returns 1 MB."""
        return "x" * (1 << 20)

    class SoakEnv(ToolEnv):
        """Asks for 6*7; the task's fault is written into the question for the script."""

        def build_tools(self) -> ToolRegistry:
            return ToolRegistry([python, hang, boom, big])

        def generate_task(self, index: int) -> Task:
            rng = random.Random(index)
            fault = rng.choice(FAULTS) if rng.random() < FAULT_SHARE else "none"
            question = f"Episode {index} [fault={fault}]. What is 6 * 7?"
            return Task(f"soak/{index}", question, "42", self.split, 1, {"fault": fault})

        def instructions(self, task: Task) -> str:
            return "Use the tools. " + ANSWER_INSTRUCTIONS

        def score(self, task: Task, answer: str) -> float:
            return float(answer.strip() == task.answer)

    return SoakEnv


class FaultScriptEngine:
    """Fake around a real engine: runs each request on it, returns the scripted turn instead."""

    def __init__(self, engine, tokenizer) -> None:  # noqa: ANN001
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_info = engine.model_info
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.killed: list[str] = []

    async def generate(self, request):  # noqa: ANN001, ANN201
        from dataclasses import replace

        from tir_rl.engine.base import FinishReason, GenerateResult

        prompt = self.tokenizer.decode(request.prompt_token_ids)
        fault = _MARK.search(prompt).group(1)
        turn = prompt.count("<|im_start|>assistant") - 1
        if fault == "engine_error":  # a request vLLM itself rejects
            too_long = [*request.prompt_token_ids] * (self.model_info.max_model_len // 8)
            request = replace(request, prompt_token_ids=too_long)
        if fault == "kill_container" and turn == 1:
            host = _HOST.search(prompt).group(1)
            kill = subprocess.run(["docker", "kill", host], capture_output=True, check=False)
            if kill.returncode == 0:
                self.killed.append(host)
        await self.engine.generate(replace(request, max_tokens=min(request.max_tokens, 8)))
        script = SCRIPTS[fault]
        text = script[min(turn, len(script) - 1)]
        ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.im_end]
        return GenerateResult(
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            policy_versions=[0] * len(ids),
            finish_reason=FinishReason.STOP,
        )


@dataclass(frozen=True)
class SoakResult:
    """What the child reports: one row per episode, and whether the run survived."""

    rows: list[tuple[str, str, float]]
    """(fault, status, reward) per episode."""
    survived: bool
    num_killed: int
    """Containers the kill_container fault really killed."""
    owner: str
    sandbox_owner: str


def run_child(num_episodes: int, seed: int) -> None:
    """Play the episodes; print one JSON line (`SoakResult`) on stdout."""
    from transformers import AutoTokenizer

    from tir_rl.engine.reaping import owner_id
    from tir_rl.engine.vllm_local import VLLMLocalEngine
    from tir_rl.models import prepare_tiny_model
    from tir_rl.rollout import EpisodeSpec, Rollout
    from tir_rl.sandbox import shutdown
    from tir_rl.sandbox.docker import owner_id as sandbox_owner_id

    model = prepare_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    env_class = build_env_class()
    engine = VLLMLocalEngine(VLLMLocalEngine.Config(model_path=str(model), kv_cache_gib=0.25))
    survived = True
    rows: list[tuple[str, str, float]] = []
    scripted = FaultScriptEngine(engine, tokenizer)
    try:
        config = Rollout.Config(
            max_turns=4, tool_call_timeout_s=TOOL_TIMEOUT_S, max_concurrent_episodes=8
        )
        rollout = Rollout(scripted, tokenizer, config)
        specs = [
            EpisodeSpec(env_factory=env_class, options={"task_index": seed * 100_000 + i},
                        group_id=i)
            for i in range(num_episodes)
        ]  # fmt: skip
        trajectories = rollout.run_batch_sync(specs)
        for spec, traj in zip(specs, trajectories, strict=True):
            fault = env_class().generate_task(spec.options["task_index"]).data["fault"]
            rows.append((fault, traj.status.value, traj.reward))
            if traj.error and fault == "none":
                print(f"control episode {spec.group_id}: {traj.error}", file=sys.stderr)
        asyncio.run(_still_serves(engine))
    except Exception as exc:  # noqa: BLE001 (the run did not survive: report it)
        print(f"run died: {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    finally:
        engine.close()
        shutdown()
    result = SoakResult(rows, survived, len(scripted.killed), owner_id(), sandbox_owner_id())
    print(json.dumps(result.__dict__))


async def _still_serves(engine) -> None:  # noqa: ANN001
    from tir_rl.engine.base import GenerateRequest

    out = await engine.generate(GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4))
    assert out.token_ids, "the engine no longer samples"


def leaked(result: SoakResult) -> tuple[int, int]:
    """(sandbox containers, engine processes) the exited child left behind."""
    from tir_rl.engine.reaping import engine_processes
    from tir_rl.sandbox.docker import LABEL_OWNER

    time.sleep(3.0)  # the engine watchdog's grace, had the child left anything
    listed = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={LABEL_OWNER}={result.sandbox_owner}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    watchdogs = [
        cmdline
        for cmdline in Path("/proc").glob("[0-9]*/cmdline")
        if _read(cmdline).endswith(f"tir_rl.engine.reaping\0{result.owner}\0")
    ]
    return len(listed), len(engine_processes(owner=result.owner)) + len(watchdogs)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def print_table(result: SoakResult, containers: int, processes: int, seconds: float) -> None:
    """The per-fault table (markdown), as pasted into docs/reliability.md."""
    by_fault: dict[str, Counter] = {}
    for fault, status, reward in result.rows:
        counts = by_fault.setdefault(fault, Counter())
        counts["episodes"] += 1
        counts["solved"] += status == "finished" and reward == 1.0
        counts[status] += 1
    print(f"{len(result.rows)} episodes in {seconds:.0f} s; {result.num_killed} containers killed")
    print("| fault | episodes | solved | how they ended | control episodes "
          "lost | run survived | leaked containers | leaked processes |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for fault in ("none", *FAULTS):
        counts = by_fault.get(fault, Counter())
        endings = ", ".join(
            f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("episodes", "solved")
        )
        # only the control group can lose episodes beyond the faulted ones
        lost = counts["episodes"] - counts["solved"] if fault == "none" else "-"
        print(
            f"| {fault} | {counts['episodes']} | {counts['solved']} | {endings} | {lost} | "
            f"{'yes' if result.survived else 'no'} | {containers} | {processes} |"
        )


def main() -> None:
    """Run the soak in a child process, then count what it leaked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.episodes, args.seed)
        return
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, __file__, "--child", f"--episodes={args.episodes}", f"--seed={args.seed}"],
        stdout=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        sys.exit(f"the soak process failed (exit {child.returncode}); see its log above")
    result = SoakResult(**json.loads(lines[-1]))
    containers, processes = leaked(result)
    print_table(result, containers, processes, seconds)


if __name__ == "__main__":
    main()
