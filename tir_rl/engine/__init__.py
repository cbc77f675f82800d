"""Sampling engines: token ids in, sampled ids and processed sampler logprobs out.

Backends are imported lazily so that `import tir_rl.engine` never imports vLLM.
"""

from tir_rl.engine.base import (
    PROCESSED_LOGPROBS,
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
)

__all__ = [
    "PROCESSED_LOGPROBS",
    "Engine",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "ModelInfo",
    "VLLMHttpEngine",
    "VLLMLocalEngine",
]


def __getattr__(name: str):
    if name == "VLLMLocalEngine":
        from tir_rl.engine.vllm_local import VLLMLocalEngine

        return VLLMLocalEngine
    if name == "VLLMHttpEngine":
        from tir_rl.engine.vllm_http import VLLMHttpEngine

        return VLLMHttpEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
