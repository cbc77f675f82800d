"""The engine pool's routing, failover and weight publication, on fake member engines.

The members are fakes (`FakeMember`): they answer with their own index so the tests see
where a request went. Real `vllm serve` servers behind a pool are
`tests/integration/train/test_train_pool.py`.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tir_rl.engine.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    SingleEngine,
)
from tir_rl.engine.pool import EnginePool, HangCheck, Routing
from tir_rl.engine.weights.files import (
    READY_MARKER,
    PublishedWeights,
    check_published,
    publish_state_dict,
    weights_digest,
)
from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError

INFO = ModelInfo(
    model_path="/m", dtype="float32", max_model_len=64, logprobs_mode="processed_logprobs"
)


class FakeMember(SingleEngine):
    """A fake engine: answers with its index; can be down, reject, or hold requests."""

    def __init__(self, index: int, info: ModelInfo = INFO) -> None:
        self.index = index
        self.info = info
        self.down = False
        self.reject = False
        self.hold: asyncio.Event | None = None
        self.hung = False
        """Holds every call and fails its liveness check (a stopped process)."""
        self.health_checks = 0
        self.loaded: list[PublishedWeights] = []
        self.version = 0
        self.closed = False

    @property
    def model_info(self) -> ModelInfo:
        return self.info

    @property
    def policy_version(self) -> int:
        return self.version

    async def responsive(self, timeout_s: float) -> bool:
        self.health_checks += 1
        return not self.hung

    async def _hang_if_hung(self) -> None:
        while self.hung:
            await asyncio.sleep(0.01)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self._hang_if_hung()
        if self.hold is not None:
            await self.hold.wait()
        if self.down:
            raise EngineUnavailableError(f"member {self.index} is gone")
        if self.reject:
            raise EngineError(f"member {self.index} rejects this request")
        return GenerateResult(
            token_ids=[self.index],
            logprobs=[-1.0],
            policy_versions=[self.version],
            finish_reason=FinishReason.STOP,
        )

    async def prompt_logprobs(self, token_ids):
        if self.down:
            raise EngineUnavailableError(f"member {self.index} is gone")
        return [float(self.index)] * (len(token_ids) - 1)

    async def update_weights(self, state_dict, *, version=None):
        raise AssertionError("a pool member loads published weights, never a state dict")

    async def load_published(self, weights: PublishedWeights) -> None:
        await self._hang_if_hung()
        if self.down:
            raise EngineUnavailableError(f"member {self.index} is gone")
        if self.reject:
            raise EngineError("shape mismatch")
        check_published(weights)
        self.loaded.append(weights)
        if weights.version is not None:
            self.version = weights.version

    def close(self) -> None:
        self.closed = True


def request(key: str | None) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2], max_tokens=1, affinity=key)


def answer(pool: EnginePool, key: str | None) -> int:
    return asyncio.run(pool.generate(request(key))).token_ids[0]


def make_pool(tmp_path, n: int = 2) -> tuple[EnginePool, list[FakeMember]]:
    members = [FakeMember(i) for i in range(n)]
    return EnginePool([(f"s{i}", m) for i, m in enumerate(members)], weights_dir=tmp_path), members


def test_an_episode_stays_on_its_member_and_new_episodes_spread(tmp_path):
    pool, _ = make_pool(tmp_path, 3)
    first = {key: answer(pool, key) for key in ("a", "b", "c", "d", "e", "f")}
    assert sorted(first.values()) == [0, 0, 1, 1, 2, 2]  # nothing in flight: fewest keys
    for _ in range(3):
        assert {key: answer(pool, key) for key in first} == first
    assert pool.stats().requests == (8, 8, 8)


def test_a_new_episode_goes_to_the_member_with_fewest_requests_in_flight(tmp_path):
    pool, members = make_pool(tmp_path)

    async def scenario() -> list[int]:
        members[0].hold = asyncio.Event()
        busy = [asyncio.create_task(pool.generate(request(f"busy{i}"))) for i in range(2)]
        await busy[1]  # busy0 went to s0 and busy1 to s1; s1 answers, s0 is still busy
        placed = [(await pool.generate(request(f"new{i}"))).token_ids[0] for i in range(3)]
        members[0].hold.set()
        await asyncio.gather(*busy)
        return placed

    assert asyncio.run(scenario()) == [1, 1, 1]


def test_a_member_that_goes_away_is_left_and_its_episodes_move_on(tmp_path):
    pool, members = make_pool(tmp_path)
    assert answer(pool, "a") == 0
    assert answer(pool, "b") == 1
    members[0].down = True
    assert answer(pool, "a") == 1  # sent again to the member left
    assert answer(pool, "a") == 1
    stats = pool.stats()
    assert (stats.members, stats.members_up, stats.failovers) == (2, 1, 1)
    members[0].down = False
    assert answer(pool, "c") == 1, "a member marked down gets no more requests"


def test_an_error_of_the_request_is_raised_and_the_member_stays(tmp_path):
    pool, members = make_pool(tmp_path)
    assert answer(pool, "a") == 0
    members[0].reject = True
    with pytest.raises(EngineError, match="rejects this request"):
        answer(pool, "a")
    assert pool.stats().members_up == 2
    assert pool.stats().failovers == 0


def test_when_every_member_is_gone_the_request_says_so(tmp_path):
    pool, members = make_pool(tmp_path)
    for m in members:
        m.down = True
    with pytest.raises(EngineUnavailableError, match="every engine of the pool is down"):
        answer(pool, "a")
    with pytest.raises(EngineUnavailableError):
        asyncio.run(pool.prompt_logprobs([1, 2, 3]))


def test_an_update_is_written_once_and_every_member_up_loads_it(tmp_path):
    pool, members = make_pool(tmp_path / "w", 3)
    members[2].down = True
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    asyncio.run(pool.update_weights(state, version=4))
    published = [p for p in (tmp_path / "w").iterdir()]
    assert len(published) == 1 and (published[0] / READY_MARKER).is_file()
    assert [m.loaded[0].folder for m in members[:2]] == [published[0]] * 2
    assert pool.policy_version == 4 and [m.version for m in members] == [4, 4, 0]
    assert pool.stats().members_up == 2  # the unreachable one left during the load
    asyncio.run(pool.update_weights(state, version=5))
    assert len(list((tmp_path / "w").iterdir())) == 1, "the older version is removed"


def test_a_member_that_fails_to_load_stops_the_update(tmp_path):
    pool, members = make_pool(tmp_path)
    members[1].reject = True
    with pytest.raises(EngineError, match="s1 failed to load"):
        asyncio.run(pool.update_weights({"w": torch.ones(2)}, version=1))


def test_a_member_that_joins_gets_the_pool_s_weights_first(tmp_path):
    pool, _ = make_pool(tmp_path)
    assert [answer(pool, "a"), answer(pool, "b")] == [0, 1]
    asyncio.run(pool.update_weights({"w": torch.ones(2)}, version=3))
    late = FakeMember(7)
    asyncio.run(pool.join("late", late))
    assert late.version == 3 and len(late.loaded) == 1
    assert pool.stats().members == 3
    assert answer(pool, "new") == 7  # the others hold an episode each
    other = FakeMember(
        8,
        ModelInfo(
            model_path="/other",
            dtype="float32",
            max_model_len=64,
            logprobs_mode="processed_logprobs",
        ),
    )
    with pytest.raises(ConfigError, match="must serve the same model"):
        asyncio.run(pool.join("other", other))
    with pytest.raises(ConfigError, match="already in the pool"):
        asyncio.run(pool.join("late", FakeMember(9)))


def test_members_of_other_models_are_refused(tmp_path):
    other = ModelInfo(
        model_path="/m", dtype="bfloat16", max_model_len=64, logprobs_mode="processed_logprobs"
    )
    with pytest.raises(ConfigError, match="dtype"):
        EnginePool([("a", FakeMember(0)), ("b", FakeMember(1, other))], weights_dir=tmp_path)
    with pytest.raises(ConfigError, match="at least one"):
        EnginePool([], weights_dir=tmp_path)


def test_a_published_folder_is_complete_or_refused(tmp_path):
    state = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    weights = publish_state_dict(state, tmp_path, version=2)
    marker = json.loads((weights.folder / READY_MARKER).read_text())
    assert marker["version"] == 2 and marker["bytes"] == weights.num_bytes
    assert marker["sha256"] == weights.sha256 == weights_digest(weights.folder)
    check_published(weights)
    half = tmp_path / ".publishing-x"
    half.mkdir()
    with pytest.raises(EngineError, match="not a complete published version"):
        check_published(PublishedWeights(folder=half, version=3, num_bytes=0, sha256=""))
    (weights.folder / "model.safetensors").write_bytes(b"cut short")
    with pytest.raises(EngineError, match="its marker says"):
        check_published(weights)


def test_the_controls_ignore_episodes(tmp_path):
    members = [FakeMember(i) for i in range(2)]
    named = [(f"s{i}", m) for i, m in enumerate(members)]
    least = EnginePool(named, weights_dir=tmp_path, routing=Routing.LEAST_LOADED)
    assert [answer(least, "a") for _ in range(4)] == [0, 0, 0, 0]  # nothing in flight: first
    drawn = EnginePool(named, weights_dir=tmp_path, routing=Routing.RANDOM, seed=1)
    assert {answer(drawn, "a") for _ in range(20)} == {0, 1}


QUICK_CHECK = HangCheck(after_s=0.05, answer_within_s=0.05)


def test_a_hung_member_is_left_and_its_request_goes_to_another(tmp_path):
    members = [FakeMember(0), FakeMember(1)]
    pool = EnginePool(
        [(f"s{i}", m) for i, m in enumerate(members)], weights_dir=tmp_path, hang_check=QUICK_CHECK
    )
    assert answer(pool, "ep") == 0
    members[0].hung = True
    assert answer(pool, "ep") == 1  # the episode moved on instead of waiting for good
    stats = pool.stats()
    assert (stats.members_up, stats.failovers) == (1, 1)
    asyncio.run(pool.update_weights({"w": torch.zeros(2)}, version=1))
    assert [len(m.loaded) for m in members] == [0, 1]  # the hung member is no longer asked


def test_a_hung_member_is_left_during_an_update_and_the_others_load_it(tmp_path):
    members = [FakeMember(0), FakeMember(1)]
    pool = EnginePool(
        [(f"s{i}", m) for i, m in enumerate(members)], weights_dir=tmp_path, hang_check=QUICK_CHECK
    )
    members[1].hung = True
    asyncio.run(pool.update_weights({"w": torch.zeros(2)}, version=3))
    assert pool.policy_version == 3 and pool.stats().members_up == 1
    assert len(members[0].loaded) == 1 and members[1].loaded == []


def test_a_slow_member_that_answers_its_check_keeps_the_request(tmp_path):
    members = [FakeMember(0), FakeMember(1)]
    pool = EnginePool(
        [(f"s{i}", m) for i, m in enumerate(members)], weights_dir=tmp_path, hang_check=QUICK_CHECK
    )

    async def slow_answer() -> int:
        members[0].hold = asyncio.Event()
        pending = asyncio.create_task(pool.generate(request("ep")))
        await asyncio.sleep(0.3)  # several checks, each answered
        members[0].hold.set()
        return (await pending).token_ids[0]

    assert asyncio.run(slow_answer()) == 0
    assert members[0].health_checks >= 3
    assert pool.stats().members_up == 2 and pool.stats().failovers == 0


def test_without_the_check_a_hung_member_holds_its_request(tmp_path):
    members = [FakeMember(0), FakeMember(1)]
    pool = EnginePool(
        [(f"s{i}", m) for i, m in enumerate(members)],
        weights_dir=tmp_path,
        hang_check=HangCheck(after_s=0),
    )
    members[0].hung = True

    async def waits() -> bool:
        call = asyncio.create_task(pool.generate(request(None)))
        done, _ = await asyncio.wait({call}, timeout=0.3)
        call.cancel()
        return bool(done)

    assert not asyncio.run(waits())
    assert members[0].health_checks == 0
    with pytest.raises(ConfigError, match="hang_check_s must be >= 0"):
        EnginePool([("s0", FakeMember(0))], weights_dir=tmp_path, hang_check=HangCheck(-1))
