"""Readable and JSONL forms of trajectories (`tir-rl rollout` prints them; also for debugging)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tir_rl.types import Message, Role, Trajectory

RULE = "─" * 78


def shorten(text: str, max_chars: int) -> str:
    """One line: newlines shown as ⏎, cut in the middle to `max_chars` (0: no limit)."""
    flat = text.replace("\r", "").replace("\n", "⏎")
    if max_chars <= 0 or len(flat) <= max_chars:
        return flat
    keep = max(max_chars - 5, 2)
    head = keep * 2 // 3
    return f"{flat[:head]} ... {flat[len(flat) - (keep - head) :]}"


def format_message(message: Message, *, max_chars: int) -> list[str]:
    """The lines describing one message: role, text, and each parsed tool call."""
    role = message.role.value
    if message.role == Role.TOOL and message.name:
        role = f"tool[{message.name}]"
    lines = [f"  {role:>10} │ {shorten(message.content, max_chars)}"]
    for call in message.tool_calls:
        args = json.dumps(call.arguments, ensure_ascii=False)
        lines.append(f"  {'':>10} │ → call {call.name}({shorten(args, max_chars)})")
    return lines


def format_trajectory(traj: Trajectory, *, index: int = 0, max_chars: int = 300) -> str:
    """A readable account of one episode: header, turns, and the token counts."""
    t = traj.timings
    num_turns = len(
        {turn for turn, mask in zip(traj.turn_ids, traj.loss_mask, strict=True) if mask}
    )
    header = (
        f"episode {index} │ group {traj.group_id} │ status {traj.status.value} │ "
        f"reward {traj.reward:g} │ turns {num_turns} │ tool calls {traj.num_tool_calls} "
        f"(errors {traj.num_tool_errors})"
    )
    rendered = len(traj.completion_ids) - traj.num_model_tokens
    tokens = (
        f"tokens: prompt {len(traj.prompt_ids)}, completion {len(traj.completion_ids)} "
        f"(sampled {traj.num_model_tokens}, rendered {rendered})"
        f" │ time: generate {t.generate_s:.2f} s, tools {t.tools_s:.2f} s, total {t.total_s:.2f} s"
    )
    lines = [RULE, header, tokens]
    if traj.error:
        lines.append(f"error: {traj.error}")
    for message in traj.messages:
        lines.extend(format_message(message, max_chars=max_chars))
    return "\n".join(lines)


def format_summary(trajs: Sequence[Trajectory]) -> str:
    """One paragraph over all episodes: statuses, mean reward, tokens, tool calls."""
    if not trajs:
        return "no episodes"
    statuses = Counter(t.status.value for t in trajs)
    n = len(trajs)
    mean_reward = sum(t.reward for t in trajs) / n
    sampled = sum(t.num_model_tokens for t in trajs)
    calls = sum(t.num_tool_calls for t in trajs)
    errors = sum(t.num_tool_errors for t in trajs)
    status_text = ", ".join(f"{k} {v}" for k, v in statuses.most_common())
    return (
        f"{n} episodes │ mean reward {mean_reward:.3f} │ statuses: {status_text}\n"
        f"sampled tokens {sampled} │ tool calls {calls} (errors {errors})"
    )


def write_jsonl(trajs: Sequence[Trajectory], path: str | Path) -> Path:
    """Write one JSON object per trajectory (`Trajectory.to_dict`); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for traj in trajs:
            f.write(json.dumps(traj.to_dict(), ensure_ascii=False) + "\n")
    return path
