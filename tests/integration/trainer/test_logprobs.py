"""Trainer logprobs: alignment with an independent reference, and packing equivalence."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_batch

from tir_rl.mismatch import mismatch_metrics
from tir_rl.trainer.batch import Packing
from tir_rl.trainer.packing import plan_micro_batches


def reference_logprobs(model, batch, temperature: float, *, shift: int = 1) -> torch.Tensor:
    """Plain transformers forward, one sequence at a time: logits[t - shift] predict token t."""
    out = torch.zeros(batch.completion_ids.shape)
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.completion_lens[i])
            ids = torch.cat([prompt, batch.completion_ids[i, :n]])
            logits = model(input_ids=ids[None]).logits[0].float() / temperature
            logprobs = torch.log_softmax(logits, dim=-1)
            p = len(prompt)
            for j in range(n):
                out[i, j] = logprobs[p + j - shift, ids[p + j]]
    return out


@pytest.fixture
def reference_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_an_independent_reference_over_the_full_multi_turn_context(
    make_trainer, reference_model, temperature
):
    batch = make_batch()
    trainer = make_trainer(temperature=temperature, micro_batch_tokens=40)
    got = trainer.compute_logprobs(batch)
    want = reference_logprobs(reference_model, batch, temperature)
    valid = torch.arange(got.shape[1])[None] < batch.completion_lens[:, None]
    assert torch.allclose(got[valid], want[valid], atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all()

    # Used as the sampler, the reference gives a mismatch of (numerically) zero.
    metrics = mismatch_metrics(got, want, batch.loss_mask, batch.turn_ids)
    assert abs(metrics["mismatch/kl"]) < 1e-6
    assert metrics["mismatch/abs_diff_max"] < 1e-5


def test_an_off_by_one_sampler_shows_up_as_mismatch(make_trainer, reference_model):
    batch = make_batch()
    trainer = make_trainer(micro_batch_tokens=40)
    got = trainer.compute_logprobs(batch)
    shifted = reference_logprobs(reference_model, batch, 1.0, shift=2)
    valid = batch.loss_mask
    assert not torch.allclose(got[valid], shifted[valid], atol=1e-5, rtol=0)
    metrics = mismatch_metrics(got, shifted, batch.loss_mask, batch.turn_ids)
    assert metrics["mismatch/abs_diff_mean"] > 1e-3
    assert metrics["mismatch/k3_kl"] > 1e-4


@pytest.mark.parametrize("budget", [16, 40, 4096])
def test_packed_bucketed_and_padded_logprobs_agree(make_trainer, budget):
    batch = make_batch(seed=3, shapes=((6, [5, 4]), (3, [9]), (10, [2, 3, 2]), (4, [7]), (2, [1])))
    results = {
        packing: make_trainer(packing=packing, micro_batch_tokens=budget).compute_logprobs(batch)
        for packing in Packing
    }
    packed = results[Packing.PACKED]
    for packing, logprobs in results.items():
        assert torch.allclose(packed, logprobs, atol=1e-5, rtol=0), packing


def test_packed_rows_hold_several_sequences_without_cross_attention(make_trainer):
    """Sequences sharing a row give the logprobs they get alone."""
    batch = make_batch(seed=5, shapes=((8, [20, 6]), (4, [6]), (5, [3, 4])))
    plans = plan_micro_batches(batch, 4096, Packing.PACKED)
    assert any(int((row == 0).sum()) >= 2 for mb in plans for row in mb.position_ids)
    trainer = make_trainer(packing=Packing.PACKED, micro_batch_tokens=4096)
    together = trainer.compute_logprobs(batch)
    alone = torch.zeros_like(together)
    for i in range(batch.num_sequences):
        single = batch.select([i])
        alone[i, : single.completion_ids.shape[1]] = trainer.compute_logprobs(single)[0]
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("packing", list(Packing))
def test_update_logprobs_of_model_tokens_alone_equal_the_full_path_in_values_and_gradients(
    make_trainer, packing
):
    """lm_head on the loss-mask-1 positions only: same logprobs, entropies and gradients."""
    batch = make_batch(seed=3, shapes=((6, [5, 4]), (3, [9]), (10, [2, 3, 2]), (4, [7]), (2, [1])))
    trainer = make_trainer(packing=packing, micro_batch_tokens=40)
    lm_head = trainer.model.get_output_embeddings()
    columns: list[int] = []
    hook = lm_head.register_forward_hook(lambda m, args, out: columns.append(args[0].shape[1]))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    num_full, num_model = 0, 0
    for mb in plan_micro_batches(batch, 40, packing):
        keep = mb.token_mask(batch.loss_mask)
        weights = torch.randn(int(keep.sum()), generator=generator).to(trainer.device)

        full = trainer.forward.token_stats(trainer.model, mb, entropy=True)
        full_logprobs, full_entropy = full.logprobs, full.entropy
        (full_logprobs[keep.to(trainer.device)] * weights).sum().backward()
        want_grads = [p.grad.clone() for p in params]
        trainer.model.zero_grad(set_to_none=True)
        num_full += columns[-1]

        kept = mb.select_tokens(keep)
        stats = trainer.forward.token_stats(trainer.model, kept, entropy=True)
        logprobs, entropy = stats.logprobs, stats.entropy
        (logprobs * weights).sum().backward()
        num_model += columns[-1]

        torch.testing.assert_close(logprobs, full_logprobs[keep.to(trainer.device)].detach())
        assert full_entropy is not None and entropy is not None
        torch.testing.assert_close(entropy, full_entropy[keep.to(trainer.device)])
        for p, want in zip(params, want_grads, strict=True):
            # fp32 rounding: lm_head's backward sums over a different number of rows.
            assert p.grad is not None
            assert (p.grad - want).norm() <= 1e-5 * want.norm() + 1e-9, float(
                (p.grad - want).norm() / want.norm()
            )
        trainer.model.zero_grad(set_to_none=True)
    hook.remove()
    assert num_model < num_full  # the tool tokens' columns really left lm_head


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_parity_probe_scores_with_the_training_forward(make_trainer, reference_model, dtype):
    """The probe after a sync is the forward training computes: under bf16 autocast too."""
    from tir_rl.engine.weights.sync import WeightSync
    from tir_rl.mismatch.injection import MismatchInjection
    from tir_rl.trainer.batch import TrainBatch

    probe = [1, 504, 2462, 314, 253, 1789, 30, 198, 77, 1200, 9]
    trainer = make_trainer(dtype=dtype)
    sync = WeightSync(MismatchInjection(), probe_ids=probe, parity_tolerance=1e-3)
    prepared = sync.prepare(trainer, num_updates=1)
    training = trainer.compute_logprobs(TrainBatch.of_sequence(probe))[0]
    assert torch.equal(torch.tensor(prepared.trainer_logprobs), training)
    fp32 = reference_logprobs(reference_model, TrainBatch.of_sequence(probe), 1.0)[0]
    gap = (training - fp32).abs().max().item()
    assert (gap > 1e-3) if dtype == "bfloat16" else (gap < 1e-5)  # bf16: another forward
