"""`check_env`: does an environment follow the ToolEnv API? (like gymnasium's ``check_env``).

Run it on a new environment before training with it::

    from tir_rl.envs import check_env
    check_env(MyEnv())

It raises `EnvironmentSpecError` with the first violation found. It never opens a sandbox:
the probe turns are a final answer, an unknown tool, a malformed call and invalid arguments.
Last it runs Gymnasium's own ``gymnasium.utils.env_checker.check_env`` on the unwrapped env,
so an env that passes here also works with Gymnasium's wrappers (infos are dicts).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import warnings
from typing import Any

import gymnasium
import numpy as np
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from tir_rl.envs.episode import ResetInfo, Split, StepInfo
from tir_rl.errors import EnvironmentSpecError
from tir_rl.types import Message, Role, ToolCall, ToolErrorKind, ToolResult

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_SUCH_TOOL = "check_env_no_such_tool"
_MALFORMED_BLOCK_REPLY = "check_env: this tool-call block is not valid JSON"
"""What the chat format would answer for the malformed-call probe (the env must pass it on)."""


def check_env(env: gymnasium.Env, *, seed: int = 0) -> None:
    """Check `env` against the ToolEnv API; raise `EnvironmentSpecError` with the reason.

    Args:
        env: The environment (a `ToolEnv`, possibly wrapped by ``gymnasium.make``).
        seed: Seed for the probe episodes.

    Raises:
        EnvironmentSpecError: The first violation, with what was expected and what was found.
    """
    inner = getattr(env, "unwrapped", env)
    name = type(inner).__name__
    if not isinstance(inner, gymnasium.Env):
        raise EnvironmentSpecError(f"{name} is not a gymnasium.Env (subclass tir_rl.envs.ToolEnv)")
    _check_reset_signature(env, name)
    messages, raw_info = _reset(env, name, seed)
    _check_prompt(messages, name)
    info = _check_reset_info(raw_info, name)
    _check_tool_schemas(info, name)
    again, raw_again = _reset(env, name, seed)
    info_again = ResetInfo.from_info(raw_again)
    if again != messages or info_again.task_id != info.task_id:
        raise EnvironmentSpecError(
            f"{name}.reset(seed={seed}) is not deterministic: two resets with the same seed gave "
            f"tasks {info.task_id!r} and {info_again.task_id!r} (draw the task from "
            "self.np_random after super().reset(seed=seed))"
        )
    if len({_reset(env, name, seed + k)[1]["task_id"] for k in range(4)}) == 1:
        warnings.warn(f"{name}: four different seeds all gave the same task", stacklevel=2)

    probes = {
        "a final answer": Message.assistant("<answer>check_env</answer>"),
        "a call of an unknown tool": Message.assistant("", [ToolCall(_NO_SUCH_TOOL, {})]),
        "a malformed tool call": Message.assistant(
            "<tool_call>{not json</tool_call>",
            call_blocks=[ToolResult("", _MALFORMED_BLOCK_REPLY, ToolErrorKind.MALFORMED_CALL)],
        ),
    }
    schemas = info.tool_schemas
    if schemas:
        tool = schemas[0]["function"]["name"]
        probes["a call with invalid arguments"] = Message.assistant(
            "", [ToolCall(tool, {"check_env_bogus_argument": [1, 2, 3]})]
        )
    for what, action in probes.items():
        _reset(env, name, seed)
        result = _step(env, name, action, what)
        if action.blocks:
            replies = result[0]
            if not any(m.role == Role.TOOL for m in replies):
                raise EnvironmentSpecError(
                    f"{name}.step() answered {what} with {replies!r}: every tool call, even a "
                    "bad one, must get a tool message that tells the model what went wrong"
                )
    _check_close(env, name)
    try:
        gymnasium_check_env(inner, skip_render_check=True)
    except Exception as exc:
        raise EnvironmentSpecError(
            f"{name} fails gymnasium.utils.env_checker.check_env: {exc}"
        ) from exc


def _check_reset_signature(env: gymnasium.Env, name: str) -> None:
    params = inspect.signature(env.unwrapped.reset).parameters
    for param in ("seed", "options"):
        if param not in params or params[param].kind != inspect.Parameter.KEYWORD_ONLY:
            raise EnvironmentSpecError(
                f"{name}.reset must take keyword-only `{param}`: "
                "def reset(self, *, seed=None, options=None)"
            )


def _reset(env: gymnasium.Env, name: str, seed: int) -> tuple[list[Message], dict[str, Any]]:
    try:
        result = env.reset(seed=seed)
    except Exception as exc:
        raise EnvironmentSpecError(f"{name}.reset(seed={seed}) raised {exc!r}") from exc
    if not isinstance(result, tuple) or len(result) != 2:
        raise EnvironmentSpecError(
            f"{name}.reset() must return (messages, info), got {type(result).__name__}"
        )
    return result


def _check_prompt(messages: Any, name: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise EnvironmentSpecError(
            f"{name}.reset() must return a non-empty list of Message, got {messages!r}"
        )
    for message in messages:
        if not isinstance(message, Message):
            raise EnvironmentSpecError(
                f"{name}.reset() returned {type(message).__name__} in its messages; "
                "use tir_rl.types.Message (Message.system(...), Message.user(...))"
            )
        if message.role not in (Role.SYSTEM, Role.USER) or not message.content.strip():
            raise EnvironmentSpecError(
                f"{name}.reset() messages must be non-empty system/user messages, got "
                f"{message.role} {message.content[:60]!r}"
            )
    if messages[-1].role != Role.USER:
        raise EnvironmentSpecError(f"{name}.reset() messages must end with the user's question")


def _check_reset_info(raw_info: Any, name: str) -> ResetInfo:
    if not isinstance(raw_info, dict):
        raise EnvironmentSpecError(
            f"{name}.reset() info must be a dict (the Gymnasium API): return "
            f"ResetInfo(...).to_info(), got {type(raw_info).__name__}"
        )
    try:
        info = ResetInfo.from_info(raw_info)
    except EnvironmentSpecError as exc:
        raise EnvironmentSpecError(f"{name}.reset() info: {exc}") from exc
    if not isinstance(info.task_id, str) or not info.task_id:
        raise EnvironmentSpecError(f"{name}: ResetInfo.task_id must be a non-empty str")
    if info.split not in tuple(Split):
        raise EnvironmentSpecError(f"{name}: ResetInfo.split must be 'train' or 'test'")
    if not isinstance(info.difficulty, int) or isinstance(info.difficulty, bool):
        raise EnvironmentSpecError(f"{name}: ResetInfo.difficulty must be an int")
    return info


def _check_tool_schemas(info: ResetInfo, name: str) -> None:
    try:
        schemas = info.tool_schemas
        json.dumps(schemas)
    except Exception as exc:
        raise EnvironmentSpecError(
            f"{name}: the tools' JSON schemas are unusable: {exc!r}"
        ) from exc
    seen: set[str] = set()
    for schema in schemas:
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(schema, dict) or schema.get("type") != "function" or not function:
            raise EnvironmentSpecError(
                f"{name}: tool schema {schema!r} is not {{'type': 'function', 'function': ...}}"
            )
        tool = function.get("name")
        if not isinstance(tool, str) or not _TOOL_NAME.match(tool) or tool in seen:
            raise EnvironmentSpecError(
                f"{name}: tool name {tool!r} is missing, duplicated or not [A-Za-z0-9_-]{{1,64}}"
            )
        seen.add(tool)
        if not isinstance(function.get("description"), str) or not function["description"]:
            raise EnvironmentSpecError(f"{name}: tool {tool!r} has no description")
        params = function.get("parameters")
        if not isinstance(params, dict) or params.get("type") != "object":
            raise EnvironmentSpecError(
                f"{name}: tool {tool!r} parameters must be a JSON schema of type 'object'"
            )
        properties = params.get("properties", {})
        missing = set(params.get("required", [])) - set(properties)
        if not isinstance(properties, dict) or missing:
            raise EnvironmentSpecError(
                f"{name}: tool {tool!r} requires undeclared parameters {sorted(missing)}"
            )


def _step(env: gymnasium.Env, name: str, action: Message, what: str) -> tuple:
    try:
        result = env.step(action)
    except Exception as exc:
        raise EnvironmentSpecError(
            f"{name}.step() raised {exc!r} on {what}; model mistakes must become tool or user "
            "messages, never exceptions"
        ) from exc
    if not isinstance(result, tuple) or len(result) != 5:
        raise EnvironmentSpecError(
            f"{name}.step() must return (messages, reward, terminated, truncated, info)"
        )
    messages, reward, terminated, truncated, info = result
    if not isinstance(messages, list) or not all(isinstance(m, Message) for m in messages):
        raise EnvironmentSpecError(f"{name}.step() messages must be a list of Message")
    if any(m.role not in (Role.TOOL, Role.USER) for m in messages):
        raise EnvironmentSpecError(f"{name}.step() may only return tool or user messages")
    is_number = isinstance(reward, (int, float, np.floating, np.integer))
    if isinstance(reward, (bool, np.bool_)) or not is_number or not math.isfinite(reward):
        raise EnvironmentSpecError(
            f"{name}.step() reward must be a finite float, got {reward!r} on {what}"
        )
    for flag, value in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(value, (bool, np.bool_)):
            raise EnvironmentSpecError(
                f"{name}.step() `{flag}` must be a bool, got {type(value).__name__}"
            )
    if not isinstance(info, dict):
        raise EnvironmentSpecError(
            f"{name}.step() info must be a dict (the Gymnasium API): return "
            f"StepInfo(...).to_info(), got {type(info).__name__}"
        )
    try:
        StepInfo.from_info(info)
    except EnvironmentSpecError as exc:
        raise EnvironmentSpecError(f"{name}.step() info: {exc}") from exc
    return result


def _check_close(env: gymnasium.Env, name: str) -> None:
    for attempt in ("first", "second"):
        try:
            env.close()
        except Exception as exc:
            raise EnvironmentSpecError(
                f"{name}.close() raised {exc!r} on the {attempt} call; close must be idempotent"
            ) from exc
