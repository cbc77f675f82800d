"""Does a lab model survive RL on more than its logit scale? (docs/lab_model.md)

`make train`'s config (configs/lab.yaml: horizon 4, 8 tasks x 8 samples) with
`trainer.train_only` widened from `model.norm.weight` to every weight, or to one group of
them, at AdamW learning rates the issue calls ordinary (1e-5 to 3e-4) and around them. The
`lab-*` runs train the written model; the `sft*` runs train the model bench/lab_sft_model.py
built (`--sft-model`; the number in the name is its SFT steps, `both` a build with
`--splits train test`, `soft0.75` its final norm scaled by bench/lab_sft_soften.py, `ea0.1`
300 more steps on demonstrations that answer early at rate 0.1 (`--init --early-answer-rate`),
`h6`/`h8` the horizon). Each
run's small record (config, metrics, evaluations) is kept in bench/lab_full_weight_records/.

    python bench/lab_full_weight.py --report            # the table, from the kept records
    python bench/lab_full_weight.py --report --weights  # and the lab model's weight sizes
    python bench/lab_full_weight.py --run NAME --core C  # rerun one (about 3-9 minutes)
    python bench/lab_full_weight.py --run sft800-h6-full-lr1e-4 --sft-model FOLDER
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kept_run import keep_record, train_pinned

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RECORDS = HERE / "lab_full_weight_records"

REBALANCED = "model=rebalanced"
SFT = "model=sft"
H8 = ("env.kwargs.horizon=8", "rollout.max_turns=16")

RUNS: dict[str, tuple[str, ...]] = {
    "lab-full-lr1e-4": ("trainer.train_only=[]", "trainer.lr=1e-4"),
    "lab-full-lr3e-5": ("trainer.train_only=[]", "trainer.lr=3e-5"),
    "lab-full-lr1e-5": ("trainer.train_only=[]", "trainer.lr=1e-5", "run.steps=4"),
    "lab-full-lr1e-6": ("trainer.train_only=[]", "trainer.lr=1e-6", "run.steps=4"),
    "lab-vocab-lr1e-5": (
        "trainer.train_only=[lm_head.weight,model.embed_tokens.weight]",
        "trainer.lr=1e-5",
        "run.steps=2",
    ),
    "lab-layers-lr1e-5": ("trainer.train_only=[model.layers.*]", "trainer.lr=1e-5", "run.steps=2"),
    "lab-rebal-full-lr1e-5": (
        REBALANCED,
        "trainer.train_only=[]",
        "trainer.lr=1e-5",
        "run.steps=4",
    ),
    "lab-rebal-full-lr1e-6": (
        REBALANCED,
        "trainer.train_only=[]",
        "trainer.lr=1e-6",
        "run.steps=4",
    ),
    "sft800-h4-full-lr1e-4": (SFT, "trainer.train_only=[]", "trainer.lr=1e-4"),
    "sft800-h6-full-lr1e-4": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=1e-4",
        "env.kwargs.horizon=6",
        "rollout.max_turns=14",
    ),
    "sft800-h6-full-lr1e-3": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=1e-3",
        "env.kwargs.horizon=6",
        "rollout.max_turns=14",
    ),
    "sft800-h6-progress-full-lr3e-4": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=3e-4",
        "env.kwargs.horizon=6",
        "env.kwargs.progress_reward=0.5",
        "rollout.max_turns=14",
    ),
    "sft400-h4-full-lr1e-4": (SFT, "trainer.train_only=[]", "trainer.lr=1e-4"),
    "sft1200-h8-full-lr1e-4": (SFT, "trainer.train_only=[]", "trainer.lr=1e-4", *H8),
    "sft1200-h8-full-lr3e-4": (SFT, "trainer.train_only=[]", "trainer.lr=3e-4", *H8),
    "sft1200-h8-bf16-full-lr1e-4": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=1e-4",
        *H8,
        "engine.dtype=bfloat16",
        "run.parity_tolerance=1.0",  # the bf16 gap is what this run measures
    ),
    "sft1200-h8-full-lr1e-4-20steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=1e-4",
        *H8,
        "run.steps=20",
    ),
    "sft1200-soft0.75-h4-full-lr1e-4": (SFT, "trainer.train_only=[]", "trainer.lr=1e-4"),
    "sft1200-soft0.75-h4-full-lr3e-4": (SFT, "trainer.train_only=[]", "trainer.lr=3e-4"),
    "sft1200-soft0.75-h4-full-lr3e-4-20steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=3e-4",
        "run.steps=20",
    ),
    "sft1200both-soft0.75-h4-full-lr1e-4": (SFT, "trainer.train_only=[]", "trainer.lr=1e-4"),
    "sft1200both-soft0.75-h4-full-lr3e-4": (SFT, "trainer.train_only=[]", "trainer.lr=3e-4"),
    "sft1200both-soft0.75-h4-full-lr3e-4-20steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=3e-4",
        "run.steps=20",
    ),
    "sft1200both-soft0.75-h4-full-lr1e-3-20steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=1e-3",
        "run.steps=20",
    ),
    "sft1200both-soft0.75-h4-full-lr3e-4-40steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=3e-4",
        "run.steps=40",
    ),
    "sft1200both-ea0.1-h4-full-lr1e-4-20steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=1e-4",
        "run.steps=20",
    ),
    **{
        f"sft1200both-ea0.1-h4-full-lr1e-4-20steps-seed{seed}": (
            SFT,
            "trainer.train_only=[]",
            "trainer.lr=1e-4",
            "run.steps=20",
            f"run.seed={seed}",
        )
        for seed in (1, 2)
    },
    "sft1200both-ea0.1-h4-full-lr3e-4-20steps": (
        SFT,
        "trainer.train_only=[]",
        "trainer.lr=3e-4",
        "run.steps=20",
    ),
}
"""Each run's settings on top of configs/lab.yaml (run.seed 0 unless set); `REBALANCED`: the
model of bench/lab_rebalance.py (the same function, its linear weight pairs rescaled); `SFT`:
the model bench/lab_sft_model.py trained (`--sft-model`, its build log in
bench/lab_sft_records/)."""


def run(name: str, core: int | None, sft_model: Path | None) -> None:
    """Train one run of `RUNS` and keep its record."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [*RUNS[name], f"run.name={name}", f"run.out_dir={tmp}"]
        if REBALANCED in sets:
            model = Path(tmp) / "rebalanced"
            subprocess.run([sys.executable, str(HERE / "lab_rebalance.py"), str(model)], check=True)
            sets[sets.index(REBALANCED)] = f"model={model}"
        if SFT in sets:
            if sft_model is None:
                raise SystemExit(f"{name} trains the SFT model: give --sft-model FOLDER")
            sets[sets.index(SFT)] = f"model={sft_model}"
        train_pinned(ROOT / "configs" / "lab.yaml", sets, core)
        keep_record(Path(tmp, name), RECORDS / name)


def report() -> str:
    """One row per kept run: what trained, lr, reward per step, held-out pass@1 before/after."""
    from tir_rl.report.eval_stats import bootstrap_paired_change

    lines = [
        "| run | model | trains | lr | grad norm at step 1 | rollout reward per step | "
        "completion tokens per step | held-out pass@1 before -> after | paired change [95%] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        folder = RECORDS / name
        if not folder.exists():
            continue
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        settings = dict(item.split("=", 1) for item in RUNS[name])
        written = {"rebalanced": "rebalanced", "sft": "SFT-trained"}.get(
            settings.get("model", ""), "as written"
        )
        rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
        tokens = [r["rollout/completion_tokens_mean"] for r in rows if "rollout/reward_mean" in r]
        grad = next(r["train/grad_norm"] for r in rows if r.get("train/grad_norm") is not None)
        evals = sorted(folder.glob("eval_step_*.json"), key=lambda p: int(p.stem.split("_")[-1]))
        first, last = (json.loads(p.read_text()) for p in (evals[0], evals[-1]))
        change = bootstrap_paired_change(first["task_pass_at_1"], last["task_pass_at_1"])
        lines.append(
            f"| {name} | {written} | {_trains(settings['trainer.train_only'])} | "
            f"{settings['trainer.lr']} | {grad:.{1 if grad >= 1 else 2}f} | "
            + " ".join(f"{x:.2f}" for x in rewards)
            + " | "
            + " ".join(f"{x:.0f}" for x in tokens)
            + f" | {first['pass_at_1']['value']:.3f} -> {last['pass_at_1']['value']:.3f} | "
            + f"{change.value:+.3f} [{change.low:+.3f}, {change.high:+.3f}] |"
        )
    return "\n".join(lines)


def _trains(train_only: str) -> str:
    return "every weight" if train_only == "[]" else train_only.strip("[]").replace(",", ", ")


def weights() -> str:
    """Size and sparsity of every weight of the default lab model (built in seconds)."""
    from safetensors.torch import load_file

    from tir_rl.lab.model import LabModelSpec
    from tir_rl.models import prepare_lab_model

    lines = ["| weight | shape | max abs | rms | nonzero |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare_lab_model(LabModelSpec(), Path(tmp) / "lab")
        state = {}
        for path in sorted(folder.glob("*.safetensors")):
            state |= load_file(path)
    for name, tensor in state.items():
        t = tensor.float()
        lines.append(
            f"| {name} | {tuple(t.shape)} | {t.abs().max().item():.3g} | "
            f"{t.pow(2).mean().sqrt().item():.3g} | {(t != 0).float().mean().item():.4f} |"
        )
    return "\n".join(lines)


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the table from the records")
    parser.add_argument("--run", choices=sorted(RUNS), help="rerun one and keep its record")
    parser.add_argument("--core", type=int, help="keep the run on this core")
    parser.add_argument("--weights", action="store_true", help="also the lab model's weights")
    parser.add_argument("--sft-model", type=Path, help="folder bench/lab_sft_model.py wrote")
    args = parser.parse_args()
    if args.run:
        run(args.run, args.core, args.sft_model)
    print(report())
    if args.weights:
        print()
        print(weights())


if __name__ == "__main__":
    main()
