"""Raw vLLM AsyncLLM generate vs the VLLMLocalEngine wrapper: tokens per second, one engine.

Both paths drive the same engine instance with the same seeded requests (N prompts in
flight, M new tokens each): (a) `AsyncLLM.generate` directly on the engine's loop, (b)
`VLLMLocalEngine.generate` from a separate caller loop (what the agent loop does).

    python bench/engine_throughput.py --model bundled --num 32 --max-tokens 128
"""

import argparse
import asyncio
import time

from tir_rl.engine import GenerateRequest, VLLMLocalEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="bundled | tiny | a checkpoint folder")
    parser.add_argument("--num", type=int, default=32, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = VLLMLocalEngine.Config(
        model_path=args.model, max_model_len=1024, kv_cache_gib=1.0, max_num_seqs=max(args.num, 1)
    )
    prompt = [1, 504, 2462, 314, 253, 1789, 30, 198]
    requests = [
        GenerateRequest(prompt_token_ids=prompt, max_tokens=args.max_tokens, seed=i)
        for i in range(args.num)
    ]
    with VLLMLocalEngine(config) as engine:

        async def raw_all():
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            async def one(i, r):
                params = SamplingParams(
                    temperature=1.0, max_tokens=r.max_tokens, seed=r.seed, logprobs=0,
                    detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                )  # fmt: skip
                async for out in engine._llm.generate(
                    {"prompt_token_ids": prompt}, params, f"raw-{time.time_ns()}-{i}"
                ):
                    last = out
                return len(last.outputs[0].token_ids)

            return sum(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))

        async def wrapped_all():
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
            return sum(len(r.token_ids) for r in results)

        def measure(fn):
            start = time.perf_counter()
            tokens = fn()
            return tokens / (time.perf_counter() - start)

        measure(lambda: engine._loop.run_sync(raw_all()))  # warm-up
        raw, wrapped = [], []
        for _ in range(args.repeats):
            raw.append(measure(lambda: engine._loop.run_sync(raw_all())))
            wrapped.append(measure(lambda: asyncio.run(wrapped_all())))
    r, w = max(raw), max(wrapped)
    print(
        f"model={args.model} requests={args.num} max_tokens={args.max_tokens} "
        f"(best of {args.repeats})"
    )
    print("| path | tokens/s | ratio |\n|---|---|---|")
    print(f"| AsyncLLM.generate (raw) | {r:.1f} | 1.00 |")
    print(f"| VLLMLocalEngine.generate | {w:.1f} | {w / r:.2f} |")


if __name__ == "__main__":
    main()
