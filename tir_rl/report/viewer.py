"""Trajectory viewer: episodes as one static, self-contained HTML page.

Each episode shows its status, reward and turns; each turn its model tokens, the chat-format
and tool-response tokens that follow (greyed), the tool calls the model made and the results
it saw. Every model token (loss mask 1) is a span coloured by δ = trainer − sampler logprob on
a diverging scale (blue: the trainer finds the token less likely than the sampler did; red:
more likely), with a tooltip giving the token text, both logprobs and δ. Without trainer
logprobs tokens are coloured by sampler surprisal −log p instead, and the legend says so.
When the policy version the trainer updated from is known (`trained_versions`), a token
sampled by older weights is underlined by its lag (orange 1, red 2, purple 3+), and its
tooltip gives its version: staleness is seen beside the numerical gap.

Token text is decoded one id at a time (`tokenizer.decode([id])`), so what is shown is what
the model saw, token boundaries included; only a character that byte-level BPE split over
several tokens is shown whole on the token that completes it. Everything is HTML-escaped;
the page loads nothing.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tir_rl.report.viewer_style import (
    CSS,
    MIN_DELTA_SCALE,
    PAGE,
    SURPRISAL_SCALE,
    delta_color,
    lag_color,
    lag_legend,
    legend,
    surprisal_color,
)
from tir_rl.types import Message, Role, Trajectory

__all__ = ["delta_color", "render_html", "render_saved", "surprisal_color"]


class Decoder(Protocol):
    """The tokenizer method the viewer needs."""

    def decode(self, token_ids: list[int]) -> str:  # noqa: D102 (protocol)
        ...


@dataclass(frozen=True)
class _Coloring:
    trainer: bool
    """Colour by δ (else by sampler surprisal)."""
    scale: float
    trained_version: int | None = None
    """The version the trainer updated from (underline tokens by lag), if known."""


def render_html(
    trajectories: Sequence[Trajectory],
    tokenizer: Decoder,
    *,
    trainer_logprobs: Sequence[Sequence[float] | None] | None = None,
    title: str = "tir-rl trajectories",
    labels: Sequence[str] | None = None,
    delta_scale: float | None = None,
    trained_versions: Sequence[int | None] | None = None,
) -> str:
    """Render episodes as a self-contained HTML page.

    Args:
        trajectories: Episodes to show, in order.
        tokenizer: Anything with `decode(list[int]) -> str`.
        trainer_logprobs: Per trajectory, trainer logprobs aligned with `completion_ids`
            (None for all, or per trajectory: colour that one by sampler surprisal).
        title: Page title.
        labels: Optional caption per episode (e.g. "step 10").
        delta_scale: |δ| drawn at full colour (default: the largest |δ| on the page,
            at least `MIN_DELTA_SCALE`).
        trained_versions: Per trajectory, the policy version the trainer updated from (None
            for all, or per trajectory): tokens sampled by older weights are underlined.

    Returns:
        The HTML document.
    """
    if trainer_logprobs is not None and len(trainer_logprobs) != len(trajectories):
        raise ValueError(
            f"got {len(trainer_logprobs)} trainer logprob lists for {len(trajectories)} "
            "trajectories"
        )
    if labels is not None and len(labels) != len(trajectories):
        raise ValueError(f"got {len(labels)} labels for {len(trajectories)} trajectories")
    num = len(trajectories)
    versions = list(trained_versions) if trained_versions is not None else [None] * num
    if len(versions) != num:
        raise ValueError(f"got {len(versions)} trained versions for {num} trajectories")
    trainer = list(trainer_logprobs) if trainer_logprobs is not None else [None] * num
    for t, lp in zip(trajectories, trainer, strict=True):
        if lp is not None and len(lp) != len(t.completion_ids):
            raise ValueError(
                f"trainer logprobs have {len(lp)} entries for {len(t.completion_ids)} tokens"
            )
    max_abs = max(
        (abs(d) for t, lp in zip(trajectories, trainer, strict=True) for d in _deltas(t, lp)),
        default=0.0,
    )
    scale = delta_scale if delta_scale is not None else max(max_abs, MIN_DELTA_SCALE)
    any_trainer = any(lp is not None for lp in trainer)
    decode = _TokenCache(tokenizer)
    body = [
        f"<h1>{_e(title)}</h1>",
        legend(any_trainer, scale, all(lp is not None for lp in trainer)),
    ]
    if any(_lags(t, v) for t, v in zip(trajectories, versions, strict=True)):
        body.append(lag_legend())
    for i, (t, lp) in enumerate(zip(trajectories, trainer, strict=True)):
        coloring = _Coloring(
            lp is not None, scale if lp is not None else SURPRISAL_SCALE, versions[i]
        )
        label = labels[i] if labels is not None else ""
        body.append(_episode(i, t, lp, coloring, decode, label))
    return PAGE.format(title=_e(title), css=CSS, body="\n".join(body))


def render_saved(path: Path | str, tokenizer: Decoder, *, title: str | None = None) -> str:
    """Render a trajectories JSONL written by `tir_rl.report.run_log.save_trajectories`."""
    from tir_rl.report.run_log import load_trajectories

    saved = load_trajectories(path)
    return render_html(
        [s.trajectory for s in saved],
        tokenizer,
        trainer_logprobs=[s.trainer_logprobs for s in saved],
        title=title or f"tir-rl trajectories: {Path(path).name}",
        labels=[f"step {s.step}" for s in saved],
        trained_versions=[s.trained_version for s in saved],
    )


def _lags(t: Trajectory, trained_version: int | None) -> list[int]:
    """Lag of each model token with a recorded version (empty when unknown)."""
    if trained_version is None or not t.policy_versions:
        return []
    return [
        trained_version - v
        for v, m in zip(t.policy_versions, t.loss_mask, strict=True)
        if m and v >= 0
    ]


def _deltas(t: Trajectory, trainer: Sequence[float] | None) -> list[float]:
    if trainer is None:
        return []
    return [
        tr - s
        for tr, s, m in zip(trainer, t.sampler_logprobs, t.loss_mask, strict=True)
        if m and math.isfinite(tr - s)
    ]


class _TokenCache:
    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text

    def texts(self, token_ids: Sequence[int]) -> list[str]:
        """Per-token text; a character split over tokens goes to the token completing it.

        Byte-level BPE splits a multi-byte character (ö, ✓, 日) over up to 4 tokens, each of
        which decodes alone to U+FFFD. Such runs are decoded together: the last token gets the
        whole text and the earlier ones get "" (shown as thin hoverable spans).
        """
        texts: list[str] = []
        pending: list[int] = []
        for token_id in token_ids:
            text = self(token_id)
            if not pending and _REPLACEMENT not in text:
                texts.append(text)
                continue
            pending.append(token_id)
            joined = self.tokenizer.decode(pending)
            if _REPLACEMENT in joined and len(pending) < _MAX_CHAR_TOKENS:
                continue
            if _REPLACEMENT in joined:  # not a split character after all: show tokens as is
                texts.extend(self(i) for i in pending)
            else:
                texts.extend([""] * (len(pending) - 1) + [joined])
            pending = []
        texts.extend(self(i) for i in pending)
        return texts


_REPLACEMENT = "\ufffd"
_MAX_CHAR_TOKENS = 4


def _episode(
    index: int,
    t: Trajectory,
    trainer: Sequence[float] | None,
    coloring: _Coloring,
    decode: _TokenCache,
    label: str,
) -> str:
    prompt_messages, turn_messages = _split_messages(t.messages)
    deltas = _deltas(t, trainer)
    turns = _turn_blocks(t)
    facts = [
        f"reward {t.reward:.3f}",
        f"{len(turns)} turns",
        f"{t.num_tool_calls} tool calls ({t.num_tool_errors} errors)",
        f"{t.num_model_tokens} model tokens",
        f"group {t.group_id}",
    ]
    if deltas:
        facts.append(f"mean δ {sum(deltas) / len(deltas):+.4f}")
        facts.append(f"max |δ| {max(abs(d) for d in deltas):.4f}")
    lags = _lags(t, coloring.trained_version)
    if lags:
        facts.append(
            f"trained from version {coloring.trained_version}, lag {min(lags)}-{max(lags)}"
        )
    status_class = "bad" if t.status.is_error else ("ok" if t.status == "finished" else "warn")
    parts = [
        f'<section class="episode" id="episode-{index}">',
        f"<h2>Episode {index}{' · ' + _e(label) if label else ''} "
        f'<span class="status {status_class}">{_e(str(t.status))}</span></h2>',
        f'<p class="facts">{_e(" · ".join(facts))}</p>',
    ]
    if t.error:
        parts.append(f'<p class="error">{_e(t.error)}</p>')
    prompt_tokens = "".join(_plain(text) for text in decode.texts(t.prompt_ids))
    texts = decode.texts(t.completion_ids)
    parts.append(
        f"<details><summary>prompt: {len(prompt_messages)} messages, "
        f"{len(t.prompt_ids)} tokens</summary>"
        + "".join(_message(m) for m in prompt_messages)
        + f'<pre class="tokens">{prompt_tokens}</pre></details>'
    )
    for k, (turn_id, positions) in enumerate(turns):
        messages = turn_messages[k] if k < len(turn_messages) else []
        parts.append(_turn(t, trainer, coloring, texts, turn_id, positions, messages))
    parts.append("</section>")
    return "\n".join(parts)


def _turn_blocks(t: Trajectory) -> list[tuple[int, list[int]]]:
    """Contiguous runs of completion positions with the same turn id."""
    blocks: list[tuple[int, list[int]]] = []
    for pos, turn_id in enumerate(t.turn_ids):
        if blocks and blocks[-1][0] == turn_id:
            blocks[-1][1].append(pos)
        else:
            blocks.append((turn_id, [pos]))
    return blocks


def _split_messages(messages: Sequence[Message]) -> tuple[list[Message], list[list[Message]]]:
    """Messages before the first assistant turn, then [assistant k, its tool results...]."""
    prompt: list[Message] = []
    turns: list[list[Message]] = []
    for m in messages:
        if m.role == Role.ASSISTANT:
            turns.append([m])
        elif turns:
            turns[-1].append(m)
        else:
            prompt.append(m)
    return prompt, turns


def _turn(
    t: Trajectory,
    trainer: Sequence[float] | None,
    coloring: _Coloring,
    texts: list[str],
    turn_id: int,
    positions: list[int],
    messages: list[Message],
) -> str:
    spans = []
    for pos in positions:
        text = texts[pos]
        if t.loss_mask[pos]:
            lp = trainer[pos] if trainer is not None else None
            version = t.policy_versions[pos] if t.policy_versions else None
            spans.append(_model_token(text, t.sampler_logprobs[pos], lp, coloring, version))
        else:
            spans.append(_plain(text))
    num_model = sum(t.loss_mask[p] for p in positions)
    head = f"turn {turn_id} · assistant · {num_model} model tokens"
    calls = []
    for m in messages:
        if m.role == Role.ASSISTANT:
            for call in m.tool_calls:
                args = json.dumps(call.arguments, ensure_ascii=False)
                calls.append(
                    f'<div class="call"><b>tool call</b> {_e(call.name)}'
                    f"<code>{_e(args)}</code></div>"
                )
        else:
            calls.append(_message(m))
    return (
        f'<div class="turn"><div class="turn-head">{_e(head)}</div>'
        f'<pre class="tokens">{"".join(spans)}</pre>{"".join(calls)}</div>'
    )


def _message(m: Message) -> str:
    name = f" ({m.name})" if m.name else ""
    role = "tool result" if m.role == Role.TOOL else str(m.role)
    return (
        f'<div class="msg role-{_e(str(m.role))}"><b>{_e(role + name)}</b>'
        f"<pre>{_e(m.content)}</pre></div>"
    )


def _model_token(
    text: str,
    sampler: float,
    trainer: float | None,
    coloring: _Coloring,
    version: int | None = None,
) -> str:
    shown = repr(text) if text else "(part of a character completed by a later token)"
    if coloring.trainer and trainer is not None:
        delta = trainer - sampler
        rgb = delta_color(delta, coloring.scale)
        tip = (
            f"token {shown}\nsampler logprob {sampler:.4f}\ntrainer logprob {trainer:.4f}"
            f"\nδ {delta:+.4f}"
        )
        data = (
            f' data-sampler="{sampler:.6g}" data-trainer="{trainer:.6g}" data-delta="{delta:.6g}"'
        )
    else:
        rgb = surprisal_color(sampler, coloring.scale)
        tip = f"token {shown}\nsampler logprob {sampler:.4f}\n(no trainer logprobs)"
        data = f' data-sampler="{sampler:.6g}"'
    style = f"background:rgb({rgb[0]},{rgb[1]},{rgb[2]})"
    if version is not None and version >= 0:
        tip += f"\nsampled by version {version}"
        data += f' data-version="{version}"'
        if coloring.trained_version is not None:
            lag = coloring.trained_version - version
            tip += f" (lag {lag})"
            underline = lag_color(lag)
            if underline is not None:
                style += f";border-bottom:3px solid rgb{underline}"
    return f'<span class="tok" style="{style}" title="{_e(tip)}"{data}>{_e(text)}</span>'


def _plain(text: str) -> str:
    return f'<span class="ctx">{_e(text)}</span>'


def _e(text: str) -> str:
    return html.escape(text, quote=True)
