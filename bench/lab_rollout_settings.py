"""Rollout tokens/s of one lab step under engine settings, in the real agent loop, in one run.

Each arm is a list of `--set` overrides on configs/lab.yaml. Every measurement runs in its
own process (engine start included, not timed): the engine's environment variables are read
when its core process starts. Arms alternate round by round, so the machine's load drifts
over all of them alike; the table gives each arm's median tokens/s and its ratio to the
first arm. A measurement is one training step's rollout: `--tasks` × `--group` MultiHop
episodes at the config's horizon.

    python bench/lab_rollout_settings.py                       # reserved cores 0 vs 1
    python bench/lab_rollout_settings.py --arm "" --arm "engine.local.block_size=64" --rounds 3

Measured on the shared 2-core CPU machine (8 tasks x 8 samples, horizon 4, 2 rounds, while
another session's tests ran at nice 15), per measurement in round order:

    engine.local.cpu_reserved_cores=0   488, 835 tok/s   (median 661)
    engine.local.cpu_reserved_cores=1   654, 575 tok/s   (median 614, ratio 0.93)

Inconclusive under that load: with one reserved core the engine computes on one thread
(about 600-650 tok/s, steadier under load); with none it reached 835 tok/s in the quieter
round. The default stays 0. At 835 tok/s one lab step's rollout (~14K sampled tokens) takes
about 17 s: the engine is vocabulary-bound (docs/lab_model.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure_once(overrides: list[str], tasks: int, group: int, seed: int) -> dict[str, float]:
    """Start an engine in a child process, play one step's episodes, return its figures."""
    code = f"""
import json, time
from tir_rl.config import load
from tir_rl.run_config import RunConfig
from tir_rl.runtime import env_factory, open_runtime, task_specs

if __name__ == "__main__":
    cfg = load(RunConfig, "configs/lab.yaml", {overrides!r})
    with open_runtime(cfg) as runtime:
        env = env_factory(cfg.env, cfg.env.train_split)
        warm = task_specs(env, num_tasks=1, group_size=2, seed_of=lambda i: 10**6 + i)
        runtime.run_episodes(warm)
        specs = task_specs(env, num_tasks={tasks}, group_size={group}, seed_of=lambda i: {seed} + i)
        t0 = time.perf_counter()
        trajectories = runtime.run_episodes(specs)
        wall = time.perf_counter() - t0
    tokens = sum(t.num_model_tokens for t in trajectories)
    print("RESULT " + json.dumps({{"wall_s": wall, "tokens": tokens}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"arm {overrides} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--arm", action="append", default=None,
        help="comma-separated --set overrides of one arm (repeat; the first is the baseline)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    arms = args.arm or ["engine.local.cpu_reserved_cores=0", "engine.local.cpu_reserved_cores=1"]
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for round_index in range(args.rounds):
        for arm in arms:
            overrides = [o for o in arm.split(",") if o]
            # The same tasks for every arm within a round; new tasks each round.
            figures = measure_once(overrides, args.tasks, args.group, seed=1000 * round_index)
            results[arm].append(figures)
            print(f"round {round_index} {arm or '(config as is)'}: "
                  f"{figures['tokens'] / figures['wall_s']:.0f} tok/s, {figures['wall_s']:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    base = None
    print(f"{'arm':45s} {'tok/s (median)':>15s} {'rollout s':>10s} {'ratio':>6s}")
    for arm, runs in results.items():
        rate = statistics.median(r["tokens"] / r["wall_s"] for r in runs)
        wall = statistics.median(r["wall_s"] for r in runs)
        base = base or rate
        print(f"{arm or '(config as is)':45s} {rate:15.0f} {wall:10.1f} {rate / base:6.2f}")
    print(f"{args.tasks} tasks x {args.group} samples per measurement, {args.rounds} rounds")


if __name__ == "__main__":
    main()
