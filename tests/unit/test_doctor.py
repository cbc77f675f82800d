import dataclasses
import math
import re

import pytest
import torch

from tir_rl.config import load
from tir_rl.doctor import (
    Finding,
    Verdict,
    _retokenization_drifts,
    format_findings,
    measured_finding,
    static_findings,
    template_finding,
)
from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig
from tir_rl.types import Trajectory


def verdicts(config, tied=True):
    return {f.check: f.verdict for f in static_findings(config, tie_word_embeddings=tied)}


def test_the_quickstart_config_passes_every_static_check():
    config = load(RunConfig, "configs/quickstart.yaml")
    assert set(verdicts(config).values()) == {Verdict.PASS}


def test_the_lab_config_with_its_float32_prefix_cache_passes_every_static_check():
    config = load(RunConfig, "configs/lab.yaml")
    found = verdicts(config, tied=False)
    assert set(found.values()) == {Verdict.PASS}


def test_the_prefix_cache_defaults_to_on_for_a_float32_sampler_only():
    for dtype, on in (("float32", True), ("bfloat16", False)):
        config = load(RunConfig, None, [f"engine.dtype={dtype}"])
        finding = next(f for f in static_findings(config, tie_word_embeddings=True)
                       if f.check == "prefix caching")  # fmt: skip
        assert config.engine.prefix_caching is on
        assert finding.verdict is Verdict.PASS and finding.detail.startswith("on" if on else "off")


def test_each_known_source_of_mismatch_is_flagged_with_a_fix():
    config = load(
        RunConfig,
        None,
        [
            "engine.dtype=bfloat16",
            "engine.local.enable_prefix_caching=true",
        ],
    )
    findings = {f.check: f for f in static_findings(config, tie_word_embeddings=True)}
    for check in ("dtype", "lm_head precision", "prefix caching", "correction"):
        assert findings[check].verdict is Verdict.WARN, check
        assert findings[check].fix, check
    assert "engine.dtype=float32" in findings["dtype"].fix


def test_wrong_logprobs_mode_fails():
    config = load(RunConfig, None)
    config.engine = dataclasses.replace(
        config.engine, logprobs_mode="raw_logprobs", allow_other_logprobs_mode=True
    )
    assert verdicts(config)["logprobs semantics"] is Verdict.FAIL


def test_measured_gap_thresholds():
    def verdict(max_diff, k3=0.0):
        metrics = {"mismatch/abs_diff_max": max_diff, "mismatch/k3_kl": k3}
        return measured_finding(metrics, 4).verdict

    assert verdict(6e-5) is Verdict.PASS
    assert verdict(0.3) is Verdict.WARN
    assert verdict(6e-5, k3=1e-3) is Verdict.WARN
    assert verdict(3.0) is Verdict.FAIL
    assert verdict(float("nan")) is Verdict.FAIL


def test_table_lists_fixes_only_for_problems():
    text = format_findings(
        [
            Finding("a", Verdict.PASS, "fine", "never shown"),
            Finding("b", Verdict.WARN, "hmm", "do X"),
        ]
    )
    assert "PASS" in text and "WARN" in text
    assert "b: do X" in text
    assert "never shown" not in text


class FakeChatFormat:
    """Tokens are runs of 'x' of length 1 or 2; the canonical encoding is greedy pairs."""

    stop_token_ids = (99,)

    def decode(self, ids):
        return "".join("x" * i for i in ids)

    def encode_assistant_text(self, text):
        return [2] * (len(text) // 2) + [1] * (len(text) % 2)


def trajectory(ids, mask):
    return Trajectory(
        prompt_ids=[1],
        completion_ids=ids,
        loss_mask=mask,
        sampler_logprobs=[0.0] * len(ids),
        turn_ids=[0] * len(ids),
    )


def test_retokenization_drift_is_detected_on_model_tokens_only():
    fmt = FakeChatFormat()
    assert not _retokenization_drifts(trajectory([2, 1, 99], [1, 1, 1]), fmt)
    assert _retokenization_drifts(trajectory([1, 1, 99], [1, 1, 1]), fmt)
    # the mask-0 token in the middle is not the model's: [2, 1] is canonical
    assert not _retokenization_drifts(trajectory([2, 1, 1], [1, 0, 1]), fmt)


# --------------------------------------------------------- our rendering vs the template
def chat_format(tokenizer, family=None):
    from tir_rl.chat import ChatFormat, ChatFormatName
    from tir_rl.chat.probe import PROBE_TOOL_SCHEMA

    config = ChatFormat.Config(format=ChatFormatName(family or "auto"))
    return ChatFormat(tokenizer, tool_schemas=[PROBE_TOOL_SCHEMA], config=config)


def test_template_check_passes_when_the_rendering_equals_the_template():
    from chat_tokenizers import llama3_tokenizer, qwen_tokenizer

    for tokenizer in (qwen_tokenizer(), llama3_tokenizer()):
        finding = template_finding(chat_format(tokenizer))
        assert finding.verdict is Verdict.PASS, finding.detail
        assert "exactly as the tokenizer's chat_template" in finding.detail


def test_template_check_warns_naming_the_first_differing_token_and_the_texts():
    from chat_tokenizers import qwen_tokenizer

    # chatml on a Qwen tokenizer: tool results in a `tool` turn, where Qwen writes `user`
    finding = template_finding(chat_format(qwen_tokenizer(), "chatml"))
    assert finding.verdict is Verdict.WARN
    assert re.search(r"first difference at token \d+", finding.detail)
    assert "<|im_start|>tool" in finding.detail and "<|im_start|>user" in finding.detail
    assert "chat.format" in finding.fix


def test_template_check_reports_that_qwen3_reasoning_is_kept():
    from chat_tokenizers import qwen_tokenizer
    from test_chat_families import QWEN3_STYLE_TEMPLATE

    finding = template_finding(chat_format(qwen_tokenizer(template=QWEN3_STYLE_TEMPLATE)))
    assert finding.verdict is Verdict.WARN
    assert "chat.format=qwen" in finding.detail
    assert "<think>" in finding.detail  # ours keeps it, the template dropped it


def test_template_check_passes_without_a_template_and_warns_on_a_failing_one():
    from chat_tokenizers import bundled_tokenizer, qwen_tokenizer

    tokenizer = bundled_tokenizer()
    tokenizer.chat_template = None
    finding = template_finding(chat_format(tokenizer))
    assert finding.verdict is Verdict.PASS and "no chat_template" in finding.detail
    broken = template_finding(chat_format(qwen_tokenizer(template="{{ raise_exception('no') }}")))
    assert broken.verdict is Verdict.WARN
    assert "cannot render the probe conversation (TemplateError: no)" in broken.detail
    assert "pick a named family" not in broken.detail  # the family is named already


def test_a_llama3_template_that_refuses_two_calls_in_a_turn_is_still_compared():
    """Meta's Llama 3.x templates raise on several calls in one turn: the probe makes one."""
    from chat_tokenizers import LLAMA3_TEMPLATE, llama3_tokenizer

    metas = (
        "{% for m in messages %}{% if m.tool_calls and m.tool_calls | length > 1 %}"
        "{{ raise_exception('This model only supports single tool-calls at once!') }}"
        "{% endif %}{% endfor %}" + LLAMA3_TEMPLATE
    )
    finding = template_finding(chat_format(llama3_tokenizer(metas)))
    assert finding.verdict is Verdict.PASS, finding.detail


def test_a_default_system_prompt_of_the_template_is_reported():
    """Qwen2.5's template writes its own system prompt when the messages have none."""
    from chat_tokenizers import QWEN_TEMPLATE, qwen_tokenizer

    with_system = "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    assert with_system in QWEN_TEMPLATE
    default = QWEN_TEMPLATE.replace(
        with_system,
        "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
        "{% else %}You are Qwen.\n\n{% endif %}",
    )
    finding = template_finding(chat_format(qwen_tokenizer(default)))
    assert finding.verdict is Verdict.WARN
    assert "on the probe without a system message" in finding.detail
    assert "You are Qwen" in finding.detail
    assert "on the probe conversation," not in finding.detail  # with one, they agree


def test_staleness_is_checked_against_the_correction():
    lab_async = verdicts(load(RunConfig, "configs/lab_async.yaml"), tied=False)
    assert lab_async["staleness"] is Verdict.PASS
    narrow = load(RunConfig, "configs/lab.yaml", ["run.max_staleness=2"])  # geo_rs_token_tis
    finding = next(f for f in static_findings(narrow, tie_word_embeddings=False)
                   if f.check == "staleness")  # fmt: skip
    assert finding.verdict is Verdict.WARN and "token_tis" in finding.fix
    kept = load(RunConfig, None, ["engine.local.clear_kv_on_update=false"])
    assert verdicts(kept)["KV across weight updates"] is Verdict.WARN


def test_truncated_sampling_is_replayed_and_retired_keys_explain_themselves():
    config = load(RunConfig, None, ["rollout.top_p=0.9", "rollout.top_k=20"])
    finding = next(
        f for f in static_findings(config, tie_word_embeddings=True)
        if f.check == "top-p / top-k / min-p"
    )  # fmt: skip
    assert finding.verdict is Verdict.PASS and "replays the kept set" in finding.detail
    assert load(RunConfig, None, ["engine.allow_truncated_sampling=false"])  # old saved configs
    with pytest.raises(ConfigError, match="rollout.top_p"):
        load(RunConfig, None, ["engine.allow_truncated_sampling=true"])
    with pytest.raises(ConfigError, match=r"rollout\.top_p must be in \(0, 1\]"):
        load(RunConfig, None, ["rollout.top_p=0"])
    with pytest.raises(ConfigError, match=r"rollout\.min_p"):
        load(RunConfig, None, ["rollout.min_p=1"])


def test_the_truncation_finding_reads_the_kept_mass_and_both_ratios():
    from tir_rl.doctor import truncation_finding
    from tir_rl.engine.truncation import SamplingTruncation

    replayed = torch.log(torch.tensor([[0.5, 0.25]]))
    unreplayed = replayed + math.log(0.8)  # the kept set held 0.8 of the mass
    mask = torch.ones(1, 2, dtype=torch.bool)
    good = truncation_finding(replayed, unreplayed, replayed, mask, SamplingTruncation(top_p=0.9))
    assert good.verdict is Verdict.PASS
    assert "kept mass 0.8000" in good.detail and "0.8000 without" in good.detail
    assert "1.0000 with it" in good.detail
    off = truncation_finding(replayed, unreplayed, unreplayed, mask, SamplingTruncation(top_k=5))
    assert off.verdict is Verdict.WARN
