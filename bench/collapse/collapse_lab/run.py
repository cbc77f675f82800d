"""Run a collapse-lab suite, then write its report.

    python bench/collapse/run.py                         # corrections suite, CPU-sized
    python bench/collapse/run.py --suite sweep           # noise sweep, no correction
    python bench/collapse/run.py --suite causes          # each real cause, no correction
    python bench/collapse/run.py --gpu                   # GPU-sized (untested here)
    python bench/collapse/run.py --lab                   # the written lab model (no warm start)
    python bench/collapse/run.py --lab-sft --suite map --only h4_no_mismatch,...  # the trained one

Each (setting, seed) is one `tir-rl train` process writing `runs/collapse/<setting>_s<seed>/`;
finished runs are skipped, so an interrupted suite continues where it stopped. The SFT warm
start (`tir-rl sft --config configs/sft/multihop.yaml`) runs first unless `--model` is given;
it is skipped when its checkpoint already exists. The report (`report.py`) runs at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from collapse_lab.settings import MISMATCHES, Setting, suite

LAB_DIR = Path(__file__).resolve().parents[1]
"""bench/collapse/: the lab's base config and its command-line scripts."""
REPO = LAB_DIR.parents[1]

BASE = LAB_DIR / "base.yaml"
SFT_CONFIG = REPO / "configs" / "sft" / "multihop.yaml"
DONE = "DONE"

GPU_SIZE = (
    "run.steps=200",
    "run.tasks_per_step=32",
    "run.group_size=8",
    "run.eval_every=20",
    "run.eval_tasks=128",
    "env.kwargs.horizon=12",
    "rollout.max_turns=16",
    "rollout.max_tokens_per_turn=96",
    "rollout.max_context_tokens=8192",
    "rollout.max_concurrent_episodes=256",
    "engine.local.max_model_len=8192",
    "engine.local.kv_cache_gib=20",
    "trainer.lr=1.0e-6",
    "trainer.micro_batch_tokens=32768",
    "trainer.packing=packed",
)
"""GPU-sized overrides: longer horizon, bigger batch, more steps (docs/scale.md)."""

LAB_CONFIG = REPO / "configs" / "lab.yaml"
"""`--lab` starts from the quickstart's config (the lab model, horizon 4, 8 samples per task,
AdamW on `model.norm.weight` only; docs/lab_model.md) instead of `base.yaml`."""

LAB_GUARD = (
    'guard.absolute={"mismatch/k3_kl": 0.01}',
    "guard.watch=[train/grad_norm, mismatch/k3_kl, mismatch/chi2_token]",
    "guard.smooth=1",
    "guard.failure_tilt_limit=null",
)
"""The guard every lab run records (alerts only, never acted on): k3 above 0.01 per step, and
the gradient norm, k3 and χ² against 10x their rolling median: the guard's defaults until
2026-11-29, named here so the recorded alerts keep one meaning."""

LAB_SIZE = ("run.tasks_per_step=4", "run.plot_every=4", *LAB_GUARD)
"""What the lab runs change in configs/lab.yaml: half the tasks per step, and the guard's
k3 alert of `base.yaml` (alerts are recorded, never acted on)."""

LAB_SFT_CONFIG = REPO / "configs" / "lab_sft.yaml"
"""`--lab-sft` starts from `make train`'s config (the trained lab model `lab-sft`, every weight
at AdamW 1e-4, horizon 4, 8 tasks x 8 samples, 10 steps; docs/lab_model.md)."""

LAB_SFT_SIZE = ("run.plot_every=5", *LAB_GUARD)
"""What the trained lab model's runs change in configs/lab_sft.yaml: the guard's k3 alert of
`base.yaml` (recorded, never acted on), and plots every 5 steps."""

CLEAN_EVAL = "run.eval_clean_sampler=true"
"""Lab runs evaluate with a clean sampler too, except where the engine itself is perturbed."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite", default="corrections", help="corrections|sweep|causes|map|long|breaking|sft_long"
    )
    parser.add_argument("--mismatch", default="noise", choices=sorted(MISMATCHES))
    parser.add_argument("--noise-std", type=float, default=None, help="for --mismatch noise")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--only", default="", help="comma-separated setting names, run in that order"
    )
    parser.add_argument("--model", default=None, help="skip the SFT warm start; use this model")
    parser.add_argument("--out", type=Path, default=Path("runs/collapse"))
    parser.add_argument("--gpu", action="store_true", help="GPU-sized runs")
    parser.add_argument("--lab", action="store_true", help="written lab model runs (model=lab)")
    parser.add_argument(
        "--lab-sft", action="store_true", help="trained lab model runs (configs/lab_sft.yaml)"
    )
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="extra override for every run (repeatable)")  # fmt: skip
    parser.add_argument(
        "--core",
        type=int,
        default=None,
        help="run every process of the suite on this CPU core only (two suites side by side)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args()

    settings = suite(args.suite, args.mismatch, args.noise_std)
    if args.core is not None:
        pin_to_core(args.core)
    if args.only:
        settings = pick(settings, args.only.split(","))
    if args.gpu + args.lab + args.lab_sft > 1:
        raise SystemExit("choose one of --gpu, --lab and --lab-sft")
    lab_config = LAB_CONFIG if args.lab else LAB_SFT_CONFIG if args.lab_sft else None
    if args.lab or args.lab_sft:
        model = args.model or ("lab" if args.lab else "lab-sft")
    else:
        model = args.model or ("<sft>" if args.dry_run else warm_start())
    size = GPU_SIZE if args.gpu else LAB_SIZE if args.lab else LAB_SFT_SIZE if args.lab_sft else ()
    failures = []
    for seed in args.seeds:
        for setting in settings:
            name = f"{setting.name}_s{seed}"
            run_dir = args.out / name
            if (run_dir / DONE).is_file():
                print(f"[collapse] {name}: done already, skipped", flush=True)
                continue
            chosen = [*setting.overrides, *args.extra]
            overrides = [
                f"model={model}", f"run.name={name}", f"run.out_dir={args.out}",
                f"run.seed={seed}", *size,
                *(lab_clean_eval(chosen, lab_config) if lab_config else ()), *chosen,
            ]  # fmt: skip
            cmd = ["tir-rl", "train", "--config", str(lab_config or BASE)]
            for item in overrides:
                cmd += ["--set", item]
            print(f"[collapse] {name}: {setting.what}\n  {' '.join(cmd)}", flush=True)
            if args.dry_run:
                continue
            cmd, resumed = command_for(run_dir, cmd)
            if resumed:
                print(f"[collapse] {name}: unfinished, resumed: {' '.join(cmd)}", flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            with open(run_dir / "train.log", "a" if resumed else "w") as log:
                code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
            took = record_attempt(run_dir, time.perf_counter() - started)
            if code == 0:
                (run_dir / DONE).write_text(f"{sum(took):.1f} s in {len(took)} attempt(s)\n")
                print(f"[collapse] {name}: finished in {sum(took):.0f} s", flush=True)
            else:
                failures.append(name)
                print(f"[collapse] {name}: FAILED (exit {code}), see {run_dir}/train.log")
    if not args.dry_run and not args.no_report:
        subprocess.call([sys.executable, str(LAB_DIR / "report.py"), str(args.out)])
    if failures:
        raise SystemExit(f"failed runs: {', '.join(failures)}")


def pin_to_core(core: int) -> None:
    """Keep this process and every run it starts (trainer, vLLM engine) on `core`.

    Two suites side by side on a 2-core machine, each left to vLLM-CPU's default thread
    binding (every core), took ~48 s per horizon-8 step of 2 x 8 episodes; pinned to a core
    each, ~25 s (2026-11-25): the engines' OpenMP threads no longer fight over both cores.
    """
    if core not in os.sched_getaffinity(0):
        raise SystemExit(
            f"--core {core}: this process may use cores {sorted(os.sched_getaffinity(0))}"
        )
    os.sched_setaffinity(0, {core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.environ["OMP_NUM_THREADS"] = "1"


ATTEMPTS = "attempts.txt"


def record_attempt(run_dir: Path, seconds: float) -> list[float]:
    """Append one attempt's wall time to `run_dir/attempts.txt`; returns every attempt's.

    A run stopped and resumed (`command_for`) is timed over all its attempts, so the wall
    time `DONE` records is the whole run's, not its last part's.
    """
    path = run_dir / ATTEMPTS
    with open(path, "a") as out:
        out.write(f"{seconds:.1f}\n")
    return [float(line) for line in path.read_text().split()]


def command_for(run_dir: Path, fresh: list[str]) -> tuple[list[str], bool]:
    """The command that (re)starts `run_dir`, and whether it resumes.

    An unfinished run with a checkpoint (`run.checkpoint_every`, or the one a stopped run
    saves on SIGINT/SIGTERM) continues from it with `tir-rl train --resume`; one without is
    removed and started again from scratch.
    """
    from tir_rl.trainer.checkpoint import latest_checkpoint

    if run_dir.exists() and latest_checkpoint(run_dir) is not None:
        return ["tir-rl", "train", "--resume", str(run_dir)], True
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return fresh, False


def pick(settings: list[Setting], names: list[str]) -> list[Setting]:
    """The settings called `names`, in that order; an unknown name is refused, not skipped."""
    by_name = {s.name: s for s in settings}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(
            f"--only names no setting of this suite: {', '.join(unknown)}; "
            f"its settings are {', '.join(by_name)}"
        )
    return [by_name[n] for n in names]


def lab_clean_eval(overrides: list[str], config: Path = LAB_CONFIG) -> tuple[str, ...]:
    """`CLEAN_EVAL` for a lab run on `config`, unless it refuses it for these overrides.

    RunConfig decides (it refuses a clean evaluation when the engine itself is perturbed, e.g.
    `inject.sampler_dtype`); this only asks it, so the two cannot drift apart. Overrides that
    fail without `CLEAN_EVAL` too are left for the run itself to report.
    """
    from tir_rl.config import load
    from tir_rl.errors import ConfigError
    from tir_rl.run_config import RunConfig

    try:
        load(RunConfig, config, ["model=tiny", *overrides, CLEAN_EVAL])
    except ConfigError:
        try:
            load(RunConfig, config, ["model=tiny", *overrides])
        except ConfigError:
            return (CLEAN_EVAL,)
        return ()
    return (CLEAN_EVAL,)


def warm_start() -> str:
    """Run (or reuse) the SFT warm start and return its checkpoint folder."""
    out = subprocess.run(
        ["tir-rl", "sft", "--config", str(SFT_CONFIG)], check=True, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    print(out.stdout, end="")
    # the last line ends with the checkpoint folder ("checkpoint: P" or "up to date (...): P")
    path = out.stdout.strip().splitlines()[-1].rsplit(": ", 1)[-1].strip()
    if not Path(path).is_dir():
        raise SystemExit(f"tir-rl sft did not print a checkpoint folder last; got {path!r}")
    return path


if __name__ == "__main__":
    main()
