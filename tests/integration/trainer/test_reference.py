"""The KL penalty's frozen reference policy (tiny model): exact at step 0, frozen, pulls back."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import make_batch

from tir_rl.errors import ConfigError
from tir_rl.trainer import Trainer, checkpoint
from tir_rl.trainer.batch import Packing
from tir_rl.trainer.lora import LoRAConfig
from tir_rl.trainer.loss import GRPOLoss, LossTerms, k3

ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


@pytest.fixture
def kl_trainer(tiny_model_path, device):
    def build(kl_coef: float = 0.1, **overrides) -> Trainer:
        settings = {"lr": 1e-3, "device": device, "micro_batch_tokens": 24, **overrides}
        config = Trainer.Config(model=str(tiny_model_path), **settings)
        return Trainer(config, loss_fn=GRPOLoss(terms=LossTerms(kl_coef=kl_coef)))

    return build


def mean_k3(policy: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(θ ‖ ref) per model token, as the loss computes it."""
    return float(k3(reference - policy)[mask].mean())


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("packing", list(Packing))
def test_reference_logprobs_equal_the_policy_logprobs_before_any_update(kl_trainer, packing):
    trainer = kl_trainer(packing=packing)
    batch = make_batch()
    assert torch.equal(trainer.compute_reference_logprobs(batch), trainer.compute_logprobs(batch))
    before = state(trainer.model)
    # All advantages 0: the loss is the KL term alone, exactly 0 with an exactly 0 gradient
    # (the update forward and the reference's no-grad forward agree bit for bit), so even
    # AdamW, which turns any non-zero gradient into a step of about lr, moves nothing.
    result = trainer.train_step(batch, torch.zeros(batch.num_sequences))
    assert result.metrics["train/ref_kl"] == 0.0
    assert result.grad_norm == 0.0 and result.loss == 0.0
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_reference_logprobs_equal_the_policy_logprobs_in_bfloat16(kl_trainer):
    trainer = kl_trainer(dtype="bfloat16")
    batch = make_batch()
    assert torch.equal(trainer.compute_reference_logprobs(batch), trainer.compute_logprobs(batch))
    result = trainer.train_step(batch, torch.zeros(batch.num_sequences))
    assert result.metrics["train/ref_kl"] == 0.0 and result.grad_norm == 0.0


def test_the_reference_stays_frozen_while_the_policy_moves(kl_trainer):
    trainer = kl_trainer()
    reference = trainer.reference
    assert reference is not None and not reference.adapters_disabled
    initial = state(trainer.model)
    assert state(reference.model).keys() == initial.keys()
    # A copy of its own: no tensor shared with the policy, frozen, outside the optimizer.
    policy_storage = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    assert not policy_storage & {
        p.untyped_storage().data_ptr() for p in reference.model.parameters()
    }
    assert not any(p.requires_grad for p in reference.model.parameters())
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in reference.model.parameters()}

    batch = make_batch()
    trainer.train_step(batch, ADVANTAGES)
    policy, ref = trainer.compute_logprobs(batch), trainer.compute_reference_logprobs(batch)
    second = trainer.train_step(batch, ADVANTAGES)

    assert not reference.model.training
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, initial[name]), f"the reference's {name} changed"
    assert any(not torch.equal(t, initial[n]) for n, t in trainer.model.state_dict().items())
    # Step 2 starts from the weights step 1 left: its metric is the KL of those to the start.
    expected = mean_k3(policy, ref, batch.loss_mask)
    assert expected > 0
    assert second.metrics["train/ref_kl"] == pytest.approx(expected, rel=1e-4)


def perturbed_kl_after_steps(
    trainer: Trainer, initial: torch.Tensor, num_steps: int
) -> list[float]:
    """Push the policy away from its start, then step with all advantages 0: KL per step."""
    batch = make_batch()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.add_(0.05 * noise.to(p.device))
    kls = [mean_k3(trainer.compute_logprobs(batch), initial, batch.loss_mask)]
    for _ in range(num_steps):
        trainer.train_step(batch, torch.zeros(batch.num_sequences))
        kls.append(mean_k3(trainer.compute_logprobs(batch), initial, batch.loss_mask))
    return kls


def test_the_kl_term_pulls_the_policy_back_to_the_reference(kl_trainer):
    initial = kl_trainer(kl_coef=0.0).compute_logprobs(make_batch())
    pulled = perturbed_kl_after_steps(kl_trainer(kl_coef=1.0, lr=3e-3), initial, num_steps=6)
    free = perturbed_kl_after_steps(kl_trainer(kl_coef=0.0, lr=3e-3), initial, num_steps=6)
    assert pulled[0] == free[0] > 0.01  # the same perturbation
    assert pulled[-1] < 0.5 * pulled[0], pulled
    assert free[-1] == free[0], free  # no advantage, no KL term: no gradient, no move


def test_a_resumed_trainer_keeps_the_starting_weights_as_its_reference(kl_trainer, tmp_path):
    batch = make_batch()
    first = kl_trainer(lr=1e-2)
    start = first.compute_logprobs(batch)
    for _ in range(2):
        first.train_step(batch, ADVANTAGES)
    path = checkpoint.save(tmp_path / "step_2", first, data_position=2)
    expected = first.train_step(batch, ADVANTAGES)
    record = json.loads((path / "trainer_state.json").read_text())["reference"]
    assert record["path"] == str(first.model_path)
    assert record["fingerprint"] == first.reference.record.fingerprint
    assert not record["adapters_disabled"]

    resumed = kl_trainer(lr=1e-2)
    checkpoint.load(path, resumed)
    assert torch.equal(resumed.compute_reference_logprobs(batch), start)
    assert not torch.equal(resumed.compute_logprobs(batch), start)  # the policy did resume
    got = resumed.train_step(batch, ADVANTAGES)
    assert got.metrics["train/ref_kl"] == expected.metrics["train/ref_kl"] > 0
    assert got.loss == expected.loss


def save_perturbed_copy(source, dest, *, scale: float = 0.05):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    return dest


def test_resume_refuses_a_reference_other_than_the_runs(kl_trainer, tiny_model_path, tmp_path):
    first = kl_trainer()
    first.train_step(make_batch(), ADVANTAGES)
    path = checkpoint.save(tmp_path / "step_1", first)
    other = save_perturbed_copy(tiny_model_path, tmp_path / "other")
    with pytest.raises(ConfigError, match=r"KL penalty to the reference .*other weights"):
        checkpoint.load(path, kl_trainer(reference_model=str(other)))
    checkpoint.load(path, kl_trainer(kl_coef=0.0))  # KL turned off: no reference to check


def test_reference_model_names_another_checkpoint(kl_trainer, tiny_model_path, tmp_path, device):
    other = save_perturbed_copy(tiny_model_path, tmp_path / "other")
    trainer = kl_trainer(reference_model=str(other))
    batch = make_batch()
    alone = Trainer(Trainer.Config(model=str(other), micro_batch_tokens=24, device=device))
    assert torch.equal(trainer.compute_reference_logprobs(batch), alone.compute_logprobs(batch))
    result = trainer.train_step(batch, ADVANTAGES)
    expected = mean_k3(
        kl_trainer(kl_coef=0.0).compute_logprobs(batch),
        alone.compute_logprobs(batch),
        batch.loss_mask,
    )
    assert result.metrics["train/ref_kl"] == pytest.approx(expected, rel=1e-4)


def test_a_reference_with_another_vocabulary_is_refused(kl_trainer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    config = LlamaConfig(vocab_size=100, num_attention_heads=2, num_key_value_heads=1, **shape)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match="vocabulary of 100 tokens"):
        kl_trainer(reference_model=str(tmp_path / "small"))


def test_without_a_kl_term_no_reference_is_loaded_and_no_ref_kl_logged(kl_trainer):
    trainer = kl_trainer(kl_coef=0.0)
    assert trainer.reference is None
    batch = make_batch()
    assert "train/ref_kl" not in trainer.train_step(batch, ADVANTAGES).metrics
    with pytest.raises(ConfigError, match="no reference policy"):
        trainer.compute_reference_logprobs(batch)


def test_lora_reference_is_the_base_model_with_its_adapters_disabled(kl_trainer, tiny_model_path):
    pytest.importorskip("peft", reason='peft is not installed (pip install "tir-rl[lora]")')
    lora = LoRAConfig(enabled=True, r=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    trainer = kl_trainer(lora=lora, lr=1e-2)
    reference = trainer.reference
    assert reference is not None and reference.adapters_disabled
    assert reference.model is trainer.model  # no second copy of the weights
    batch = make_batch()
    base = Trainer(Trainer.Config(model=str(tiny_model_path), micro_batch_tokens=24,
                                  device=trainer.config.device))  # fmt: skip
    start = base.compute_logprobs(batch)
    assert torch.equal(trainer.compute_reference_logprobs(batch), start)
    assert torch.equal(trainer.compute_logprobs(batch), start)  # B = 0: the adapters add 0

    for _ in range(3):
        result = trainer.train_step(batch, ADVANTAGES)
    assert trainer.model.training  # the reference pass gave the train mode back
    policy = trainer.compute_logprobs(batch)
    assert torch.equal(trainer.compute_reference_logprobs(batch), start)
    assert torch.equal(trainer.compute_logprobs(batch), policy)  # adapters on again
    assert not torch.equal(policy, start)
    assert result.metrics["train/ref_kl"] > 0


def test_pissa_reference_is_a_frozen_copy_of_the_starting_weights(kl_trainer, tiny_model_path):
    """PiSSA's frozen weights are a residual, so adapters-off is not the start: copy it."""
    pytest.importorskip("peft", reason='peft is not installed (pip install "tir-rl[lora]")')
    lora = LoRAConfig(enabled=True, r=4, alpha=4.0, target_modules=("q_proj", "v_proj"),
                      init="pissa")  # fmt: skip
    trainer = kl_trainer(lora=lora, lr=1e-2)
    reference = trainer.reference
    assert reference is not None and not reference.adapters_disabled
    assert reference.model is not trainer.model
    batch = make_batch()
    base = Trainer(Trainer.Config(model=str(tiny_model_path), micro_batch_tokens=24,
                                  device=trainer.config.device))  # fmt: skip
    start = base.compute_logprobs(batch)
    assert torch.equal(trainer.compute_reference_logprobs(batch), start)
    with trainer.model.disable_adapter():  # the residual alone is another policy
        residual = trainer.compute_logprobs(batch)
    assert (residual - start).abs().max() > 1e-3
    for _ in range(2):
        trainer.train_step(batch, ADVANTAGES)
    assert torch.equal(trainer.compute_reference_logprobs(batch), start)
