"""Tokenizing rendered pieces at special-token boundaries (the basis of stable TITO rendering).

A rendering is a sequence of pieces: special token ids, placed by the format itself, and
text. Adjacent text pieces form a run that is tokenized in one call, so a run always starts
and ends at a special token (or at the start/end of what is rendered). Because tokenizers
split on special tokens before anything else, tokenizing runs separately gives the same ids
as tokenizing the whole text at once, which makes appending stable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Tokenizer(Protocol):
    """The parts of a Hugging Face tokenizer the chat format uses."""

    eos_token_id: int | None

    def __call__(self, text: str, **kwargs: Any) -> Any:
        """Encode text; the result has "input_ids"."""
        ...

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str:
        """Decode token ids to text."""
        ...

    def convert_tokens_to_ids(self, tokens: str) -> int | None:
        """Id of a token given by its string form."""
        ...


@dataclass(frozen=True)
class Text:
    """A piece of text to tokenize."""

    text: str
    literal: bool | None = None
    """How special-token strings in the text are treated. True: content that may never become
    special tokens (users, tools, system prompts). False: assistant text, whose special-token
    strings were sampled as special tokens. None: text written by the format itself, which
    contains no special-token strings."""


Piece = int | Text
"""A special token id, or text."""


def tokenize_pieces(tokenizer: Tokenizer, pieces: Sequence[Piece]) -> list[int]:
    """Token ids of pieces: special ids as they are, each maximal text run tokenized once.

    Lone surrogates (e.g. from surrogateescape-decoded tool output) cannot be encoded and
    become "?".
    """
    ids: list[int] = []
    run: list[Text] = []

    def flush() -> None:
        if not run:
            return
        modes = {p.literal for p in run if p.literal is not None}
        assert len(modes) <= 1, "a text run mixes assistant and environment content"
        text = "".join(p.text for p in run).encode("utf-8", "replace").decode("utf-8")
        if text:
            split = modes != {False}
            encoded = tokenizer(text, add_special_tokens=False, split_special_tokens=split)
            ids.extend(encoded["input_ids"])
        run.clear()

    for piece in pieces:
        if isinstance(piece, Text):
            run.append(piece)
        else:
            flush()
            ids.append(piece)
    flush()
    return ids
