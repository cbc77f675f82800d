"""The engine's decode throughput as a function of the sequences it runs at once, on real vLLM.

A synchronous RL step ends with a tail: as a group's last episodes finish, fewer sequences
share the engine, and each runs faster than at full load but the engine as a whole slower.
A simulation of that tail (`bench/async_sim.py`'s colocated baseline, issue 47) needs the
curve, measured rather than assumed: for each concurrency c, c requests of `--max-tokens`
tokens each (no stop token, so every request runs to the end) go to one engine at once;
tokens/s is the engine's total, per sequence is tokens/s / c. Concurrencies are interleaved
within each repeat and the best of `--repeats` is kept (the machine is shared and noisy).

    python bench/engine_concurrency.py --model bundled \\
        --json bench/engine_concurrency_records/bundled.json
    python bench/engine_concurrency.py --model lab --cpu-cores 0 \\
        --json bench/engine_concurrency_records/lab_core0.json     # the engine on core 0 only

`--json` writes {"model", "max_tokens", "repeats", "rows": [{"concurrency", "tokens_per_s"}]}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="bundled | tiny | lab-sft | a folder")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cpu-cores", help="engine.local.cpu_cores (default: every core)")
    parser.add_argument("--json", type=Path, help="write the curve here")
    args = parser.parse_args()

    from tir_rl.engine import GenerateRequest, VLLMLocalEngine

    levels = [int(c) for c in args.concurrency.split(",")]
    config = VLLMLocalEngine.Config(
        model_path=args.model,
        max_model_len=1024,
        kv_cache_gib=1.0,
        max_num_seqs=max(levels),
        cpu_cores=args.cpu_cores,
    )
    # distinct prompts, so that no request reads another's blocks from the prefix cache
    prompts = [[1, 504, 2462, 314, 253, 1789, 30, 198, 100 + i] * 4 for i in range(max(levels))]

    async def run(c: int) -> float:
        requests = [
            GenerateRequest(prompt_token_ids=prompts[i], max_tokens=args.max_tokens)
            for i in range(c)
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)

    best: dict[int, float] = {}
    with VLLMLocalEngine(config) as engine:
        asyncio.run(run(min(levels)))  # warm-up
        for _ in range(args.repeats):
            for c in levels:
                best[c] = max(best.get(c, 0.0), asyncio.run(run(c)))

    top = best[max(levels)]
    cores = args.cpu_cores or "all"
    print(
        f"model {args.model}, cores {cores}, {args.max_tokens} tokens per request, "
        f"best of {args.repeats}"
    )
    print(f"{'concurrency':>11} {'tokens/s':>9} {'per sequence':>13} {'of max load':>12}")
    for c in levels:
        print(f"{c:>11} {best[c]:>9.1f} {best[c] / c:>13.2f} {best[c] / top:>12.3f}")
    if args.json:
        rows = [{"concurrency": c, "tokens_per_s": round(best[c], 2)} for c in levels]
        payload = {"model": args.model, "cpu_cores": cores, "max_tokens": args.max_tokens,
                   "repeats": args.repeats}  # fmt: skip
        args.json.write_text(json.dumps({**payload, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
