"""Turn a built lab model's confidence down: scale its final norm's weight, keep the rest.

    python bench/lab_sft_soften.py --model /tmp/lab-sft --out /tmp/lab-sft-soft --scale 0.6

The final norm's weight multiplies every logit (the head is tied to the embedding and the
norm comes just before it), so scaling it by s is sampling at temperature 1/s with every
other weight unchanged: the trained model's procedure stays, its sampled episodes fail more
often. The output folder is a checkpoint like the input (config, tokenizer, template).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a built lab model folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scale", type=float, required=True, help="factor on model.norm.weight")
    args = parser.parse_args()
    if not 0.0 < args.scale:
        parser.error(f"--scale must be > 0, got {args.scale}")

    from safetensors.torch import load_file, save_file

    shutil.copytree(args.model, args.out, dirs_exist_ok=True)
    files = sorted(args.out.glob("*.safetensors"))
    for path in files:
        weights = load_file(str(path))
        if "model.norm.weight" in weights:
            weights["model.norm.weight"] = weights["model.norm.weight"] * args.scale
            save_file(weights, str(path), metadata={"format": "pt"})
            print(f"{path.name}: model.norm.weight x {args.scale:g}")
            return
    raise SystemExit(f"no model.norm.weight in {[p.name for p in files]} under {args.model}")


if __name__ == "__main__":
    main()
