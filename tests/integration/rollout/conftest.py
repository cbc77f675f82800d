"""One real vLLM engine (CPU) on a tiny random Llama, shared by the agent-loop tests."""

from __future__ import annotations

import pytest

from tir_rl.models import prepare_tiny_model

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_model_path():
    return prepare_tiny_model()


@pytest.fixture(scope="session")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32").eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_path):
    from tir_rl.engine import VLLMLocalEngine

    config = VLLMLocalEngine.Config(
        model_path=str(tiny_model_path),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=0.125,
        enable_prefix_caching=True,
        max_num_seqs=32,
    )
    with VLLMLocalEngine(config) as engine:
        yield engine
