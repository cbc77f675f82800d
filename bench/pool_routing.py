"""Rollout throughput and prefix-cache hits of an engine pool, on real `vllm serve` servers.

Two servers of configs/lab.yaml's model start once (its engine section: fp32, prefix caching,
block size 32), then every arm plays the same MultiHop episodes (`--tasks` x `--group` at the
config's horizon) through the real agent loop:

    1 server                      the pool of server 0 alone
    2 servers, sticky             an episode stays on its server (the default routing)
    2 servers, least_loaded       every request to the least-loaded server
    2 servers, random             every request to a server drawn at random

Before each arm both servers' prefix caches are reset; the hit rate is vLLM's own counters
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, in tokens, summed over
the servers) over the arm. Arms alternate round by round so the machine's load drifts over
all alike; the table gives medians and each arm's throughput ratio to one server.

    python bench/pool_routing.py                    # 2 rounds, 8 tasks x 4 samples
    python bench/pool_routing.py --rounds 3 --tasks 8 --group 8

On the 2-core CPU machine two servers share the same two cores, so a second server cannot add
compute: what the table can show here is the routing's effect on the prefix cache, and the
cost of splitting the batch. Records: bench/pool_routing_records/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from tir_rl.config import load
from tir_rl.distributed import free_port
from tir_rl.launch import (
    new_run_secret,
    pool_overrides,
    running_servers,
    server_plans,
    trainer_config,
)
from tir_rl.process.run_secret import RunSecret
from tir_rl.run_config import RunConfig
from tir_rl.runtime import env_factory, open_runtime, task_specs

ROOT = Path(__file__).resolve().parent.parent
ARMS = (
    ("1 server", 1, "sticky"),
    ("2 servers, sticky", 2, "sticky"),
    ("2 servers, least_loaded", 2, "least_loaded"),
    ("2 servers, random", 2, "random"),
)


def prefix_counters(url: str, key: dict[str, str]) -> tuple[float, float]:
    """(hits, queries) of the server's prefix cache so far, in tokens."""
    hits = queries = 0.0
    for line in httpx.get(f"{url}/metrics", headers=key, timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def measure(
    tree_file: Path, urls: list[str], routing: str, weights: Path, args: argparse.Namespace
) -> dict[str, float]:
    key_file = weights.parent / "secret"
    key = {"Authorization": RunSecret.read(key_file).authorization}
    overrides = [*pool_overrides(urls, str(weights), key_file), f"engine.http.routing={routing}"]
    if len(urls) == 1:  # one server is a pool of one (the same code path)
        overrides = [o for o in overrides if not o.startswith("engine.http.routing")]
    config = load(RunConfig, tree_file, overrides)
    with open_runtime(config) as runtime:
        for url in urls:
            httpx.post(f"{url}/reset_prefix_cache", headers=key, timeout=30).raise_for_status()
        before = [prefix_counters(u, key) for u in urls]
        env = env_factory(config.env, config.env.train_split)
        specs = task_specs(
            env, num_tasks=args.tasks, group_size=args.group, seed_of=lambda i: args.seed + i
        )
        t0 = time.perf_counter()
        trajectories = runtime.run_episodes(specs)
        wall = time.perf_counter() - t0
        after = [prefix_counters(u, key) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    tokens = sum(t.num_model_tokens for t in trajectories)
    return {"tok_s": tokens / wall, "hit_rate": hits / max(queries, 1.0), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "lab.yaml"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    config = load(RunConfig, args.config, [])
    work = Path(tempfile.mkdtemp(prefix="tir-rl-pool-bench-"))
    tree_file = work / "pool.yaml"
    tree_file.write_text(yaml.safe_dump(trainer_config(config), sort_keys=False))
    plans = server_plans(config, [free_port(), free_port()], work)
    urls = [p.url for p in plans]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in ARMS}
    with running_servers(plans, new_run_secret(work)):
        for round_index in range(args.rounds):
            for name, servers, routing in ARMS:
                r = measure(tree_file, urls[:servers], routing, work / "weights", args)
                results[name].append(r)
                print(
                    f"round {round_index + 1} {name:26s} {r['tok_s']:7.0f} tok/s  "
                    f"prefix hits {r['hit_rate']:.3f}  ({r['tokens']:.0f} tokens)",
                    flush=True,
                )
    base = statistics.median(r["tok_s"] for r in results[ARMS[0][0]])
    print(
        f"\n{args.tasks} tasks x {args.group} samples, {args.rounds} rounds, "
        f"{Path(args.config).name}, seed {args.seed}"
    )
    print(f"{'arm':26s} {'tok/s (median)':>15s} {'ratio':>6s} {'prefix hit rate (median)':>25s}")
    for name, _, _ in ARMS:
        tok_s = statistics.median(r["tok_s"] for r in results[name])
        hit = statistics.median(r["hit_rate"] for r in results[name])
        print(f"{name:26s} {tok_s:15.0f} {tok_s / base:6.2f} {hit:25.3f}")


if __name__ == "__main__":
    main()
