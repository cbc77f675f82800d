"""The trainer's forward on vLLM's batch-invariant CUDA kernels (`trainer.kernels`).

vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`, `vllm.model_executor.determinism`)
replaces torch's CUDA matrix products, softmax, log-softmax and means with kernels whose
reduction order does not depend on how many rows run together, so a sequence's logprobs do
not depend on the batch it is in. This is the approach of the vLLM + TorchTitan result
(sampler and trainer bitwise equal, docs/mismatch.md): the trainer process turns the same
mode on, and computes attention with transformers' eager implementation (matrix products and
a softmax, each now batch-invariant), and the engine starts with the same variable
(`tir_rl.engine.batch_invariance`).

Untested here: no GPU with vLLM installed was available to this project (vLLM cannot be
installed on the GPU machine it was lent). The trainer's batch invariance is tested where CUDA
and vLLM are both present (`tests/integration/trainer/test_batch_invariant_kernels.py`);
whether the trainer then equals the sampler bit for bit also depends on the engine's attention
backend (vLLM's docs list the supported ones) and is for `tir-rl doctor` to measure.
"""

from __future__ import annotations

import os

from tir_rl.engine.batch_invariance import ENV, check_environment
from tir_rl.errors import ConfigError


def use_batch_invariant_kernels() -> None:
    """Turn vLLM's batch-invariant mode on in this process (idempotent).

    Raises:
        ConfigError: vLLM is not installed where the trainer runs, or the environment sets
            `VLLM_BATCH_INVARIANT` to something other than 1.
    """
    check_environment("trainer.kernels batch_invariant", "use trainer.kernels torch")
    os.environ[ENV] = "1"
    try:
        from vllm.model_executor.determinism import batch_invariant
    except ImportError as exc:
        raise ConfigError(
            "trainer.kernels batch_invariant runs vLLM's batch-invariant kernels in the "
            f"trainer, and vLLM cannot be imported here ({exc}). Install vLLM where the "
            "trainer runs, or use trainer.kernels torch."
        ) from exc
    batch_invariant.init_batch_invariance()
