#!/usr/bin/env bash
# The trainer's CUDA tests on a GPU machine without vLLM, in under a minute there.
#
#   bash bench/gpu_trainer_tests.sh OUT_DIR
#
# Run from the checkout root, carrying two git-ignored folders with it:
#   .whl/     wheels of the pure-Python packages such a machine lacks (gymnasium,
#             farama-notifications, dill: `pip download --only-binary=:all: --no-deps
#             --python-version 3.12 --platform manylinux2014_x86_64 -d .whl ...`)
#   .gpukit/  models/ with the prepared tiny model, copied from ~/.cache/tir-rl/models
# The package goes to /tmp/site; the checkout stays first on PYTHONPATH, so the tests run
# this tree's code.
set -u
out=${1:?usage: bash bench/gpu_trainer_tests.sh OUT_DIR}
mkdir -p "$out"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"
start=$SECONDS
pip install --no-index --no-deps --no-build-isolation --target /tmp/site . .whl/*.whl \
    > "$out/install.txt" 2>&1
echo "install: exit $? after $((SECONDS - start)) s"
ln -sfn ../envs tir_rl/envs # setuptools maps tir_rl.envs to envs/; the checkout must too
export PYTHONPATH=$PWD:/tmp/site TIR_RL_CACHE=$PWD/.gpukit PYTHONUNBUFFERED=1
start=$SECONDS
timeout 330 python3 -m pytest tests/integration/trainer tests/unit/test_chunked_token_logprobs.py \
    tests/unit/test_token_entropy.py -k cuda -q -p no:cacheprovider --timeout 120 \
    > "$out/trainer_tests_cuda.txt" 2>&1
echo "trainer tests: exit $? after $((SECONDS - start)) s"
tail -n 25 "$out/trainer_tests_cuda.txt"
