"""Look of the trajectory viewer: colour scales, legend, CSS and the page template."""

from __future__ import annotations

import html
import math

SURPRISAL_SCALE = 6.0
"""−log p (nats) drawn at full colour in surprisal mode."""
MIN_DELTA_SCALE = 1e-3
"""Lower bound of the automatic |δ| scale, so a perfect-parity page is not all saturated."""


def delta_color(delta: float, scale: float) -> tuple[int, int, int]:
    """Diverging colour of δ: blue (−scale) → white (0) → red (+scale), clamped outside."""
    if not math.isfinite(delta):
        return (190, 190, 190)
    x = max(-1.0, min(1.0, delta / scale))
    fade = round(255 * (1 - abs(x)))
    if x >= 0:
        return (255, fade, fade)
    return (fade, fade, 255)


def surprisal_color(logprob: float, scale: float = SURPRISAL_SCALE) -> tuple[int, int, int]:
    """Sequential colour of −logprob: white (certain) → orange-red (surprising)."""
    if not math.isfinite(logprob):
        return (190, 190, 190)
    x = max(0.0, min(1.0, -logprob / scale))
    return (255, round(255 - 140 * x), round(255 - 215 * x))


LAG_COLORS = ((0, 0, 0), (240, 160, 0), (220, 30, 30), (130, 40, 200))
"""Underline of a model token by its lag: none (0), orange (1), red (2), purple (3 or more)."""


def lag_color(lag: int) -> tuple[int, int, int] | None:
    """The underline colour of a token `lag` versions stale; None for lag 0 or unknown."""
    if lag <= 0:
        return None
    return LAG_COLORS[min(lag, len(LAG_COLORS) - 1)]


def lag_legend() -> str:
    """What the lag underlines mean (shown when a page has stale tokens)."""
    swatches = " ".join(
        f'<span style="border-bottom:3px solid rgb{color}">lag {label}</span>'
        for label, color in zip(("1", "2", "3+"), LAG_COLORS[1:], strict=True)
    )
    return (
        f'<div class="legend">Underline: staleness, the versions by which the weights that '
        f"sampled a token lag those the trainer updated from: {swatches} (none: lag 0).</div>"
    )


def legend(any_trainer: bool, scale: float, all_trainer: bool) -> str:
    """The colour-scale explanation shown at the top of the page."""
    if any_trainer:
        stops = [delta_color(x * scale, scale) for x in (-1, -0.5, 0, 0.5, 1)]
        gradient = ", ".join(f"rgb({r},{g},{b})" for r, g, b in stops)
        text = (
            f"Model tokens coloured by δ = trainer − sampler logprob: blue δ ≤ −{scale:.3g} "
            f"(trainer finds the token less likely), white δ = 0, red δ ≥ +{scale:.3g}."
        )
        if not all_trainer:
            text += " Episodes without trainer logprobs are coloured by sampler surprisal."
    else:
        stops = [surprisal_color(-x * SURPRISAL_SCALE) for x in (0, 0.5, 1)]
        gradient = ", ".join(f"rgb({r},{g},{b})" for r, g, b in stops)
        text = (
            "No trainer logprobs: model tokens coloured by sampler surprisal −log p "
            f"(white 0, orange ≥ {SURPRISAL_SCALE:g} nats)."
        )
    return (
        f'<div class="legend"><span class="bar" style="background:linear-gradient(to right, '
        f'{gradient})"></span> {_e(text)} Grey text: prompt, chat-format and tool tokens '
        "(not trained on). Hover a token for its logprobs.</div>"
    )


def _e(text: str) -> str:
    return html.escape(text, quote=True)


CSS = """
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; background: #fafafa; }
h1 { font-size: 20px; margin: 0 0 8px; }
h2 { font-size: 16px; margin: 0 0 4px; }
.legend { font-size: 13px; margin-bottom: 12px; }
.legend .bar { display: inline-block; width: 120px; height: 12px; border: 1px solid #999;
  vertical-align: middle; }
.episode { background: #fff; border: 1px solid #ccc; border-radius: 6px; padding: 10px 12px;
  margin-bottom: 14px; }
.facts { font-size: 13px; color: #555; margin: 0 0 6px; }
.status { font-size: 12px; padding: 1px 6px; border-radius: 8px; color: #fff; }
.status.ok { background: #2e7d32; } .status.warn { background: #ef6c00; }
.status.bad { background: #c62828; }
.error { color: #c62828; font-size: 13px; }
details { font-size: 13px; margin-bottom: 6px; }
.turn { border-left: 3px solid #90a4ae; padding-left: 8px; margin: 6px 0; }
.turn-head { font-size: 12px; color: #455a64; font-weight: 600; }
pre { white-space: pre-wrap; word-break: break-word; margin: 2px 0;
  font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.5; }
.tok { border-radius: 2px; }
.tok:empty { display: inline-block; min-width: 3px; height: 1em; vertical-align: text-bottom; }
.ctx { color: #9e9e9e; }
.call, .msg { font-size: 13px; margin: 2px 0; }
.call code { margin-left: 6px; background: #eceff1; padding: 0 4px; }
.msg pre { background: #f5f5f5; padding: 4px; }
.role-tool b { color: #6a1b9a; }
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
{body}
</body>
</html>
"""
