import pytest

from tir_rl.models import prepare_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path():
    return prepare_tiny_model()


@pytest.fixture(scope="session")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32").eval()


@pytest.fixture(scope="session")
def probe_ids(tiny_model_path):
    from transformers import AutoTokenizer

    from tir_rl.engine.parity import probe_ids_from_text

    return probe_ids_from_text(AutoTokenizer.from_pretrained(tiny_model_path))


@pytest.fixture
def perturbed_model(hf_model):
    """A copy of the tiny model with every matrix perturbed (tied embeddings stay tied)."""
    import copy

    import torch

    model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(0.5 * param.std() * torch.randn(param.shape, generator=gen))
    return model
