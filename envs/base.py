"""`ToolEnv`: the gymnasium environment base class of tir-rl.

An episode is a conversation. ``reset`` returns the task's opening messages (system prompt
and question) and an info dict carrying the task and its tools (typed view:
``ResetInfo.from_info(info)``). ``step`` takes one assistant message whose tool calls the chat
module has already parsed (`Message.blocks`: the calls, and the error answering each block it
could not parse, in the order written; an env never reads tool-call syntax itself); its info
dict is viewed by ``StepInfo.from_info``:

* if it calls tools, the env runs them through its `ToolRegistry` (code tools in the
  episode's sandbox) and returns one tool message per call; a model mistake (unknown tool,
  bad arguments, malformed call, a tool that raised) becomes an error tool message, never
  an exception;
* otherwise it is the final turn: the env reads the answer (see `tir_rl.envs.answers`),
  scores it and terminates. A turn with neither a tool call nor an answer gets a user nudge
  (up to ``Config.max_nudges`` times) and then terminates with reward 0.

Subclasses implement `build_tools`, `generate_task`, `instructions` and `score`; see
``docs/environments.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gymnasium
from gymnasium.error import ResetNeeded

from tir_rl.envs.answers import ExtractedAnswer, extract_answer
from tir_rl.envs.episode import (
    AssistantMessageSpace,
    MessagesSpace,
    ResetInfo,
    Reward,
    Split,
    StepInfo,
    Task,
    task_index,
)
from tir_rl.envs.sandbox_handle import LazySandbox
from tir_rl.errors import ConfigError, SandboxError, closest
from tir_rl.types import Message, Role, ToolCall, ToolErrorKind, ToolResult

if TYPE_CHECKING:
    from tir_rl.sandbox.base import Sandbox
    from tir_rl.tools import ToolRegistry

SandboxFactory = Callable[[], AbstractContextManager["Sandbox"]]
"""Opens one episode's sandbox; default `tir_rl.sandbox.open_episode`."""

NUDGE = (
    "You did not call a tool and gave no final answer. Either call a tool, or reply with "
    "your final answer inside <answer></answer> tags."
)
"""The user message sent after a turn with neither a tool call nor an answer."""


_Z99 = 2.3263478740408408
"""The standard normal's 99th percentile: a lognormal's p99 is its median · exp(σ · _Z99)."""


class ToolEnv(gymnasium.Env[list[Message], Message]):
    """Base class of tool-use environments (one instance per concurrent episode).

    ``reset`` and ``step`` may block (sandbox calls); they are safe to call from a worker
    thread, and an instance serializes its own calls with a lock.
    """

    @dataclass(kw_only=True)
    class Config:
        """Settings shared by every ToolEnv; subclasses extend it."""

        split: str = "train"
        """Task pool: "train" or "test" (disjoint)."""
        num_tasks: int | None = None
        """Restrict the pool to task indices ``0..num_tasks-1`` (e.g. a fixed eval set)."""
        max_turns: int | None = None
        """Truncate after this many assistant turns (None: leave it to the rollout loop)."""
        max_nudges: int = 1
        """How often a turn without tool call or answer is answered by a nudge before the
        episode ends with reward 0."""
        format_reward: float = 0.0
        """Bonus added to the reward when the final answer uses the ``<answer>`` tag."""
        tool_latency_median_s: float = 0.0
        """Simulated tool latency, for benchmarks: every turn with tool calls waits a
        lognormal delay with this median before the results come back (0: none). Real tools
        (web, sandboxes, APIs) are heavy-tailed; in-process tools answer in microseconds."""
        tool_latency_p99_s: float = 0.0
        """The simulated delay's 99th percentile (>= the median); sets the tail."""

        def validate(self) -> None:
            """Check values; raise `ConfigError` naming the bad field."""
            if self.split not in tuple(Split):
                raise ConfigError(f"split={self.split!r}: choose 'train' or 'test'")
            median, p99 = self.tool_latency_median_s, self.tool_latency_p99_s
            if median < 0 or (median > 0 and p99 < median):
                raise ConfigError(
                    f"tool_latency_median_s={median}, tool_latency_p99_s={p99}: the median "
                    "must be >= 0 and the 99th percentile at least the median"
                )
            for name in ("num_tasks", "max_turns"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ConfigError(f"{name}={value}: must be at least 1 (or None)")
            if self.max_nudges < 0:
                raise ConfigError(f"max_nudges={self.max_nudges}: must be >= 0")

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's class attribute)
    observation_space = MessagesSpace()
    action_space = AssistantMessageSpace()

    def __init__(
        self,
        config: Config | None = None,
        *,
        sandbox_factory: SandboxFactory | None = None,
        **overrides: Any,
    ) -> None:
        """Build the environment.

        Args:
            config: The full config; defaults to ``type(self).Config()``.
            sandbox_factory: Opens the episode's sandbox on the first sandboxed tool call
                (default: `tir_rl.sandbox.open_episode`).
            **overrides: Config fields to change, as ``gymnasium.make`` passes them
                (``gymnasium.make("tir_rl/MathPython-v0", split="test")``).
        """
        self.config = _with_overrides(config or type(self).Config(), overrides)
        self.config.validate()
        self.split = Split(self.config.split)
        self._sandbox_factory = sandbox_factory
        self._lock = threading.RLock()
        self._tools: ToolRegistry | None = None
        self._sandbox: LazySandbox | None = None
        self._task: Task | None = None
        self._turn = 0
        self._nudges = 0
        self._done = False

    # ----------------------------------------------------------------- subclass hooks
    def build_tools(self) -> ToolRegistry:
        """The environment's tools (called once, on first use)."""
        raise NotImplementedError

    def generate_task(self, index: int) -> Task:
        """The task with this index in ``self.split``; deterministic in `index`."""
        raise NotImplementedError

    def instructions(self, task: Task) -> str:
        """The system prompt; it must state the answer protocol (see `ANSWER_INSTRUCTIONS`)."""
        raise NotImplementedError

    def score(self, task: Task, answer: str) -> float:
        """Correctness of `answer` for `task`, in [0, 1]."""
        raise NotImplementedError

    def shaping(self, task: Task) -> float:
        """Progress bonus added to the final reward (default 0)."""
        return 0.0

    def on_reset(self, task: Task) -> None:
        """Hook run when an episode starts (e.g. to load the task's state)."""

    def demonstration(self, task: Task) -> list[Message]:
        """Assistant turns of a correct episode for `task` (an oracle, for SFT warm starts).

        One assistant `Message` per turn: tool calls as `tool_calls` (the chat format writes
        them as the model would), the last turn's content with the ``<answer>`` tag. Played
        through ``step`` they must earn the full reward. See `tir_rl.lab.sft`.

        Raises:
            NotImplementedError: The environment has no oracle (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} has no demonstration oracle")

    # ----------------------------------------------------------------- gymnasium API
    @property
    def tools(self) -> ToolRegistry:
        """The environment's tool registry."""
        if self._tools is None:
            self._tools = self.build_tools()
        return self._tools

    @property
    def task(self) -> Task | None:
        """The current episode's task (None before the first reset)."""
        return self._task

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode: the task comes from ``options["task_index"]`` or the seed."""
        with self._lock:
            super().reset(seed=seed)
            self._close_sandbox()
            index = task_index(options, self.np_random, self.config.num_tasks)
            task = self.generate_task(index)
            self._task, self._turn, self._nudges, self._done = task, 0, 0, False
            self._sandbox = LazySandbox(self._resolve_factory())
            self.on_reset(task)
            messages = [Message.system(self.instructions(task)), Message.user(task.question)]
            info = ResetInfo(task.id, task.split, task.difficulty, self.tools, task)
            return messages, info.to_info()

    def step(self, action: Message) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        """Handle one assistant turn (see the module docstring)."""
        with self._lock:
            if self._task is None or self._done:
                raise ResetNeeded("call reset() before step() (and again after the episode ended)")
            if not isinstance(action, Message) or action.role != Role.ASSISTANT:
                raise TypeError(f"step() takes an assistant Message, got {action!r}")
            self._turn += 1
            truncated = self.config.max_turns is not None and self._turn >= self.config.max_turns
            calls = action.blocks
            if calls:
                with self._bind_sandbox():
                    results = tuple(self._run_call(call) for call in calls)
                self._simulate_latency()
                messages = [Message.tool(r.content, name=r.name or None) for r in results]
                self._done = truncated
                return messages, 0.0, False, truncated, StepInfo(self._turn, results).to_info()
            extracted = extract_answer(action.content)
            if extracted is None and self._nudges < self.config.max_nudges and not truncated:
                self._nudges += 1
                nudge = StepInfo(self._turn, nudged=True).to_info()
                return [Message.user(NUDGE)], 0.0, False, False, nudge
            reward = self._reward(self._task, extracted)
            self._done = True
            info = StepInfo(self._turn, answer=extracted and extracted.text, reward=reward)
            return [], reward.total, True, False, info.to_info()

    def close(self) -> None:
        """End the episode's sandbox, if one was opened; safe to call repeatedly."""
        with self._lock:
            self._close_sandbox()

    # ----------------------------------------------------------------- internals
    def _simulate_latency(self) -> None:
        """Sleep a lognormal delay drawn from `Config.tool_latency_median_s` and `_p99_s`.

        Unseeded on purpose: the samples of one group share their task's seed, and real
        latencies do not.
        """
        median, p99 = self.config.tool_latency_median_s, self.config.tool_latency_p99_s
        if median > 0:
            sigma = math.log(p99 / median) / _Z99
            time.sleep(random.lognormvariate(math.log(median), sigma))

    def _reward(self, task: Task, extracted: ExtractedAnswer | None) -> Reward:
        if extracted is None:
            return Reward(correct=0.0, shaping=self.shaping(task))
        correct = float(self.score(task, extracted.text))
        assert math.isfinite(correct), f"{type(self).__name__}.score returned {correct}"
        fmt = self.config.format_reward if extracted.tagged else 0.0
        return Reward(correct=correct, format=fmt, shaping=self.shaping(task))

    def _run_call(self, call: ToolCall | ToolResult) -> ToolResult:
        if isinstance(call, ToolResult):  # a block the chat parser could not read
            return call
        try:
            return self.tools.call(call.name, call.arguments, sandbox=self._sandbox)
        except Exception as exc:  # noqa: BLE001 (the registry should not raise; stay alive)
            kind = (
                ToolErrorKind.SANDBOX
                if isinstance(exc, SandboxError)
                else ToolErrorKind.TOOL_RAISED
            )
            return ToolResult(call.name, f"Error: {type(exc).__name__}: {exc}", error=kind)

    def _bind_sandbox(self) -> AbstractContextManager[Any]:
        """Bind the episode's sandbox for the `python` tool (it reads a context variable).

        If `tir_rl.tools.python` was never imported, no tool can be using it.
        """
        module = sys.modules.get("tir_rl.tools.python")
        if module is None or self._sandbox is None:
            return contextlib.nullcontext()
        return module.use_sandbox(self._sandbox)

    def _resolve_factory(self) -> SandboxFactory:
        if self._sandbox_factory is not None:
            return self._sandbox_factory

        def default_factory() -> AbstractContextManager[Sandbox]:
            from tir_rl.sandbox import open_episode  # lazy: only code tools need Docker

            return open_episode()

        return default_factory

    def _close_sandbox(self) -> None:
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            sandbox.close()


def _with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    if not overrides:
        return config
    names = {f.name for f in dataclasses.fields(config)}
    for key in overrides:
        if key not in names:
            near = closest(key, sorted(names))
            hint = f"; did you mean {near!r}?" if near else f"; valid: {sorted(names)}"
            raise ConfigError(f"{type(config).__qualname__} has no field {key!r}{hint}")
    return dataclasses.replace(config, **overrides)
