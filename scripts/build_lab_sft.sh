#!/usr/bin/env bash
# Rebuild the trained lab model shipped in tir_rl/data/lab_sft (`model: lab-sft`) and compare
# its weights with the shipped ones. About 20 minutes on the 2-core machine:
#   1. 1,200 SFT steps on oracle MultiHop episodes of both splits' names (2 threads);
#   2. 300 more on a demonstrator that answers before the last hop at rate 0.1 (1 thread).
# The thread counts are part of the recipe: they change the order of float sums.
#   bash scripts/build_lab_sft.sh [OUT]      (default build/lab-sft)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/lab-sft}"
py=.venv/bin/python
horizons=(1 2 3 4 5 6 7 8)
"$py" bench/lab_sft_model.py --out "$out-stage1" --steps 1200 --horizons "${horizons[@]}" \
    --splits train test --threads 2
"$py" bench/lab_sft_model.py --init "$out-stage1" --out "$out" --early-answer-rate 0.1 \
    --steps 300 --lr 1e-3 --horizons "${horizons[@]}" --splits train test --threads 1
"$py" - "$out" <<'PY'
import hashlib, sys
from pathlib import Path
from tir_rl.models import LAB_SFT_SHA256
digest = hashlib.sha256((Path(sys.argv[1]) / "model.safetensors").read_bytes()).hexdigest()
print(f"sha256 {digest}: {'the shipped weights' if digest == LAB_SFT_SHA256 else 'NOT the shipped weights ' + LAB_SFT_SHA256}")
sys.exit(digest != LAB_SFT_SHA256)
PY
