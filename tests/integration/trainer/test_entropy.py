"""train/entropy: mean token entropy over mask-1 tokens, temperature-scaled, no extra forward."""

from __future__ import annotations

import torch
from trainer_helpers import make_batch


def reference_entropy(model, batch, temperature: float) -> float:
    """Mean entropy of softmax(logits / T) at the positions predicting mask-1 tokens."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(batch.num_sequences):
            prompt = batch.prompt_ids[i]
            n = int(batch.completion_lens[i])
            ids = torch.cat([prompt, batch.completion_ids[i, :n]])[None].to(model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [n, V]
            entropy = torch.distributions.Categorical(logits=logits).entropy().cpu()
            total += float(entropy[batch.loss_mask[i, :n]].sum())
            count += int(batch.loss_mask[i, :n].sum())
    return total / count


def test_train_step_reports_the_mean_entropy_of_model_tokens(make_trainer):
    trainer = make_trainer(temperature=0.7, micro_batch_tokens=24, lr=0.0)
    batch = make_batch()
    expected = reference_entropy(trainer.model, batch, 0.7)
    result = trainer.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert abs(result.metrics["train/entropy"] - expected) < 1e-4
    assert 0 < expected < torch.log(torch.tensor(49152.0)).item()
