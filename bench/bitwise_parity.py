"""Can the trainer's logprobs equal vLLM-CPU's bit for bit? The evidence, per model.

Bitwise on-policy training needs the trainer's teacher-forced logprob of every sampled
token to equal the one the sampler recorded while decoding. This measures, on real
vLLM-CPU in float32 at T = 1 (processed logprobs) and the trainer's transformers model:

Each model's engine runs twice: with vLLM-CPU's default, which may split a long
sequence's keys over threads when decoding, and with that split off
(`engine.local.cpu_attention_split_kv: false`, what a run with `trainer.kernels: vllm_cpu` uses).

1. decode vs prefill inside vLLM: the logprobs vLLM recorded while sampling against the
   prompt logprobs it gives for the same finished sequences in one prefill. If vLLM itself
   does not reproduce its decode-time logprobs in a prefill, no trainer that computes the
   sequence in one forward (as every trainer does) can match them bitwise, whatever its
   kernels: the decode steps run every matmul and attention at another row count.
2. the trainer's logprobs against vLLM's decode (what training compares) and prefill, with
   transformers' own kernels (`trainer.kernels: torch`, the default) and with vLLM's
   (`trainer.kernels: vllm_cpu`); sampled one request at a time and four at a time.
3. the same, one request at a time, for prompts of 100 to 800 tokens (split off): where
   vLLM's decode over a long context stops equalling its prefill.
4. torch's CPU matmul at the model's shapes: the rows of `x[:m] @ W.T` that equal the
   same rows of `x @ W.T` bit for bit, for row counts m a decode step or a shorter batch
   uses: whether the trainer's own GEMM is row-count invariant.

    python bench/bitwise_parity.py --models tiny bundled lab-sft \\
        | grep -v '^(' > bench/localize_records/bitwise.txt
"""

from __future__ import annotations

import argparse
import asyncio

NUM_SAMPLES = 4
MAX_TOKENS = 24
CONTEXT_LENGTHS = (100, 200, 400, 800)
"""Prompt lengths of the long-context sweep (the probe text repeated)."""
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def compare(a: list[float], b: list[float]) -> str:
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    return f"{equal}/{len(a)} bitwise equal, max |Δ| {worst:.2e}"


def kernels_model(path):
    """The float32 transformers model at `path`, on vLLM-CPU's kernels (`trainer.kernels`)."""
    from transformers import AutoModelForCausalLM

    from tir_rl.trainer.vllm_cpu_kernels import use_vllm_cpu_kernels

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    use_vllm_cpu_kernels(model)
    return model


def engine_config(path, *, max_model_len: int, split_kv: bool):
    from tir_rl.engine import VLLMLocalEngine

    return VLLMLocalEngine.Config(
        model_path=str(path), max_model_len=max_model_len, kv_cache_gib=0.25, max_num_seqs=8,
        cpu_attention_split_kv=split_kv,
    )  # fmt: skip


def logprob_rows(name: str, split_kv: bool) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tir_rl.engine import VLLMLocalEngine
    from tir_rl.engine.base import GenerateRequest
    from tir_rl.engine.parity import (
        DEFAULT_SAMPLED_PROBE_PROMPT,
        probe_ids_from_text,
        transformers_logprobs,
    )
    from tir_rl.models import resolve_model

    path = resolve_model(name)
    prompt = probe_ids_from_text(AutoTokenizer.from_pretrained(path), DEFAULT_SAMPLED_PROBE_PROMPT)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    kernels = kernels_model(path)
    config = engine_config(path, max_model_len=512, split_kv=split_kv)
    decode: list[float] = []
    prefill: list[float] = []
    teacher: list[float] = []
    teacher_kernels: list[float] = []

    def request(seed: int) -> GenerateRequest:
        return GenerateRequest(
            prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed
        )

    async def sample(engine: VLLMLocalEngine) -> list:
        alone = [await engine.generate(request(seed)) for seed in range(NUM_SAMPLES)]
        together = await asyncio.gather(
            *(engine.generate(request(seed)) for seed in range(NUM_SAMPLES, 2 * NUM_SAMPLES))
        )
        return [*alone, *together]

    with VLLMLocalEngine(config) as engine:
        for result in asyncio.run(sample(engine)):
            full = [*prompt, *result.token_ids]
            start = len(prompt) - 1
            decode += list(result.logprobs)
            prefill += asyncio.run(engine.prompt_logprobs(full))[start:]
            teacher += transformers_logprobs(trainer, full).tolist()[start:]
            teacher_kernels += transformers_logprobs(kernels, full).tolist()[start:]
    name = f"{name}, split KV {'on' if split_kv else 'off'}"
    return [
        f"| {name} | vLLM decode vs vLLM prefill | {compare(decode, prefill)} |",
        f"| {name} | trainer (kernels torch) vs vLLM decode | {compare(teacher, decode)} |",
        f"| {name} | trainer (kernels torch) vs vLLM prefill | {compare(teacher, prefill)} |",
        f"| {name} | trainer (kernels vllm_cpu) vs vLLM decode | "
        f"{compare(teacher_kernels, decode)} |",
        f"| {name} | trainer (kernels vllm_cpu) vs vLLM prefill | "
        f"{compare(teacher_kernels, prefill)} |",
    ]


def length_rows(name: str) -> list[str]:
    from transformers import AutoTokenizer

    from tir_rl.engine import VLLMLocalEngine
    from tir_rl.engine.base import GenerateRequest
    from tir_rl.engine.parity import probe_ids_from_text, transformers_logprobs
    from tir_rl.models import resolve_model

    path = resolve_model(name)
    probe = probe_ids_from_text(AutoTokenizer.from_pretrained(path))
    kernels = kernels_model(path)
    config = engine_config(path, max_model_len=1024, split_kv=False)
    rows = []
    with VLLMLocalEngine(config) as engine:
        for length in CONTEXT_LENGTHS:
            prompt = (probe * (length // len(probe) + 1))[:length]
            decode: list[float] = []
            prefill: list[float] = []
            trainer: list[float] = []
            for seed in range(2):
                request = GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed
                )
                result = asyncio.run(engine.generate(request))
                full = [*prompt, *result.token_ids]
                decode += list(result.logprobs)
                prefill += asyncio.run(engine.prompt_logprobs(full))[length - 1 :]
                trainer += transformers_logprobs(kernels, full).tolist()[length - 1 :]
            rows += [
                f"| {name}, {length}-token prompt | vLLM decode vs vLLM prefill | "
                f"{compare(decode, prefill)} |",
                f"| {name}, {length}-token prompt | trainer (kernels vllm_cpu) vs vLLM decode | "
                f"{compare(trainer, decode)} |",
            ]
    return rows


def matmul_rows(name: str, num_tokens: int = 92) -> list[str]:
    import torch
    from transformers import AutoConfig

    from tir_rl.models import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(name))
    gen = torch.Generator().manual_seed(0)
    rows = []
    shapes = {
        "MLP up (hidden -> intermediate)": (cfg.intermediate_size, cfg.hidden_size),
        "MLP down (intermediate -> hidden)": (cfg.hidden_size, cfg.intermediate_size),
        "head (hidden -> vocab)": (cfg.vocab_size, cfg.hidden_size),
    }
    for what, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
        x = torch.randn(num_tokens, in_features, generator=gen)
        full = torch.nn.functional.linear(x, weight)
        same = []
        for m in ROW_COUNTS:
            part = torch.nn.functional.linear(x[:m], weight)
            same.append(f"{m}: {int((part == full[:m]).all(-1).sum())}/{m}")
        rows.append(f"| {name} | torch linear, {what}, rows equal to a {num_tokens}-row call | "
                    f"{', '.join(same)} |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "bundled", "lab-sft"])
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows = []
    for name in args.models:
        rows += logprob_rows(name, True) + logprob_rows(name, False)
        rows += length_rows(name) + matmul_rows(name)
    print("| model | comparison | result |\n| --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
