import html
import math
import re

import pytest

from tir_rl.report.run_log import save_trajectories
from tir_rl.report.viewer import delta_color, render_html, render_saved, surprisal_color
from tir_rl.types import Message, RolloutStatus, ToolCall, Trajectory


class FakeTokenizer:
    """Decodes ids through a fixed table (one string per id), like a real per-token decode."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return "".join(self.vocab[i] for i in ids)


VOCAB = {
    0: "<|im_start|>",
    1: "user\n",
    2: "Compute 6*7",
    3: "assistant\n",
    4: "Let me",
    5: " run",
    6: "<tool_call>",
    7: "<|im_end|>",
    8: "\n<tool_response>\n",
    9: "<script>alert('x')</script>",
    10: "</tool_response>",
    11: " 42",
    12: " & <marquee>done</marquee>",
}


def trajectory():
    # turn 0: "Let me run<tool_call><|im_end|>" (model), then the tool response (context),
    # turn 1: " 42 & <marquee>done</marquee><|im_end|>" (model).
    completion = [3, 4, 5, 6, 7, 8, 9, 10, 0, 3, 11, 12, 7]
    mask = [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    turns = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    sampler = [0.0, -0.1, -2.0, -0.5, -0.05, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0, -0.2, -0.01]
    return Trajectory(
        prompt_ids=[0, 1, 2, 7],
        completion_ids=completion,
        loss_mask=mask,
        sampler_logprobs=sampler,
        turn_ids=turns,
        reward=1.0,
        status=RolloutStatus.FINISHED,
        num_tool_calls=1,
        messages=[
            Message.user("Compute 6*7 <img src=x onerror=alert(1)>"),
            Message.assistant("Let me run", [ToolCall("python", {"code": "print('<marquee>')"})]),
            Message.tool("<script>alert('x')</script>", name="python"),
            Message.assistant("42 & done"),
        ],
    )


def trainer_logprobs(t, shift):
    return [
        s + shift * (i % 3 - 1) if m else 0.0
        for i, (s, m) in enumerate(zip(t.sampler_logprobs, t.loss_mask, strict=True))
    ]


def test_everything_from_tokens_and_messages_is_escaped():
    page = render_html([trajectory()], FakeTokenizer(VOCAB), title="<title> & co")
    assert "<script" not in page.lower()
    assert "onerror=alert(1)>" not in page
    assert "<marquee" not in page
    assert html.escape("<script>alert('x')</script>") in page  # tool output, shown as text
    assert "&lt;title&gt; &amp; co" in page
    assert "&lt;|im_start|&gt;" in page


def test_every_model_token_is_one_coloured_span_and_context_tokens_are_plain():
    t = trajectory()
    page = render_html([t], FakeTokenizer(VOCAB), trainer_logprobs=[trainer_logprobs(t, 0.3)])
    spans = re.findall(r'<span class="tok" style="background:rgb\((\d+),(\d+),(\d+)\)"', page)
    assert len(spans) == sum(t.loss_mask) == 7
    num_context = len(t.completion_ids) - sum(t.loss_mask) + len(t.prompt_ids)
    assert page.count('<span class="ctx">') == num_context
    deltas = [float(d) for d in re.findall(r'data-delta="([^"]+)"', page)]
    expected = [
        tr - s
        for tr, s, m in zip(trainer_logprobs(t, 0.3), t.sampler_logprobs, t.loss_mask, strict=True)
        if m
    ]
    assert deltas == pytest.approx(expected, abs=1e-5)
    assert "trainer − sampler" in page
    assert "turn 0" in page and "turn 1" in page
    assert "tool call</b> python" in page and "tool result (python)" in page


def test_without_trainer_logprobs_tokens_are_coloured_by_surprisal_and_the_legend_says_so():
    page = render_html([trajectory()], FakeTokenizer(VOCAB))
    assert "No trainer logprobs" in page and "surprisal" in page
    assert "data-delta" not in page
    assert page.count('<span class="tok"') == 7


def test_tokens_are_decoded_once_per_distinct_id():
    tokenizer = FakeTokenizer(VOCAB)
    render_html([trajectory(), trajectory()], tokenizer)
    distinct = set(trajectory().prompt_ids) | set(trajectory().completion_ids)
    assert tokenizer.calls == len(distinct)


def test_misaligned_trainer_logprobs_are_rejected():
    t = trajectory()
    with pytest.raises(ValueError, match="trainer logprobs have 2 entries"):
        render_html([t], FakeTokenizer(VOCAB), trainer_logprobs=[[0.0, 0.0]])
    with pytest.raises(ValueError, match="lists for 1 trajectories"):
        render_html([t], FakeTokenizer(VOCAB), trainer_logprobs=[])


def red_minus_blue(delta, scale=1.0):
    r, _, b = delta_color(delta, scale)
    return r - b


def test_delta_colour_is_monotone_diverging_and_saturates():
    deltas = [x / 100 for x in range(-100, 101)]
    values = [red_minus_blue(d) for d in deltas]
    assert all(a < b for a, b in zip(values, values[1:], strict=False))
    assert delta_color(0.0, 1.0) == (255, 255, 255)
    assert delta_color(-1.0, 1.0) == (0, 0, 255) == delta_color(-5.0, 1.0)
    assert delta_color(1.0, 1.0) == (255, 0, 0) == delta_color(7.0, 1.0)
    assert delta_color(math.nan, 1.0) == delta_color(math.inf, 1.0)  # grey, not a crash


def test_surprisal_colour_darkens_as_logprob_falls():
    greens = [surprisal_color(-x / 10)[1] for x in range(0, 61)]
    assert all(a > b for a, b in zip(greens, greens[1:], strict=False))


def test_render_saved_reads_a_run_trajectory_file(tmp_path):
    t = trajectory()
    path = tmp_path / "trajectories.jsonl"
    save_trajectories(path, [t], step=5, trainer_logprobs=[trainer_logprobs(t, 0.1)])
    save_trajectories(path, [t], step=6)
    page = render_saved(path, FakeTokenizer(VOCAB))
    assert "Episode 0 · step 5" in page and "Episode 1 · step 6" in page
    assert page.count("data-delta=") == 7  # only the first episode has trainer logprobs
    assert "coloured by sampler surprisal" in page


class FakeByteTokenizer:
    """Byte-level vocabulary: ids are bytes, decoding replaces incomplete UTF-8 with U+FFFD."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_characters_split_over_tokens_are_shown_on_the_completing_token():
    text = "Größe ✓ 日"
    ids = list(text.encode())
    t = Trajectory(
        prompt_ids=[],
        completion_ids=ids,
        loss_mask=[1] * len(ids),
        sampler_logprobs=[-0.5] * len(ids),
        turn_ids=[0] * len(ids),
    )
    page = render_html([t], FakeByteTokenizer())
    shown = re.findall(r'<span class="tok"[^>]*>([^<]*)</span>', page)
    assert len(shown) == len(ids)
    assert "".join(shown) == text
    assert "ö" in shown and "✓" in shown and "日" in shown and "\ufffd" not in page
    assert shown.count("") == len(ids) - len(text)  # leading bytes of multi-byte characters
    assert "part of a character" in page


def test_stale_tokens_are_underlined_by_their_lag_and_saved_versions_round_trip(tmp_path):
    import dataclasses

    t = trajectory()
    # Turn 0 sampled by version 3, turn 1 by version 5 (an update landed between the turns).
    pairs = zip(t.loss_mask, t.turn_ids, strict=True)
    versions = [3 if m and turn == 0 else 5 if m else -1 for m, turn in pairs]
    t = dataclasses.replace(t, policy_versions=versions)
    path = tmp_path / "trajectories.jsonl"
    save_trajectories(path, [t], step=6, trainer_logprobs=[trainer_logprobs(t, 0.1)],
                      trained_version=5)  # fmt: skip
    page = render_saved(path, FakeTokenizer(VOCAB))
    assert page.count('data-version="3"') == 4 and page.count('data-version="5"') == 3
    assert page.count(";border-bottom:3px solid rgb(220, 30, 30)") == 4  # lag 2: red tokens
    assert "sampled by version 3 (lag 2)" in html.unescape(page)
    assert "trained from version 5, lag 0-2" in page
    assert "Underline: staleness" in page


def test_without_stale_tokens_nothing_is_underlined():
    t = trajectory()
    page = render_html([t], FakeTokenizer(VOCAB), trainer_logprobs=[trainer_logprobs(t, 0.1)])
    assert "border-bottom" not in page.split("</style>")[1]
    assert "Underline: staleness" not in page
