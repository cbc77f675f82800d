#!/usr/bin/env bash
# The GPU figures of docs/scale.md and docs/lab_model.md in one run on a CUDA machine:
# the trainer's CUDA tests, the trained lab model's precision gap on episodes a run kept,
# bf16 layout noise, and the update pass's tokens/s and MFU on a ~0.42B random Llama
# (with and without trainer.cudnn_attention, and beside the plain loop).
# Each step is time-boxed and writes OUT_DIR/<step>.txt; one failing step does not stop
# the others (each step's exit status is printed).
#
#   bash bench/gpu_figures.sh OUT_DIR runs/RUN/trajectories.jsonl [more.jsonl ...]
set -u
out=${1:?usage: bash bench/gpu_figures.sh OUT_DIR TRAJECTORIES.jsonl [...]}
shift
[ $# -gt 0 ] || { echo "give at least one trajectories.jsonl (a run's kept episodes)"; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    grep -v "Loading weights\|Writing model shards" "$out/$name.txt" | tail -n 30
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

step trainer_tests_cuda 150 python3 -m pytest tests/integration/trainer \
    tests/unit/test_chunked_token_logprobs.py tests/unit/test_token_entropy.py \
    -k cuda -q -p no:cacheprovider --timeout 100
packing=(--device cuda --dtype bfloat16 --model llama-0.5b --num-seqs 64 --min-len 256
    --max-len 2048 --micro-batch-tokens 8192 --train)
step trainer_packing 120 python3 bench/trainer_packing.py "${packing[@]}"
step trainer_packing_cudnn 120 python3 bench/trainer_packing.py "${packing[@]}" --cudnn-attention
step precision_gap 90 python3 bench/precision_gap.py --device cuda --model lab-sft --trajectories "$@"
step plain_loop 90 python3 bench/plain_loop.py --device cuda --dtype bfloat16 \
    --model llama-0.5b --num-seqs 64 --min-len 256 --max-len 2048 --micro-batch-tokens 8192
step layout_noise 90 python3 bench/layout_noise.py --device cuda --model llama-0.5b \
    --num-seqs 16 --max-len 2048
