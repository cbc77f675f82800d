"""LoRA (real peft, tiny model): only adapters train; merged weights; adapter checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trainer_helpers import make_batch

from tir_rl.errors import ConfigError
from tir_rl.trainer import Trainer, checkpoint
from tir_rl.trainer.lora import LoRAConfig

peft = pytest.importorskip("peft")

ATTENTION = ("q_proj", "v_proj", "model.layers.1.mlp.*")


def lora_trainer(make_trainer, **overrides) -> Trainer:
    config = LoRAConfig(enabled=True, r=4, alpha=8.0, target_modules=ATTENTION)
    return make_trainer(**{"lora": config, "lr": 1e-2, **overrides})


def adv_for(batch) -> torch.Tensor:
    return torch.tensor([1.0, -1.0, 0.5, -0.5])[: batch.num_sequences]


def test_only_adapter_weights_get_gradients_and_optimizer_state(make_trainer):
    trainer = lora_trainer(make_trainer)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q_proj and v_proj of both layers, plus layer 1's three MLP projections, A and B each
    assert len(trainable) == 2 * (2 * 2 + 3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    batch = make_batch()
    result = trainer.train_step(batch, adv_for(batch))
    assert not result.skipped and result.grad_norm > 0
    state_params = {id(p) for p in trainer.optimizer.state}
    named = dict(trainer.model.named_parameters())
    assert state_params == {id(named[n]) for n in trainable}
    for name, p in trainer.model.named_parameters():
        changed = not torch.equal(p, before[name])
        # B starts at zero, so after one step only B (whose gradient is B-independent) moves
        assert changed == (".lora_B." in name), name


def test_merged_state_dict_is_the_base_model_plus_scaled_adapter_product(make_trainer):
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(make_trainer)
    with torch.no_grad():  # non-zero B so that the merge has something to add
        for name, p in trainer.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn_like(p))
    base = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32)
    base_state = base.state_dict()
    weights_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    merged = trainer.rank0_full_state_dict()

    assert set(merged) == set(base_state)
    for key, tensor in base_state.items():
        assert merged[key].shape == tensor.shape, key
    scale = 8.0 / 4
    named = dict(trainer.model.named_parameters())
    num_merged = 0
    for key, tensor in base_state.items():
        module = key.removesuffix(".weight")
        a = named.get(f"base_model.model.{module}.lora_A.default.weight")
        if a is None:
            assert torch.equal(merged[key], tensor), key
            continue
        b = named[f"base_model.model.{module}.lora_B.default.weight"]
        expected = tensor + scale * (b.detach().cpu() @ a.detach().cpu())
        torch.testing.assert_close(merged[key], expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(merged[key], tensor), key
        num_merged += 1
    assert num_merged == 2 * 2 + 3
    for name, p in trainer.model.named_parameters():  # nothing in the model moved
        assert torch.equal(p, weights_before[name]), name


@pytest.mark.parametrize("init", ["default", "pissa"])
def test_merged_weights_reproduce_the_adapted_model_logits(make_trainer, init):
    from transformers import AutoModelForCausalLM

    lora = LoRAConfig(enabled=True, r=4, alpha=8.0, target_modules=ATTENTION, init=init)
    trainer = lora_trainer(make_trainer, lora=lora)
    batch = make_batch()
    for _ in range(2):
        trainer.train_step(batch, adv_for(batch))
    merged = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32)
    merged.load_state_dict(trainer.rank0_full_state_dict())
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    trainer.model.eval()
    adapted = trainer.model(input_ids=ids.to(trainer.device)).logits.cpu()
    torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("init", ["default", "pissa"])
def test_checkpoint_loads_with_peft_and_resume_reproduces_the_next_step(
    make_trainer, tmp_path, init
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    lora = LoRAConfig(enabled=True, r=4, alpha=8.0, target_modules=ATTENTION, init=init)
    first = lora_trainer(make_trainer, lora=lora)
    first.train_step(batch, adv_for(batch))
    path = checkpoint.save(tmp_path / "step_1", first, data_position=3)
    merged_at_save = first.rank0_full_state_dict()
    expected = first.train_step(batch, adv_for(batch))
    expected_params = {n: p.detach().clone() for n, p in first.model.named_parameters()}

    # The adapter folder is peft's own; the model folder is the merged HF model.
    base = AutoModelForCausalLM.from_pretrained(first.model_path, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, path / checkpoint.ADAPTER_DIR)
    merged_by_peft = adapted.merge_and_unload().state_dict()
    for key, tensor in merged_at_save.items():
        torch.testing.assert_close(merged_by_peft[key], tensor, rtol=1e-5, atol=1e-6)
    model_dir = path / checkpoint.MODEL_DIR
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    from_folder = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for key, tensor in from_folder.state_dict().items():
        torch.testing.assert_close(tensor, merged_at_save[key], rtol=0, atol=0)

    second = lora_trainer(make_trainer, lora=lora, seed=99)
    resumed = checkpoint.load(path, second)
    assert resumed.step == 1 and resumed.data_position == 3
    got = second.train_step(batch, adv_for(batch))
    assert got.loss == expected.loss
    assert got.grad_norm == expected.grad_norm
    for name, p in second.model.named_parameters():
        assert torch.equal(p, expected_params[name]), name


def test_pissa_starts_at_the_base_model_and_trains_both_factors(make_trainer):
    """PiSSA: B A is the top-r part of W, the frozen weight its residual; the sum is W."""
    from transformers import AutoModelForCausalLM

    lora = LoRAConfig(enabled=True, r=4, alpha=4.0, target_modules=ATTENTION, init="pissa")
    trainer = lora_trainer(make_trainer, lora=lora)
    base = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32)
    merged = trainer.rank0_full_state_dict()
    for key, tensor in base.state_dict().items():
        torch.testing.assert_close(merged[key], tensor, rtol=1e-5, atol=1e-5)
    named = dict(trainer.model.named_parameters())
    residual = named["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    original = base.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert (residual.detach().cpu() - original).abs().max() > 1e-3  # W itself was replaced
    b = named["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert b.detach().abs().max() > 0  # unlike LoRA's default, B does not start at zero

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    batch = make_batch()
    trainer.train_step(batch, adv_for(batch))
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert all(".lora_" in n for n in moved)


def test_pissa_on_an_untied_head_checkpoints_only_the_adapter_and_loads_with_peft(
    tiny_model_path, device, tmp_path
):
    """The learning test's set-up (PiSSA on lm_head), on a copy of the tiny model whose head
    is untied: peft counts lm_head as an embedding layer and would also save its (residual)
    base weight; the adapter folder holds A and B only, and loads on the original base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model_path, tmp_path / "untied")  # tokenizer files too
    untied = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    untied.save_pretrained(tmp_path / "untied")
    lora = LoRAConfig(enabled=True, r=4, alpha=4.0, target_modules=("lm_head",), init="pissa")
    config = Trainer.Config(model=str(tmp_path / "untied"), lora=lora, lr=1e-2, device=device)
    trainer = Trainer(config)
    batch = make_batch()
    trainer.train_step(batch, adv_for(batch))
    path = checkpoint.save(tmp_path / "step_1", trainer)
    merged_at_save = trainer.rank0_full_state_dict()

    saved = peft.utils.load_peft_weights(str(path / checkpoint.ADAPTER_DIR), device="cpu")
    assert sorted(saved) == [
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.lora_B.weight",
    ]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "untied", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, path / checkpoint.ADAPTER_DIR)
    merged_by_peft = adapted.merge_and_unload().state_dict()
    for key, tensor in merged_at_save.items():
        torch.testing.assert_close(merged_by_peft[key], tensor, rtol=1e-5, atol=1e-5)


def test_pissa_rank_above_a_targets_dimension_is_refused(make_trainer):
    lora = LoRAConfig(enabled=True, r=4096, alpha=8.0, target_modules=("q_proj",), init="pissa")
    with pytest.raises(ConfigError, match="top r=4096 singular vectors.*choose r <="):
        lora_trainer(make_trainer, lora=lora)


def test_resume_refuses_a_checkpoint_of_the_other_kind(make_trainer, tmp_path):
    path = checkpoint.save(tmp_path / "full", make_trainer())
    with pytest.raises(ConfigError, match="full fine-tuning checkpoint"):
        checkpoint.load(path, lora_trainer(make_trainer))


@pytest.mark.parametrize(
    ("lora", "train_only", "match"),
    [
        (LoRAConfig(enabled=True, r=0), (), "positive rank"),
        (LoRAConfig(enabled=True, dropout=1.0), (), "dropout"),
        (LoRAConfig(enabled=True, target_modules=()), (), "target_modules is empty"),
        (LoRAConfig(enabled=True, init="pisa"), (), "init 'pisa' is not known.*pissa"),
        (LoRAConfig(enabled=True), ("model.norm.weight",), "train_only both choose"),
    ],
)
def test_bad_lora_settings_are_refused_at_load_time(lora, train_only, match):
    with pytest.raises(ConfigError, match=match):
        Trainer.Config(lora=lora, train_only=train_only).validate()


def test_targets_that_match_nothing_or_a_tied_head_are_refused(make_trainer):
    with pytest.raises(ConfigError, match="matches no linear module.*q_proj"):
        lora_trainer(make_trainer, lora=LoRAConfig(enabled=True, target_modules=("qproj",)))
    with pytest.raises(ConfigError, match="tied to the input embedding"):
        lora_trainer(make_trainer, lora=LoRAConfig(enabled=True, target_modules=("lm_head",)))


def test_missing_peft_is_a_config_error_naming_the_extra(make_trainer, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ConfigError, match=r'pip install "tir-rl\[lora\]"'):
        lora_trainer(make_trainer)


def test_lora_on_several_ranks_is_refused_before_the_model_loads(make_trainer, monkeypatch):
    from tir_rl import distributed as tdist
    from tir_rl.trainer import trainer as trainer_module

    monkeypatch.setattr(tdist, "world_size", lambda: 2)
    monkeypatch.setattr(trainer_module, "resolve_model", lambda name: pytest.fail("loaded"))
    with pytest.raises(ConfigError, match="one rank only"):
        lora_trainer(make_trainer)
