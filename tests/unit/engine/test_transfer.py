"""The trainer side of vLLM's weight transfer, on fake engines: ranks, rounds, pool failover.

The engines' control planes are fakes (`FakeTransferClient`) and, in the pool tests, the
send itself is replaced, so these tests check the logic around vLLM's transfer engines.
The real transfer (vLLM's protocol over gloo, through real servers and a local engine) is
tested in tests/integration/engine/test_vllm_http.py, test_vllm_local.py and
tests/integration/train/test_train_pool.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from test_pool import INFO, FakeMember

from tir_rl.engine.pool import EnginePool
from tir_rl.engine.weights.transfer import (
    FanOutClient,
    TransferError,
    TransferGroup,
    TransferRound,
    WeightTransfer,
    check_transfer_available,
)
from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError


class FakeTransferClient:
    """A fake engine control plane: records its calls; the init waits for its peers."""

    def __init__(self, name: str, workers: int = 1, peers: threading.Barrier | None = None):
        self.name = name
        self.workers = workers
        self.peers = peers
        self.calls: list[tuple[str, object]] = []
        self.gone = False

    def world_size(self) -> int:
        if self.gone:
            raise EngineUnavailableError(f"{self.name} is gone")
        return self.workers

    def init_weight_transfer_engine(self, init_info):
        if self.peers is not None:
            self.peers.wait()  # every engine joins the rendezvous at once, or none does
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        if self.gone:
            raise EngineUnavailableError(f"{self.name} is gone")
        self.calls.append(("start", None))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    def shutdown_weight_transfer_engine(self):
        self.calls.append(("shutdown", None))


def test_fan_out_gives_each_engine_the_ranks_after_the_previous_ones_concurrently():
    peers = threading.Barrier(3, timeout=5)  # a sequential fan-out would time out here
    clients = [FakeTransferClient(f"s{i}", w, peers) for i, w in enumerate((1, 2, 1))]
    fan_out = FanOutClient(clients)
    assert fan_out.world_size == 5
    fan_out.init_weight_transfer_engine({"master_port": 1, "rank_offset": 1, "world_size": 5})
    offsets = [c.calls[0][1]["rank_offset"] for c in clients]
    assert offsets == [1, 2, 4]
    assert all(c.calls[0][1]["world_size"] == 5 for c in clients)


def test_fan_out_names_the_engine_that_failed():
    clients = [FakeTransferClient("s0"), FakeTransferClient("s1")]
    fan_out = FanOutClient(clients)
    clients[1].gone = True
    with pytest.raises(TransferError, match="s1") as caught:
        fan_out.start_weight_update()
    assert caught.value.engine == "s1"
    assert isinstance(caught.value.cause, EngineUnavailableError)
    with pytest.raises(EngineUnavailableError):
        FanOutClient([])


def test_a_round_sends_only_once_every_engine_holds():
    round_ = TransferRound(2, timeout_s=5)
    order: list[str] = []

    def engine(name: str) -> None:
        order.append(f"{name} holds")
        round_.hold()
        order.append(f"{name} released")

    engines = [threading.Thread(target=engine, args=(n,)) for n in ("a", "b")]
    engines[0].start()
    sender = threading.Thread(target=round_.send, args=(lambda: order.append("sent"),))
    sender.start()
    engines[1].start()
    for t in [*engines, sender]:
        t.join(timeout=10)
    assert order.index("sent") > max(order.index("a holds"), order.index("b holds"))
    assert order.index("sent") < min(order.index("a released"), order.index("b released"))


def test_a_failed_send_fails_every_engine_of_the_round():
    round_ = TransferRound(1, timeout_s=5)
    failure: list[BaseException] = []

    def engine() -> None:
        try:
            round_.hold()
        except EngineError as exc:
            failure.append(exc)

    thread = threading.Thread(target=engine)
    thread.start()

    def broken() -> None:
        raise RuntimeError("broadcast failed")

    with pytest.raises(RuntimeError):
        round_.send(broken)
    thread.join(timeout=10)
    assert failure and "broadcast failed" in str(failure[0])


def test_an_engine_that_never_holds_aborts_the_round():
    round_ = TransferRound(1, timeout_s=0.2)
    with pytest.raises(threading.BrokenBarrierError):
        round_.send(lambda: None)


class FakeTransferMember(FakeMember):
    """A pool member that receives transfers: holds, then records the version."""

    def __init__(self, index: int) -> None:
        super().__init__(index, INFO)
        self.client = FakeTransferClient(f"m{index}")
        self.received: list[int | None] = []

    def transfer_client(self) -> FakeTransferClient:
        return self.client

    async def receive_transfer(self, round_: TransferRound, version: int | None) -> None:
        await asyncio.to_thread(round_.hold)
        self.received.append(version)
        self.version = version if version is not None else self.version


@pytest.fixture
def sends(monkeypatch):
    """Replace the real send (vLLM's trainer engine) by a record of who it was sent to."""
    record: list[list[str]] = []

    def fake_send(self, clients, state):
        gone = [c.name for c in clients if c.gone]
        if gone:
            raise TransferError(gone[0], EngineUnavailableError(f"{gone[0]} is gone"))
        record.append([c.name for c in clients])

    monkeypatch.setattr(TransferGroup, "send", fake_send)
    return record


def test_a_pool_sends_once_to_all_and_again_to_those_left_when_one_is_unreachable(sends):
    members = [FakeTransferMember(i) for i in range(3)]
    pool = EnginePool(
        [(m.client.name, m) for m in members], weights_dir=None, transfer=WeightTransfer.GLOO
    )
    state = {"w": torch.zeros(2)}
    asyncio.run(pool.update_weights(state, version=1))
    assert sends == [["m0", "m1", "m2"]]
    assert [m.received for m in members] == [[1], [1], [1]]

    members[1].client.gone = True
    asyncio.run(pool.update_weights(state, version=2))
    assert sends[-1] == ["m0", "m2"]
    assert pool.stats().members_up == 2 and pool.policy_version == 2
    assert members[0].version == members[2].version == 2


def test_a_pool_raises_when_a_member_that_is_up_fails_to_receive(sends, monkeypatch):
    members = [FakeTransferMember(i) for i in range(2)]
    pool = EnginePool(
        [(m.client.name, m) for m in members], weights_dir=None, transfer=WeightTransfer.GLOO
    )

    async def broken(round_, version):
        await asyncio.to_thread(round_.hold)
        raise EngineError("load_weights: shape mismatch")

    monkeypatch.setattr(members[0], "receive_transfer", broken)
    with pytest.raises(EngineError, match="m0 failed to receive the weights"):
        asyncio.run(pool.update_weights({"w": torch.zeros(1)}, version=1))
    assert pool.stats().members_up == 2  # a load failure is not a lost server


def test_a_pool_refuses_a_join_it_cannot_bring_up_to_date_and_a_file_pool_needs_a_folder():
    pool = EnginePool([("m0", FakeTransferMember(0))], weights_dir=None, transfer="gloo")
    with pytest.raises(ConfigError, match="cannot join"):
        asyncio.run(pool.join("m1", FakeTransferMember(1)))
    with pytest.raises(ConfigError, match="needs a weights_dir"):
        EnginePool([("m0", FakeMember(0))], weights_dir=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
@pytest.mark.parametrize("transfer", [WeightTransfer.NCCL, WeightTransfer.IPC])
def test_cuda_transfers_are_refused_without_cuda(transfer):
    with pytest.raises(ConfigError, match="needs CUDA"):
        check_transfer_available(transfer)
    check_transfer_available(WeightTransfer.GLOO)


def test_a_start_that_fails_on_one_engine_is_closed_on_the_others():
    # An engine with an update left open refuses the next start (vLLM's worker), so the
    # resend to the engines left after a loss would fail.
    clients = [FakeTransferClient("s0"), FakeTransferClient("s1")]
    fan_out = FanOutClient(clients)
    clients[1].gone = True
    with pytest.raises(TransferError, match="s1"):
        fan_out.start_weight_update()
    assert clients[0].calls == [("start", None), ("finish", None)]
