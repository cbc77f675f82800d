"""Token-in-token-out (TITO) state of one episode, and the incremental-vs-full check.

A `Conversation` holds the token list the trainer will see. It only ever grows by
appending: sampled tokens are kept verbatim (loss mask 1), and the tokens between assistant
turns are rendered by the chat format on their own, starting at a special token, and
appended with loss mask 0. Nothing already in the list is ever re-tokenized.

Turn indices: the k-th assistant turn (0-based) has turn index k; the environment's tokens
that follow it (closing `<|im_end|>` if it was cut off, the tool/user turns, the next
assistant header) carry index k as well. Prompt tokens have no turn index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tir_rl.errors import ChatFormatError
from tir_rl.types import UNVERSIONED, Message, Role, Trajectory


class ConversationFormat(Protocol):
    """What a `Conversation` needs from its chat format (every `tir_rl.chat.ChatFormat`)."""

    @property
    def end_of_turn_id(self) -> int:
        """The token that closes a turn."""
        ...

    def message_from_text(self, text: str) -> Message:
        """The assistant message of sampled text, its tool calls parsed."""
        ...

    def render_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of `messages` plus the header of the assistant turn to sample."""
        ...

    def render_env_turns(self, messages: Sequence[Message], *, close_turn: bool) -> list[int]:
        """Token ids appended after an assistant turn: the env's messages, the next header."""
        ...

    def render_messages(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a whole conversation rendered at once."""
        ...

    def assistant_text(self, message: Message) -> str:
        """The text of an assistant turn as the model sees it."""
        ...

    def encode_assistant_text(self, text: str) -> list[int]:
        """Token ids of assistant text."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids."""
        ...


class Conversation:
    """The growing token list of one episode.

    Args:
        chat_format: The format that renders the prompt and the environment's turns.
        messages: The prompt messages (system, user, possibly earlier turns).

    Typical loop::

        conv = chat_format.conversation(prompt_messages)
        while True:
            ids, logprobs = engine.sample(conv.token_ids, stop=chat_format.stop_token_ids)
            conv.append_sampled(ids, logprobs)
            parsed = chat_format.parse_assistant(conv.current_turn_ids)
            if not parsed.has_tool_calls:
                break
            conv.append_messages(tool_messages_answering(parsed))
        trajectory = conv.to_trajectory(reward=reward)
    """

    def __init__(self, chat_format: ConversationFormat, messages: Sequence[Message]) -> None:
        self.chat_format = chat_format
        self.prompt_messages: tuple[Message, ...] = tuple(messages)
        self.prompt_ids: list[int] = chat_format.render_prompt(messages)
        self.completion_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.sampler_logprobs: list[float] = []
        self.turn_ids: list[int] = []
        self.policy_versions: list[int] = []
        self._history: list[Message] = list(messages)
        self._turn_index = 0
        self._turn_tokens: list[int] = []

    # ------------------------------------------------------------------------ state
    @property
    def token_ids(self) -> list[int]:
        """Prompt and completion tokens: what the engine continues from."""
        return self.prompt_ids + self.completion_ids

    @property
    def num_tokens(self) -> int:
        """Length of `token_ids`."""
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def turn_index(self) -> int:
        """Index of the current (last) assistant turn, 0-based."""
        return self._turn_index

    @property
    def current_turn_ids(self) -> list[int]:
        """Tokens sampled so far in the current assistant turn."""
        return list(self._turn_tokens)

    @property
    def current_turn_closed(self) -> bool:
        """Whether the current assistant turn ended with a sampled end-of-turn token."""
        return bool(self._turn_tokens) and self._turn_tokens[-1] == self.chat_format.end_of_turn_id

    @property
    def messages(self) -> list[Message]:
        """The conversation as messages: prompt, assistant turns (decoded), env messages.

        An assistant message's content is exactly the decoded sampled text without a final
        sampled `<|im_end|>`; its `tool_calls` are the calls parsed from it.
        """
        if not self._turn_tokens:
            return list(self._history)
        return [*self._history, self._assistant_message()]

    # ---------------------------------------------------------------------- appending
    def append_sampled(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        policy_versions: Sequence[int] | None = None,
    ) -> None:
        """Append tokens sampled by the engine for the current assistant turn (loss mask 1).

        May be called several times per turn (e.g. continuations); tokens are kept verbatim,
        including a final `<|im_end|>` or EOS. `policy_versions` labels each token with the
        version of the weights that sampled it (None: `UNVERSIONED`).

        Raises:
            ChatFormatError: Lengths differ, or the turn was already closed by `<|im_end|>`.
        """
        if len(token_ids) != len(logprobs) or (
            policy_versions is not None and len(policy_versions) != len(token_ids)
        ):
            raise ChatFormatError(
                f"append_sampled got {len(token_ids)} token ids but {len(logprobs)} logprobs "
                f"and {len(policy_versions) if policy_versions is not None else 'no'} "
                "versions; pass one sampler logprob per sampled token (and one version if any)"
            )
        if self.current_turn_closed:
            raise ChatFormatError(
                "the assistant turn already ended with <|im_end|>: call append_messages with "
                "the environment's answer before sampling again"
            )
        ids = [int(t) for t in token_ids]
        versions = [UNVERSIONED] * len(ids) if policy_versions is None else policy_versions
        self._extend(ids, 1, [float(lp) for lp in logprobs], [int(v) for v in versions])
        self._turn_tokens.extend(ids)

    def append_messages(self, messages: Sequence[Message]) -> None:
        """Append the environment's answer (tool/user/system messages) with loss mask 0.

        Closes the current assistant turn first if its sampled tokens did not end with
        `<|im_end|>` (cut off at the token limit), then appends the rendered messages and
        the next assistant header. Those tokens carry the current turn index; the next
        sampled tokens belong to the next turn.

        Raises:
            ChatFormatError: No messages, or an assistant message among them.
        """
        if not messages:
            raise ChatFormatError("append_messages needs at least one tool, user or system message")
        close = not self.current_turn_closed
        ids = self.chat_format.render_env_turns(messages, close_turn=close)
        self._extend(ids, 0, [0.0] * len(ids), [UNVERSIONED] * len(ids))
        self._history.append(self._assistant_message())
        self._history.extend(messages)
        self._turn_index += 1
        self._turn_tokens = []

    def to_trajectory(self, **fields: Any) -> Trajectory:
        """Freeze into a `Trajectory`; `fields` sets the others (reward, status, ...)."""
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            loss_mask=list(self.loss_mask),
            sampler_logprobs=list(self.sampler_logprobs),
            turn_ids=list(self.turn_ids),
            policy_versions=list(self.policy_versions),
            messages=self.messages,
            **fields,
        )

    def full_render(self) -> list[int]:
        """What rendering `messages` in one go gives, aligned to the incremental list.

        Equals `token_ids` whenever the tokenizer re-tokenizes each assistant text (after
        its header) to exactly the sampled tokens.
        """
        fmt = self.chat_format
        if not self._turn_tokens:
            return fmt.render_messages(self._history, add_generation_prompt=True)
        ids = fmt.render_messages(self.messages, continue_final_message=True)
        return ids + [fmt.end_of_turn_id] if self.current_turn_closed else ids

    def _extend(
        self, ids: list[int], mask: int, logprobs: list[float], versions: list[int]
    ) -> None:
        self.completion_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.sampler_logprobs.extend(logprobs)
        self.turn_ids.extend([self._turn_index] * len(ids))
        self.policy_versions.extend(versions)

    def _assistant_message(self) -> Message:
        ids = self._turn_tokens
        if ids and ids[-1] == self.chat_format.end_of_turn_id:
            ids = ids[:-1]
        return self.chat_format.message_from_text(self.chat_format.decode(ids))


@dataclass(frozen=True)
class RenderDiff:
    """Incremental token list against a full re-render of the same conversation.

    Attributes:
        equal: Whether the two token lists are identical.
        position: First index (into prompt + completion) where they differ, or the length of
            the shorter list when one is a prefix of the other; None when equal.
        incremental_len: Length of the incremental list.
        full_len: Length of the full render.
        incremental_window: Decoded incremental tokens around `position` ("" when equal).
        full_window: Decoded full-render tokens around `position` ("" when equal).
        incremental_ids: The incremental token ids of that window.
        full_ids: The full-render token ids of that window.
    """

    equal: bool
    position: int | None
    incremental_len: int
    full_len: int
    incremental_window: str = ""
    full_window: str = ""
    incremental_ids: tuple[int, ...] = ()
    full_ids: tuple[int, ...] = ()

    def describe(self) -> str:
        """One readable paragraph for reports (`tir-rl doctor`)."""
        if self.equal:
            return f"incremental rendering equals the full render ({self.full_len} tokens)"
        return (
            f"incremental rendering diverges from the full render at token {self.position} "
            f"(lengths {self.incremental_len} vs {self.full_len}):\n"
            f"  incremental {list(self.incremental_ids)} {self.incremental_window!r}\n"
            f"  full        {list(self.full_ids)} {self.full_window!r}"
        )


def compare_incremental_with_full(
    source: Conversation | Sequence[Message],
    *,
    chat_format: ConversationFormat | None = None,
    num_prompt_messages: int | None = None,
    window: int = 8,
) -> RenderDiff:
    """Compare incremental (TITO) rendering with rendering the messages in one go.

    Args:
        source: A conversation built by a rollout, or messages. Messages are replayed as a
            rollout would: the prompt is rendered, each later assistant message is "sampled"
            as the tokenizer's own tokens of its text plus `<|im_end|>`, and the messages
            between assistant turns are appended.
        chat_format: Required when `source` is messages.
        num_prompt_messages: For messages: how many form the prompt (default: all before the
            first assistant message).
        window: Tokens shown on each side of the first difference.

    Raises:
        ChatFormatError: Messages without `chat_format`, or two assistant messages in a row.
    """
    if isinstance(source, Conversation):
        conv = source
    else:
        if chat_format is None:
            raise ChatFormatError("compare_incremental_with_full needs chat_format for messages")
        conv = _replay(chat_format, list(source), num_prompt_messages)
    incremental, full = conv.token_ids, conv.full_render()
    if incremental == full:
        return RenderDiff(True, None, len(incremental), len(full))
    pos = next(
        (i for i, (a, b) in enumerate(zip(incremental, full, strict=False)) if a != b),
        min(len(incremental), len(full)),
    )
    lo = max(0, pos - window)
    inc_ids, full_ids = tuple(incremental[lo : pos + window]), tuple(full[lo : pos + window])
    decode = conv.chat_format.decode
    return RenderDiff(
        False,
        pos,
        len(incremental),
        len(full),
        decode(inc_ids),
        decode(full_ids),
        inc_ids,
        full_ids,
    )


def _replay(
    fmt: ConversationFormat, messages: list[Message], num_prompt: int | None
) -> Conversation:
    if num_prompt is None:
        roles = [m.role for m in messages]
        num_prompt = roles.index(Role.ASSISTANT) if Role.ASSISTANT in roles else len(messages)
    conv = Conversation(fmt, messages[:num_prompt])
    pending: list[Message] = []
    for message in messages[num_prompt:]:
        if message.role != Role.ASSISTANT:
            pending.append(message)
            continue
        if pending:
            conv.append_messages(pending)
            pending = []
        elif conv.current_turn_ids:
            raise ChatFormatError("two assistant messages in a row cannot be replayed")
        ids = fmt.encode_assistant_text(fmt.assistant_text(message)) + [fmt.end_of_turn_id]
        conv.append_sampled(ids, [0.0] * len(ids))
    if pending:
        conv.append_messages(pending)
    return conv
