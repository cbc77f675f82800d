"""The trajectory viewer in a real headless browser (Debian's `chromium` package).

Renders hand-built episodes tokenized with the bundled tokenizer, takes a screenshot into the
test artifacts (`$TIR_RL_TEST_ARTIFACTS`, default `tests/artifacts/`) and checks the DOM the
browser built. Skipped only when chromium is missing outside CI.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from tir_rl.report.viewer import render_html
from tir_rl.types import Message, RolloutStatus, ToolCall, Trajectory

pytestmark = pytest.mark.model
WIDTH, HEIGHT = 1200, 900
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


@pytest.fixture(scope="module")
def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(
                "chromium is not installed (CI must run this test: apt-get install chromium)"
            )
        pytest.skip("chromium is not installed: apt-get install -y chromium")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tir_rl.models import prepare_tiny_model

    return AutoTokenizer.from_pretrained(prepare_tiny_model())


@pytest.fixture(scope="module")
def artifacts_dir():
    root = os.environ.get("TIR_RL_TEST_ARTIFACTS")
    path = Path(root) if root else Path(__file__).resolve().parents[2] / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_episode(tokenizer, segments, *, group_id, reward, status, messages, spike):
    """Tokens from (text, is_model) segments; δ spikes on the first tokens after a tool response.

    Synthetic logprobs: sampler ℓ = −0.05 − 0.4·(i mod 5); trainer = sampler + δ with δ =
    0.25·sin(i)
    except `spike` on the first 3 model tokens after each tool response.
    """
    prompt = tokenizer.encode(segments[0][0], add_special_tokens=False)
    completion, mask, turns, sampler, trainer = [], [], [], [], []
    turn, after_tool = 0, 0
    for text, is_model in segments[1:]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for i, token_id in enumerate(ids):
            completion.append(token_id)
            mask.append(int(is_model))
            turns.append(turn)
            if is_model:
                lp = -0.05 - 0.4 * (i % 5)
                delta = spike if after_tool and i < 3 else 0.25 * math.sin(i)
                sampler.append(lp)
                trainer.append(lp + delta)
            else:
                sampler.append(0.0)
                trainer.append(0.0)
        if not is_model:
            turn += 1
            after_tool = 1
    trajectory = Trajectory(
        prompt_ids=prompt,
        completion_ids=completion,
        loss_mask=mask,
        sampler_logprobs=sampler,
        turn_ids=turns,
        reward=reward,
        status=status,
        group_id=group_id,
        num_tool_calls=sum(m.role == "tool" for m in messages),
        messages=messages,
    )
    return trajectory, trainer


def episodes(tokenizer):
    code = "print(2**100 % 97)"
    tool_out = "<script>document.body.innerHTML='pwned'</script> 16"
    first = build_episode(
        tokenizer,
        [
            ("<|im_start|>user\nWhat is 2**100 mod 97? Größe ✓<|im_end|>\n", False),
            (f'<|im_start|>assistant\n<tool_call>\n{{"name": "python", "code": "{code}"}}', True),
            ("\n</tool_call><|im_end|>", True),
            (
                f"\n<|im_start|>tool\n<tool_response>\n{tool_out}\n</tool_response><|im_end|>\n",
                False,
            ),
            ("<|im_start|>assistant\nThe answer is <answer>16</answer><|im_end|>", True),
        ],
        group_id=0,
        reward=1.0,
        status=RolloutStatus.FINISHED,
        messages=[
            Message.user("What is 2**100 mod 97? Größe ✓"),
            Message.assistant("", [ToolCall("python", {"code": code})]),
            Message.tool(tool_out, name="python"),
            Message.assistant("The answer is <answer>16</answer>"),
        ],
        spike=1.5,
    )
    second = build_episode(
        tokenizer,
        [
            ("<|im_start|>user\nCount the primes below 50.<|im_end|>\n", False),
            ("<|im_start|>assistant\nI think there are 12.<|im_end|>", True),
        ],
        group_id=1,
        reward=0.0,
        status=RolloutStatus.TRUNCATED_MAX_TURNS,
        messages=[
            Message.user("Count the primes below 50."),
            Message.assistant("I think there are 12."),
        ],
        spike=0.0,
    )
    return [first, second]


def run_chromium(chromium, *args, timeout_s=60):
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_viewer_renders_in_headless_chromium(chromium, tokenizer, artifacts_dir, tmp_path):
    built = episodes(tokenizer)
    trajectories = [t for t, _ in built]
    page = render_html(
        trajectories,
        tokenizer,
        trainer_logprobs=[lp for _, lp in built],
        title="tir-rl viewer browser test",
    )
    html_path = artifacts_dir / "viewer_browser.html"
    html_path.write_text(page, encoding="utf-8")
    screenshot = artifacts_dir / "viewer_browser.png"
    screenshot.unlink(missing_ok=True)

    run_chromium(
        chromium,
        f"--screenshot={screenshot}",
        f"--window-size={WIDTH},{HEIGHT}",
        html_path.as_uri(),
    )
    assert screenshot.exists()
    with Image.open(screenshot) as image:
        assert image.size == (WIDTH, HEIGHT)
        stats = ImageStat.Stat(image.convert("RGB"))
        assert max(stats.var) > 0  # not blank
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None
        reds = [c for c in colours if c[1][0] > 200 and c[1][1] < 120 and c[1][2] < 120]
        assert reds, "the δ spike after the tool response should be drawn in red"

    dom = run_chromium(chromium, "--dump-dom", html_path.as_uri())
    num_model_tokens = sum(t.num_model_tokens for t in trajectories)
    assert dom.count('class="tok"') == num_model_tokens
    assert dom.count('<section class="episode"') == 2
    assert "pwned" in dom  # shown as text ...
    assert "<script>document" not in dom  # ... never executed or parsed as markup
    assert "&lt;script&gt;document" in dom
    assert "Größe ✓" in dom
