"""WeightSync: what the engine gets after each update, the parity probe, the clean lend."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tir_rl.engine.base import ModelInfo, SingleEngine
from tir_rl.engine.parity import transformers_logprobs
from tir_rl.engine.weights.sync import WeightSync
from tir_rl.errors import ParityError
from tir_rl.mismatch.injection import FINAL_NORM_KEY, MismatchInjection

PROBE = [1, 4, 2, 7, 3]


class FakeLM(nn.Module):
    """A causal LM shaped like a transformers one: `model(ids).logits`, `model.device`."""

    def __init__(self, vocab: int = 8, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, vocab, bias=False)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.embed(ids) * self.norm))


class FakeTrainer:
    def __init__(self) -> None:
        self.model = FakeLM()

    def sequence_logprobs(self, ids: list[int], *, temperature: float = 1.0) -> torch.Tensor:
        return transformers_logprobs(self.model, ids, temperature=temperature)

    def rank0_full_state_dict(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        state[FINAL_NORM_KEY] = state.pop("norm")
        return state


class RecordingEngine(SingleEngine):
    """Keeps every state it is sent; scores the probe with `logprobs` (or the trainer's)."""

    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs
        self.received: list[dict[str, torch.Tensor]] = []
        self.versions: list[int | None] = []

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path="fake", dtype="float32", max_model_len=64,
            logprobs_mode="processed_logprobs",
        )  # fmt: skip

    async def update_weights(
        self, state: dict[str, torch.Tensor], *, version: int | None = None
    ) -> None:
        self.received.append(state)
        self.versions.append(version)

    async def prompt_logprobs(self, ids: list[int]) -> list[float]:
        return list(self.logprobs)


def sync_with(config: MismatchInjection.Config | None = None, **kwargs) -> WeightSync:
    return WeightSync(MismatchInjection(config), probe_ids=PROBE, parity_tolerance=1e-3, **kwargs)


def trainer_probe(trainer: FakeTrainer) -> list[float]:
    return transformers_logprobs(trainer.model, PROBE).tolist()


def test_the_engine_gets_the_trainers_weights_and_parity_holds():
    trainer, sync = FakeTrainer(), sync_with()
    engine = RecordingEngine(trainer_probe(trainer))
    assert sync.due(1) and sync.due(2)
    prepared = sync.prepare(trainer, num_updates=1)
    report = asyncio.run(sync.rank0_send(engine, prepared, 1))
    assert report.passed and report.num_tokens == len(PROBE) - 1
    (sent,) = engine.received
    expected = trainer.rank0_full_state_dict()
    assert sent.keys() == expected.keys()
    assert all(torch.equal(sent[k], expected[k]) for k in sent)
    assert engine.versions == [1]  # the engine labels its later tokens with the new version


def test_a_gap_beyond_the_tolerance_raises_parity_error():
    trainer, sync = FakeTrainer(), sync_with()
    engine = RecordingEngine([x + 0.1 for x in trainer_probe(trainer)])
    with pytest.raises(ParityError, match="disagree on the parity probe"):
        asyncio.run(sync.rank0_send(engine, sync.prepare(trainer, num_updates=1), 1))


def test_an_injection_sends_the_sampler_weights_and_only_logs_the_gap():
    trainer = FakeTrainer()
    sync = sync_with(MismatchInjection.Config(logit_noise_std=0.5))
    assert sync.tolerance == math.inf
    engine = RecordingEngine([x + 0.1 for x in trainer_probe(trainer)])
    report = asyncio.run(sync.rank0_send(engine, sync.prepare(trainer, num_updates=1), 1))
    assert report.passed and report.max_abs_diff == pytest.approx(0.1)
    sent = engine.received[0][FINAL_NORM_KEY]
    assert not torch.equal(sent, trainer.rank0_full_state_dict()[FINAL_NORM_KEY])


def test_stale_syncs_are_skipped_unless_forced():
    sync = sync_with(MismatchInjection.Config(sync_every=3))
    assert [sync.due(k) for k in range(7)] == [True, False, False, True, False, False, True]
    assert sync.due(1, force=True)


def test_a_clean_lend_hands_back_the_stale_copy():
    trainer = FakeTrainer()
    sync = sync_with(MismatchInjection.Config(sync_every=2), keep_stale_copy=True)
    engine = RecordingEngine(trainer_probe(trainer))
    asyncio.run(sync.rank0_send(engine, sync.prepare(trainer, num_updates=2), 2))
    stale = engine.received[0]
    with torch.no_grad():
        trainer.model.norm.mul_(2)  # the trainer moves on; the sampler keeps its weights
    full = trainer.rank0_full_state_dict()
    with sync.rank0_exact_weights(engine, full, num_updates=3):
        assert engine.received[-1] is full
    restored = engine.received[-1]
    assert all(torch.equal(restored[k], stale[k]) for k in stale)
    assert not torch.equal(restored[FINAL_NORM_KEY], full[FINAL_NORM_KEY])


def test_a_clean_lend_without_a_stale_copy_recomputes_the_injected_weights():
    trainer = FakeTrainer()
    injection = MismatchInjection.Config(logit_noise_std=0.5)
    sync = sync_with(injection)
    engine = RecordingEngine([])
    full = trainer.rank0_full_state_dict()
    with sync.rank0_exact_weights(engine, full, num_updates=1):
        pass
    lent, restored = engine.received
    assert lent is full
    expected = MismatchInjection(injection).sampler_state(full, 1, force=True)
    assert torch.equal(restored[FINAL_NORM_KEY], expected[FINAL_NORM_KEY])


class PoolServer(RecordingEngine):
    """A pool member (loads published weights); `lags` keeps it on its old version label."""

    def __init__(self, logprobs: list[float], *, lags: bool = False) -> None:
        super().__init__(logprobs)
        self.lags = lags
        self.version = 0

    @property
    def policy_version(self) -> int:
        return self.version

    async def responsive(self, timeout_s: float) -> bool:
        return True

    async def load_published(self, weights) -> None:
        if not self.lags and weights.version is not None:
            self.version = weights.version

    async def generate(self, request):
        raise AssertionError("a weight sync samples nothing")

    def close(self) -> None:
        pass


def test_every_server_of_a_pool_must_hold_the_synced_version(tmp_path):
    from tir_rl.engine.pool import EnginePool
    from tir_rl.errors import EngineError

    trainer, sync = FakeTrainer(), sync_with()
    good = PoolServer(trainer_probe(trainer))
    pool = EnginePool([("s0", good), ("s1", PoolServer(good.logprobs))], weights_dir=tmp_path / "a")
    report = asyncio.run(sync.rank0_send(pool, sync.prepare(trainer, num_updates=1), 1))
    assert report.passed

    lagging = PoolServer(trainer_probe(trainer), lags=True)
    pool = EnginePool([("s0", good), ("s1", lagging)], weights_dir=tmp_path / "b")
    with pytest.raises(EngineError, match="s1 labels its tokens with policy version 0"):
        asyncio.run(sync.rank0_send(pool, sync.prepare(trainer, num_updates=2), 2))
