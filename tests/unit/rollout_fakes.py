"""Fakes for agent-loop unit tests: a scripted engine and a tool env with controllable tools.

`FakeEngine` answers each `GenerateRequest` with scripted text for (episode, turn): the
episode is read from the prompt (the env's user message says ``episode K``), the turn is
the number of assistant headers in the prompt minus one. It honours `max_tokens`, stop ids
and stop sequences like a real engine, and records every request and result.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tir_rl.engine.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    SingleEngine,
    truncate_at_stop_sequence,
)
from tir_rl.envs.answers import ANSWER_INSTRUCTIONS
from tir_rl.envs.base import StepInfo, Task, ToolEnv
from tir_rl.errors import SandboxError
from tir_rl.tools import ToolRegistry, tool
from tir_rl.types import Message, ToolErrorKind, ToolResult

ANSWER = "<answer>42</answer>"
UNICODE_TEXT = "Größe ✓ naïve 日本語 🙂 — done"


def call(name: str, **arguments: Any) -> str:
    """Assistant text of one Hermes tool call."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass
class Reply:
    """One scripted assistant turn."""

    text: str
    end: bool = True
    """Append `<|im_end|>` (False: the turn runs on, e.g. to hit the token limit)."""


Script = Callable[[int, int], "Reply | str | Exception"]


@dataclass
class EventLog:
    """Thread-safe, ordered record of what happened (engine calls, tool starts/ends)."""

    events: list[tuple] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *event: Any) -> None:
        with self._lock:
            self.events.append(tuple(event))

    def index(self, *event: Any) -> int:
        with self._lock:
            return self.events.index(tuple(event))


class FakeEngine(SingleEngine):
    """Scripted engine: replies keyed by (episode, turn); see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        script: Script,
        *,
        max_model_len: int = 4096,
        log: EventLog | None = None,
        on_generate: Callable[[int, int], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.log = log or EventLog()
        self.on_generate = on_generate
        self.requests: list[tuple[int, int, GenerateRequest]] = []
        self.results: dict[tuple[int, int], GenerateResult] = {}
        self._info = ModelInfo(
            model_path="fake",
            dtype="float32",
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
        )
        self._im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.policy_version = 0
        """Label of every token sampled now; `update_weights(..., version=v)` sets it."""

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    async def update_weights(self, state_dict: Any, *, version: int | None = None) -> None:
        self.log.add("update_weights", version)
        if version is not None:
            self.policy_version = version

    def identify(self, prompt: list[int]) -> tuple[int, int]:
        text = self.tokenizer.decode(prompt)
        episode = int(re.search(r"episode (\d+)", text).group(1))
        return episode, text.count("<|im_start|>assistant") - 1

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        request.validate()
        episode, turn = self.identify(list(request.prompt_token_ids))
        self.requests.append((episode, turn, request))
        self.log.add("generate", episode, turn)
        if self.on_generate is not None:
            self.on_generate(episode, turn)
        await asyncio.sleep(0)  # a real engine yields while it computes
        reply = self.script(episode, turn)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, str):
            reply = Reply(reply)
        ids = self.tokenizer(reply.text, add_special_tokens=False)["input_ids"]
        ids = ids + ([self._im_end] if reply.end else [])
        logprobs = [-(1 + episode * 100 + turn * 10 + k) / 1000 for k in range(len(ids))]
        finish = FinishReason.LENGTH
        for k, token in enumerate(ids):
            if token in request.stop_token_ids:
                ids, logprobs, finish = ids[: k + 1], logprobs[: k + 1], FinishReason.STOP
                break
        ids, logprobs, seq = truncate_at_stop_sequence(ids, logprobs, request.stop_token_sequences)
        if seq is not None:
            finish = FinishReason.STOP
        if len(ids) > request.max_tokens:
            ids, logprobs, finish = (
                ids[: request.max_tokens],
                logprobs[: request.max_tokens],
                (FinishReason.LENGTH),
            )
        result = GenerateResult(
            token_ids=ids,
            logprobs=logprobs,
            policy_versions=[self.policy_version] * len(ids),
            finish_reason=finish,
        )
        self.results[(episode, turn)] = result
        return result


class FakeToolEnv(ToolEnv):
    """Task K asks ``episode K``; tools: echo, explode (raises), hang, wait_for (an event).

    Turns whose text contains ``CRASH_ENV`` make `step` raise (an env bug), ``SANDBOX_DOWN``
    makes it raise `SandboxError`, ``SANDBOX_RESULT`` returns a sandbox-failure tool result.
    """

    def __init__(
        self,
        *,
        log: EventLog | None = None,
        release: threading.Event | None = None,
        active: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.log = log or EventLog()
        self.release = release or threading.Event()
        self.active = active

    def build_tools(self) -> ToolRegistry:
        log, release = self.log, self.release

        @tool
        def echo(text: str) -> str:
            """Return the text unchanged.

            Args:
                text: anything
            """
            return text

        @tool
        def explode() -> str:
            """Always fails."""
            raise RuntimeError("the explode tool exploded")

        @tool(timeout_s=3600)
        def wait_for_release() -> str:
            """Block until the test releases it (at most 20 s)."""
            log.add("tool_start")
            released = release.wait(timeout=20)
            log.add("tool_end")
            return "released" if released else "never released"

        return ToolRegistry([echo, explode, wait_for_release])

    def generate_task(self, index: int) -> Task:
        return Task(f"fake/{index}", f"episode {index}", "42", self.split, 1)

    def instructions(self, task: Task) -> str:
        return "You are a test agent. " + ANSWER_INSTRUCTIONS

    def score(self, task: Task, answer: str) -> float:
        return float(answer.strip() == task.answer)

    def reset(self, *, seed=None, options=None):
        out = super().reset(seed=seed, options=options)
        if self.active is not None:
            self.active.append(+1)
        return out

    def close(self) -> None:
        if self.active is not None and self._task is not None:
            self.active.append(-1)
            self._task = None
        super().close()

    def step(self, action: Message):
        if "CRASH_ENV" in action.content:
            raise RuntimeError("bug in the environment")
        if "SANDBOX_DOWN" in action.content:
            raise SandboxError("no sandbox container available")
        if "SANDBOX_RESULT" in action.content:
            result = ToolResult("python", "the sandbox crashed", error=ToolErrorKind.SANDBOX)
            info = StepInfo(1, (result,)).to_info()
            return [Message.tool(result.content)], 0.0, False, False, info
        return super().step(action)


def max_active(active: list[int]) -> int:
    """Most episodes open at once, from a list of +1 (reset) / -1 (close) marks."""
    level = peak = 0
    for mark in active:
        level += mark
        peak = max(peak, level)
    return peak
