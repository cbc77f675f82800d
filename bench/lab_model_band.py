"""The lab model's build time and held-out pass@1 per MultiHop horizon, in one command.

Builds the lab model for a logit scale into a fresh folder (timed, as `tir-rl models prepare
lab` would), then evaluates it at temperature 1 on the same held-out tasks (test split, task
indices 0..N-1, one sample each) at every horizon, with the engine settings of
configs/lab.yaml, and prints pass@1 with its 95% bootstrap interval over tasks and whether it
lies in the learnable band 0.2-0.8 (issue 11).

    python bench/lab_model_band.py                          # default scale, horizons 2 4 8
    python bench/lab_model_band.py --logit-scale 0.45       # ~6 minutes on the 2-core machine
    python bench/lab_model_band.py --model FOLDER --dtype bfloat16   # a trained model, bf16 sampler

docs/lab_model.md holds the measured table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

BAND = (0.2, 0.8)


def main() -> None:
    from tir_rl.config import load
    from tir_rl.evaluate import run_eval
    from tir_rl.lab.model import LabModelSpec
    from tir_rl.models import prepare_lab_model
    from tir_rl.run_config import RunConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logit-scale", type=float, default=LabModelSpec().logit_scale)
    parser.add_argument("--seed", type=int, default=0, help="the lab model's code seed")
    parser.add_argument("--horizons", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tasks", type=int, default=64, help="held-out tasks per horizon")
    parser.add_argument("--model", type=Path, help="evaluate this folder instead of building")
    parser.add_argument("--dtype", default="float32", help="the sampler's engine.dtype")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tir-rl-lab-band-") as tmp:
        started = time.perf_counter()
        spec = LabModelSpec(seed=args.seed, logit_scale=args.logit_scale)
        path = args.model or prepare_lab_model(spec, dest=Path(tmp) / "lab")
        build_s = time.perf_counter() - started
        rows = []
        for horizon in args.horizons:
            config = load(
                RunConfig,
                "configs/lab.yaml",
                [
                    f"model={path}",
                    f"env.kwargs.horizon={horizon}",
                    f"rollout.max_turns={horizon + 8}",
                    f"rollout.max_concurrent_episodes={args.tasks}",
                    f"engine.dtype={args.dtype}",
                ],
            )
            outcome = run_eval(config, num_tasks=args.tasks, k=1)
            rows.append((horizon, outcome.report.pass_at_1, outcome.report.wall_time_s))

    if args.model:
        print(f"model {args.model}, sampler dtype {args.dtype}")
    else:
        spec_text = f"logit_scale {args.logit_scale}, seed {args.seed}"
        print(f"lab model, {spec_text}: built in {build_s:.1f} s")
    print(f"{'horizon':>7s}  {'pass@1 [95% CI]':24s} {'in 0.2-0.8':>10s} {'eval s':>7s}")
    for horizon, estimate, wall in rows:
        inside = BAND[0] <= estimate.value <= BAND[1]
        print(f"{horizon:7d}  {str(estimate):24s} {'yes' if inside else 'no':>10s} {wall:7.0f}")
    print(f"{args.tasks} held-out tasks (test split) per horizon, temperature 1, one sample each")


if __name__ == "__main__":
    main()
