r"""The answer protocol shared by the built-in environments, and exact answer comparison.

Protocol: the episode ends when the model writes an assistant turn **without tool calls**.
Its final answer is the text of the last ``<answer>...</answer>`` tag in that turn. A
LaTeX ``\boxed{...}`` is accepted as a fallback (the answer still counts, but the turn does
not earn the format score). A turn with neither has no answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

ANSWER_INSTRUCTIONS = (
    "When you are done, reply without any tool call and put only your final answer inside "
    "<answer></answer> tags, for example <answer>42</answer>."
)
"""The sentence every built-in system prompt ends with; user environments may reuse it."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = "\\boxed{"
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_WRAPPERS = re.compile(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}")


@dataclass(frozen=True)
class ExtractedAnswer:
    """The final answer found in an assistant turn."""

    text: str
    """The answer text, stripped, with any ``\\boxed{}`` wrapper removed."""
    tagged: bool
    """Whether it came from an ``<answer>`` tag (the documented format)."""


def extract_answer(text: str) -> ExtractedAnswer | None:
    """Find the final answer of an assistant turn (see the module docstring)."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        inner = tags[-1].strip()
        return ExtractedAnswer(_last_boxed(inner) or inner, tagged=True)
    boxed = _last_boxed(text)
    if boxed is not None:
        return ExtractedAnswer(boxed, tagged=False)
    return None


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    depth, pos = 1, start + len(_BOXED)
    for end in range(pos, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[pos:end].strip()
    return None


def parse_number(text: str) -> Fraction | None:
    r"""Read an exact number from a model's answer, or None when it is not one number.

    Accepts integers with thousands separators (``1,234,567``) or spaces between digit
    groups, decimals (``0.75``), fractions (``3/4``, ``\frac{3}{4}``), surrounding ``$``,
    a leading ``x =`` and a trailing period.
    """
    s = text.strip().strip("$").strip()
    s = _WRAPPERS.sub(lambda m: m.group(1) or m.group(2) or "", s)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    for space in ("\\,", "\\ ", "\\!", "\u2009", "\u202f", "\xa0", " "):
        s = s.replace(space, "")
    s = s.replace("\u2212", "-")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        s = f"{sign}{num}/{den}"
    if s.count("/") == 1:
        num, den = s.split("/")
        try:
            return Fraction(Fraction(num.strip("()")), Fraction(den.strip("()")))
        except (ValueError, ZeroDivisionError):
            return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(answer: str, expected: Fraction | int) -> bool:
    """Exact comparison of a model's answer with the expected rational number."""
    value = parse_number(answer)
    return value is not None and value == Fraction(expected)


def normalize_name(text: str) -> str:
    """Case- and whitespace-insensitive form of a name, without quotes or a trailing period."""
    s = text.strip().rstrip(".").strip().strip("\"'`*").strip()
    return " ".join(s.split()).casefold()
