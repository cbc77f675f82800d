"""Sampler/trainer mismatch produced by each `MismatchInjection` mode, on the bundled model.

For every mode, vLLM (CPU) samples a few dozen chat completions; the fp32 `Trainer`
recomputes their logprobs (`compute_logprobs`, temperature-scaled like in training) and
`tir_rl.mismatch.mismatch_metrics` scores the gap. The `probe` column is what the
after-sync parity probe would log (prompt logprobs at temperature 1). `Δ/none` is the
mode's mean |Δ logprob| over that of the uninjected fp32 sampler, measured in the same run
(k3 KL of the fp32 sampler is at float32 rounding level, sometimes slightly negative).

    python bench/mismatch_injection.py                    # 8 prompts x 4 samples, 48 tokens
    python bench/mismatch_injection.py --samples 8 --max-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from dataclasses import dataclass

from tir_rl.engine import GenerateRequest, VLLMLocalEngine
from tir_rl.engine.parity import probe_ids_from_text, probe_parity, transformers_logprobs
from tir_rl.mismatch import mismatch_metrics
from tir_rl.mismatch.injection import MismatchInjection
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import TrainBatch
from tir_rl.types import Trajectory

QUESTIONS = [
    "What is 17 * 23? Explain briefly.",
    "Write a Python function that reverses a string.",
    "Name three prime numbers larger than 50.",
    "Why is the sky blue? One paragraph.",
    "Convert 3.5 kilometres to miles.",
    "List the planets of the solar system in order.",
    "What does the `zip` builtin do in Python?",
    "Give a short haiku about autumn.",
]


@dataclass(frozen=True)
class Mode:
    name: str
    inject: MismatchInjection.Config
    temperature: float = 1.0


MODES = [
    Mode("none", MismatchInjection.Config()),
    Mode("none (T=0.7)", MismatchInjection.Config(), 0.7),
    Mode("lm_head bf16", MismatchInjection.Config(lm_head_dtype="bfloat16")),
    Mode("noise 0.01", MismatchInjection.Config(logit_noise_std=0.01)),
    Mode("noise 0.03", MismatchInjection.Config(logit_noise_std=0.03)),
    Mode("noise 0.1", MismatchInjection.Config(logit_noise_std=0.1)),
    Mode("bf16 sampler", MismatchInjection.Config(sampler_dtype="bfloat16")),
    Mode("raw logprobs (T=0.7)", MismatchInjection.Config(raw_logprobs=True), 0.7),
]


def sample(engine, prompts: list[list[int]], *, samples: int, max_tokens: int, temperature: float):
    async def run():
        requests = [
            GenerateRequest(prompt_token_ids=p, max_tokens=max_tokens, temperature=temperature)
            for p in prompts
            for _ in range(samples)
        ]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return [(r.prompt_token_ids, res) for r, res in zip(requests, results, strict=True)]

    return asyncio.run(run())


def score(trainer: Trainer, sampled, temperature: float) -> dict[str, float]:
    trajectories = [
        Trajectory(
            prompt_ids=list(prompt),
            completion_ids=list(res.token_ids),
            loss_mask=[1] * len(res.token_ids),
            sampler_logprobs=list(res.logprobs),
            turn_ids=[0] * len(res.token_ids),
        )
        for prompt, res in sampled
        if res.token_ids
    ]
    batch = TrainBatch.from_trajectories(trajectories)
    trainer.config = dataclasses.replace(trainer.config, temperature=temperature)
    trainer_lp = trainer.compute_logprobs(batch)
    metrics = mismatch_metrics(
        trainer_lp, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids, prefix="m"
    )
    delta = (trainer_lp - batch.sampler_logprobs)[batch.loss_mask]
    metrics["m/frac_gt_0.1"] = float((delta.abs() > 0.1).float().mean())
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    started = time.perf_counter()
    trainer = Trainer(Trainer.Config(model=args.model, dtype="float32"))
    tokenizer = _tokenizer(trainer.model_path)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    probe_ids = probe_ids_from_text(tokenizer)
    state = trainer.rank0_full_state_dict()
    model = trainer.model.eval()
    base = VLLMLocalEngine.Config(
        model_path=str(trainer.model_path), max_model_len=1024, kv_cache_gib=0.5, max_num_seqs=64
    )

    rows: list[tuple[Mode, dict[str, float], float]] = []
    engine_groups: dict[tuple, list[Mode]] = {}
    for mode in MODES:
        engine_config = MismatchInjection(mode.inject).apply_to_engine_config(base)
        engine_groups.setdefault(dataclasses.astuple(engine_config), []).append(mode)
    for modes in engine_groups.values():
        engine_config = MismatchInjection(modes[0].inject).apply_to_engine_config(base)
        with VLLMLocalEngine(engine_config) as engine:
            for mode in modes:
                injection = MismatchInjection(mode.inject)
                if injection.transforms_weights:
                    asyncio.run(
                        engine.update_weights(injection.sampler_state(state, 0, force=True))
                    )
                sampled = sample(
                    engine,
                    prompts,
                    samples=args.samples,
                    max_tokens=args.max_tokens,
                    temperature=mode.temperature,
                )
                metrics = score(trainer, sampled, mode.temperature)
                probe = asyncio.run(
                    probe_parity(
                        engine,
                        lambda ids: transformers_logprobs(model, ids).tolist(),
                        probe_ids,
                        tolerance=float("inf"),
                    )
                )
                rows.append((mode, metrics, probe.max_abs_diff))
                print(f"done: {mode.name} ({time.perf_counter() - started:.0f} s)", flush=True)
                if injection.transforms_weights:
                    asyncio.run(engine.update_weights(state))

    _print_table(rows)
    print(f"\n{len(prompts)} prompts x {args.samples} samples, <= {args.max_tokens} new tokens, "
          f"model {args.model}; total {time.perf_counter() - started:.0f} s")  # fmt: skip


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _print_table(rows) -> None:
    order = {m.name: i for i, m in enumerate(MODES)}
    rows = sorted(rows, key=lambda r: order[r[0].name])
    none_abs = next(m["m/abs_diff_mean"] for mode, m, _ in rows if mode.name == "none")
    header = (
        "| mode | T | tokens | kl | k3 KL | Δ/none | mean abs Δ | max abs Δ | frac abs Δ>0.1 "
        "| chi2_token | top1% share | probe max abs Δ |"
    )
    print()
    print(header)
    print("|" + " --- |" * 12)
    for mode, m, probe in rows:
        ratio = m["m/abs_diff_mean"] / none_abs if none_abs > 0 else float("inf")
        print(
            f"| {mode.name} | {mode.temperature:g} | {m['m/num_tokens']:.0f} | {m['m/kl']:.2e} "
            f"| {m['m/k3_kl']:.2e} | {ratio:.3g} | {m['m/abs_diff_mean']:.2e} "
            f"| {m['m/abs_diff_max']:.3f} | {m['m/frac_gt_0.1']:.4f} | {m['m/chi2_token']:.2e} "
            f"| {m['m/top1pct_abs_diff_share']:.2f} | {probe:.2e} |"
        )


if __name__ == "__main__":
    main()
