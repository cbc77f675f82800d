"""The doctor's inference-path check: the same seeded sample alone, again, and in a batch.

The engines here are fakes whose logprobs depend on the path in a chosen way; the check's
green path on real vLLM-CPU is `tests/integration/engine/test_doctor_causes.py`.
"""

import asyncio
import random

import pytest

from tir_rl.doctor import Verdict, _inference_path_finding
from tir_rl.engine.base import FinishReason, GenerateRequest, GenerateResult
from tir_rl.engine.parity import probe_inference_paths
from tir_rl.errors import ConfigError

PROMPT = list(range(10, 90))


class FakePathEngine:
    """Samples from (prompt, seed) alone; optionally shifts logprobs on a prefix-cache hit (a
    prompt that extends an earlier one, read from the cache) or when other requests are in
    flight, or reseeds by batch."""

    def __init__(self, *, cache_shift=0.0, batch_shift=0.0, batch_reseeds=False):
        self.cache_shift = cache_shift
        self.batch_shift = batch_shift
        self.batch_reseeds = batch_reseeds
        self.seen: set[tuple[int, ...]] = set()
        self.in_flight = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.in_flight += 1
        await asyncio.sleep(0)  # let the other requests of a gather start
        prompt = tuple(request.prompt_token_ids)
        batched = self.in_flight > 1
        seed = (request.seed or 0) + (1000 if batched and self.batch_reseeds else 0)
        rng = random.Random(hash((prompt, seed)))
        ids = [rng.randrange(100) for _ in range(request.max_tokens)]
        logprobs = [-rng.random() for _ in ids]
        hit = request.read_prefix_cache and any(prompt[: len(p)] == p for p in self.seen)
        shift = (self.cache_shift if hit else 0.0) + (self.batch_shift if batched else 0.0)
        self.seen.add(prompt)
        await asyncio.sleep(0)
        self.in_flight -= 1
        return GenerateResult(
            token_ids=ids,
            logprobs=[lp + shift for lp in logprobs],
            policy_versions=[0] * len(ids),
            finish_reason=FinishReason.LENGTH,
        )


def probe(engine):
    return asyncio.run(probe_inference_paths(engine, PROMPT, temperature=1.0, max_tokens=8))


def test_an_exact_engine_passes():
    report = probe(FakePathEngine())
    assert report.max_abs_diff_cached == report.max_abs_diff_batched == 0.0
    assert report.num_tokens == 8 and not report.tokens_diverged
    assert _inference_path_finding(report, True).verdict is Verdict.PASS


def test_a_prefix_cache_hit_that_changes_logprobs_is_named():
    report = probe(FakePathEngine(cache_shift=0.01))
    assert report.max_abs_diff_cached == pytest.approx(0.01)
    finding = _inference_path_finding(report, True)
    assert finding.verdict is Verdict.WARN
    assert "enable_prefix_caching=false" in finding.fix and "batch" not in finding.fix


def test_logprobs_that_depend_on_the_batch_are_named():
    report = probe(FakePathEngine(batch_shift=0.02))
    assert report.max_abs_diff_cached == 0.0
    assert report.max_abs_diff_batched == pytest.approx(0.02)
    finding = _inference_path_finding(report, False)
    assert finding.verdict is Verdict.WARN and "batch" in finding.fix
    assert "prefix caching off" in finding.detail


def test_a_gap_past_the_failure_limit_fails():
    finding = _inference_path_finding(probe(FakePathEngine(batch_shift=0.8)), None)
    assert finding.verdict is Verdict.FAIL


def test_seeding_that_depends_on_the_batch_warns_even_with_equal_logprobs():
    report = probe(FakePathEngine(batch_reseeds=True))
    assert report.tokens_diverged
    finding = _inference_path_finding(report, True)
    assert finding.verdict is Verdict.WARN and "other tokens" in finding.detail


def test_a_one_token_prompt_is_refused():
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        asyncio.run(probe_inference_paths(FakePathEngine(), [5], temperature=1.0))


class FakeServerEngine(FakePathEngine):
    """A server: no per-request switch for the prefix cache (as `VLLMHttpEngine`)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.read_prefix_cache:
            raise ConfigError("read_prefix_cache=False: a vllm serve server has no switch")
        return await super().generate(request)


def test_a_server_gets_the_batch_check_and_a_cache_path_marked_not_measured():
    report = probe(FakeServerEngine(cache_shift=0.01, batch_shift=0.02))
    assert report.max_abs_diff_cached is None
    assert report.max_abs_diff_batched == pytest.approx(0.02)
    finding = _inference_path_finding(report, None)
    assert "not measured" in finding.detail and "enable_prefix_caching" not in finding.fix
