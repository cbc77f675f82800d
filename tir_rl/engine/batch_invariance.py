"""vLLM's batch-invariant mode for a local engine (`engine.local.batch_invariant`).

With `VLLM_BATCH_INVARIANT=1` vLLM's workers run kernels whose results do not depend on the
batch a request runs in (`vllm.model_executor.determinism`): the sampler's half of the
bitwise on-policy result. The pinned vLLM offers it on CUDA only, so a CPU engine refuses it
(`trainer.kernels: vllm_cpu` is the CPU's way). Untested on a GPU here: no GPU with vLLM was
available to this project.
"""

from __future__ import annotations

import contextlib
import os

from tir_rl.engine.start_environment import variable_for_start
from tir_rl.errors import ConfigError

ENV = "VLLM_BATCH_INVARIANT"


def check_environment(setting: str, alternative: str) -> None:
    """Refuse `setting` when the environment turns vLLM's batch-invariant mode off."""
    if os.environ.get(ENV, "1") != "1":
        raise ConfigError(
            f"{setting} turns vLLM's batch-invariant mode on, but the environment sets "
            f"{ENV}={os.environ[ENV]}. Unset it, or {alternative}."
        )


def check_platform(enabled: bool) -> None:
    """Refuse the mode where vLLM does not offer it, or an environment that says otherwise."""
    if not enabled:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise ConfigError(
            f"engine.local.batch_invariant starts vLLM in its batch-invariant mode, which the "
            f"installed vLLM offers on CUDA only; this engine runs on "
            f"{current_platform.device_type}. On a CPU, trainer.kernels vllm_cpu matches the "
            "sampler instead; or set engine.local.batch_invariant false."
        )
    check_environment("engine.local.batch_invariant", "set engine.local.batch_invariant false")


def environment(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """`VLLM_BATCH_INVARIANT=1` for an engine's start (its engine core inherits it)."""
    return variable_for_start(ENV, "1" if enabled else None)
