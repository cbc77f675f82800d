"""How the trainer's weights reach the engines: a published folder, or vLLM's transfer engines.

`engine.weight_transfer` picks one of:

- `file` (the default): the state dict is published once as a folder every engine reads
  (`tir_rl.engine.weights.files`: written under a temporary name, closed by a ready marker,
  renamed), and each engine reloads it (`collective_rpc("reload_weights")`). Needs a folder
  both sides see: local disk or /dev/shm on one machine, a shared file system across several.
- `nccl`: vLLM's NCCL engine (`vllm.distributed.weight_transfer`). Trainer rank 0 joins one
  NCCL group with every worker of every engine and broadcasts the tensors; no file system
  is involved. Needs CUDA on both sides.
- `ipc`: vLLM's CUDA-IPC engine, for an engine on the trainer's own GPU: the engine maps
  the trainer's tensors instead of copying them over a wire. Needs CUDA.
- `gloo`: the NCCL protocol with torch's gloo as the data plane
  (`tir_rl.engine.in_vllm.gloo_receiver`, a vLLM plugin), so that path runs on CPUs; it is how the
  transfer is tested here.

The three transfers share the trainer side: a `TransferGroup` is vLLM's trainer engine for
the backend over a `FanOutClient`, which drives every engine's control plane (vLLM's
`VLLMWeightSyncClient`: init, start, update, finish) as one and gives each engine's workers
their own ranks in the group. The group is formed on the first send and formed again when
the engines change (one left the pool). Each send is one `TransferRound`: every engine first
holds its requests as for any weight update (the HTTP engine lets the requests in flight
return; the local engine pauses between two steps), then one send reaches them all.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError

if TYPE_CHECKING:
    import torch
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
    )

logger = logging.getLogger(__name__)

ROUND_TIMEOUT_S = 600.0
"""Longest wait for every engine to hold its requests before a send (the requests in flight
of an HTTP engine must return first)."""


class WeightTransfer(enum.StrEnum):
    """How the trainer's weights reach the engines (`engine.weight_transfer`)."""

    FILE = "file"
    """A published folder every engine reloads (`engine.weights_dir` for servers)."""
    NCCL = "nccl"
    """vLLM's NCCL broadcast from trainer rank 0 to every engine worker (CUDA)."""
    IPC = "ipc"
    """vLLM's CUDA IPC, for an engine on the trainer's own GPU (CUDA)."""
    GLOO = "gloo"
    """The NCCL protocol over torch's gloo, on CPUs (tir-rl's vLLM plugin)."""

    @property
    def by_vllm_engine(self) -> bool:
        """Whether a vLLM weight-transfer engine carries the weights (all but `file`)."""
        return self is not WeightTransfer.FILE

    def server_flag(self) -> list[str]:
        """The `vllm serve` arguments an engine needs to receive this transfer."""
        if not self.by_vllm_engine:
            return []
        return ["--weight-transfer-config", f'{{"backend": "{self.value}"}}']


def check_transfer_available(transfer: WeightTransfer) -> None:
    """Refuse a transfer this machine cannot run.

    Raises:
        ConfigError: `nccl` or `ipc` without CUDA.
    """
    if transfer in (WeightTransfer.NCCL, WeightTransfer.IPC):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"engine.weight_transfer={transfer.value} needs CUDA on the trainer and the "
                "engines, and this machine has no GPU: use weight_transfer=file (or gloo, the "
                "same protocol on CPUs)"
            )


@runtime_checkable
class TransferClient(Protocol):
    """One engine's weight-sync control plane (vLLM's `VLLMWeightSyncClient`), and its size.

    Calls block until the engine has done them; the backend runs `update_weights`
    concurrently with its own send.
    """

    name: str
    """The engine, for messages."""

    def world_size(self) -> int:
        """The engine's workers (TP x PP x DP): the ranks it takes in the group."""
        ...

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer group."""

    def start_weight_update(self) -> None:
        """Begin an update (vLLM's layerwise reload)."""

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one update and load it."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update (vLLM's layerwise reload finishes the layers)."""

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the trainer's transfer group."""


class TransferError(EngineError):
    """An engine failed its part of a weight transfer."""

    def __init__(self, engine: str, cause: BaseException) -> None:
        super().__init__(f"{engine}: weight transfer failed: {cause}")
        self.engine = engine
        self.cause = cause


class FanOutClient:
    """Several engines' control planes driven as one (a `VLLMWeightSyncClient`).

    Every call goes to every engine at once and returns when all have answered. The init
    call gives engine i the group ranks after those of engines 0..i-1 (vLLM's trainer engines
    address one engine at `rank_offset` 1).
    """

    def __init__(self, clients: Sequence[TransferClient]) -> None:
        if not clients:
            raise EngineUnavailableError("no engine is up to receive the weights")
        self.clients = list(clients)
        sizes = [c.world_size() for c in self.clients]
        self.rank_offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        self.world_size = 1 + sum(sizes)
        """The trainer's rank 0 plus every engine's workers."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer group."""
        if "rank_offset" not in init_info:  # IPC: no group to place the engines in
            self._each(lambda c, _: c.init_weight_transfer_engine(init_info))
            return
        self._each(
            lambda c, offset: c.init_weight_transfer_engine({**init_info, "rank_offset": offset})
        )

    def start_weight_update(self) -> None:
        """Begin an update on every engine; if one fails, close it on those that began.

        An engine with an update left open refuses the next start, so the resend to the
        engines left after a loss would fail.
        """
        started: list[TransferClient] = []

        def start(client: TransferClient, _offset: int) -> None:
            client.start_weight_update()
            started.append(client)

        try:
            self._each(start)
        except TransferError:
            for client in started:  # nothing was loaded: the finish keeps the old weights
                try:
                    client.finish_weight_update()
                except Exception as exc:
                    logger.warning("%s: closing the aborted update failed: %s", client.name, exc)
            raise

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one update and load it."""
        self._each(lambda c, _: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update (vLLM's layerwise reload finishes the layers)."""
        self._each(lambda c, _: c.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the trainer's transfer group."""
        self._each(lambda c, _: c.shutdown_weight_transfer_engine())

    def _each(self, call: Callable[[TransferClient, int], None]) -> None:
        """Run `call` on every engine concurrently; raise the first failure, named."""
        with ThreadPoolExecutor(max_workers=len(self.clients)) as threads:
            futures = [
                (c, threads.submit(call, c, offset))
                for c, offset in zip(self.clients, self.rank_offsets, strict=True)
            ]
            failures = [(c, f.exception()) for c, f in futures if f.exception() is not None]
        if failures:
            client, cause = failures[0]
            assert cause is not None
            raise TransferError(client.name, cause) from cause


class StateDictSource:
    """A vLLM `WeightSource` over the state dict of the current send (rank 0's full copy)."""

    def __init__(self) -> None:
        self.state: Mapping[str, torch.Tensor] = {}

    def metadata(self) -> list[ParamMeta]:
        """Name, dtype and shape of each tensor, in sending order."""
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state.items()

    def as_weight_source(self) -> Any:
        """This object as the `WeightSource` subclass vLLM's trainer engines take."""
        from vllm.distributed.weight_transfer.base import WeightSource

        outer = self

        class _Source(WeightSource):
            def metadata(self) -> list[ParamMeta]:
                return outer.metadata()

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return iter(outer)

        return _Source()


class TransferGroup:
    """The trainer side of a vLLM weight transfer to a set of engines (rank 0 only)."""

    def __init__(self, transfer: WeightTransfer, *, address: str = "127.0.0.1") -> None:
        """Set up (nothing connects before the first `send`).

        Args:
            transfer: a vLLM-engine transfer (`nccl`, `ipc` or `gloo`).
            address: where the engines reach this process for the group's rendezvous.
        """
        if not transfer.by_vllm_engine:
            raise ConfigError("TransferGroup carries nccl, ipc or gloo transfers, not files")
        check_transfer_available(transfer)
        self.transfer = transfer
        self.address = address
        self._source = StateDictSource()
        self._engine: TrainerWeightTransferEngine[Any] | None = None
        self._fan_out: FanOutClient | None = None
        self._members: tuple[str, ...] = ()
        self.groups_formed = 0
        """How many times the group was formed (once, plus once per change of engines)."""

    def send(self, clients: Sequence[TransferClient], state: Mapping[str, torch.Tensor]) -> None:
        """Send `state` to the engines of `clients` (forming the group first if they changed).

        Blocks until every engine has loaded the weights. On failure the group is dropped:
        the next send forms it again.

        Raises:
            TransferError: an engine failed (named in the message).
        """
        names = tuple(c.name for c in clients)
        try:
            if names != self._members or self._engine is None:
                self._form(clients)
            self._source.state = state
            assert self._engine is not None
            self._engine.send_weights()
        except BaseException:
            self._drop(notify=False)
            raise
        finally:
            self._source.state = {}

    def _form(self, clients: Sequence[TransferClient]) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self._drop(notify=True)
        fan_out = FanOutClient(clients)
        info = self._trainer_init_info(fan_out.world_size)
        logger.info(
            "forming the %s weight-transfer group: trainer + %d engine workers on %s",
            self.transfer.value, fan_out.world_size - 1, ", ".join(c.name for c in clients),
        )  # fmt: skip
        self._engine = WeightTransferTrainerFactory.trainer_init(
            info, client=fan_out, source=self._source.as_weight_source()
        )
        self._fan_out = fan_out
        self._members = tuple(c.name for c in clients)
        self.groups_formed += 1

    def _trainer_init_info(self, world_size: int) -> TrainerInitInfo:
        from tir_rl.distributed import free_port

        if self.transfer is WeightTransfer.GLOO:
            from tir_rl.engine.in_vllm.gloo_receiver import GlooTrainerInitInfo, register

            register()
            return GlooTrainerInitInfo(
                master_address=self.address,
                master_port=free_port(self.address),
                world_size=world_size,
                rank=0,
            )
        if self.transfer is WeightTransfer.NCCL:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            return NCCLTrainerInitInfo(
                master_address=self.address,
                master_port=free_port(self.address),
                world_size=world_size,
                rank=0,
            )
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0)

    def _drop(self, *, notify: bool) -> None:
        """Forget the group; with `notify`, the engines that are still there release theirs."""
        engine, fan_out = self._engine, self._fan_out
        self._engine, self._fan_out, self._members = None, None, ()
        if engine is not None:
            engine.shutdown()
        if notify and fan_out is not None:
            for client in fan_out.clients:
                try:
                    client.shutdown_weight_transfer_engine()
                except Exception as exc:  # an engine that left the pool cannot answer
                    logger.info("%s did not release its transfer group: %s", client.name, exc)

    def close(self) -> None:
        """Release the group on both sides (idempotent)."""
        self._drop(notify=True)


def transfer_group_for(transfer: WeightTransfer, address: str) -> TransferGroup | None:
    """The trainer side of `transfer` (None for `file`); refuses a transfer needing CUDA."""
    return TransferGroup(transfer, address=address) if transfer.by_vllm_engine else None


@runtime_checkable
class TransferReceiver(Protocol):
    """An engine that receives weights through a `TransferGroup` (both vLLM engines)."""

    def transfer_client(self) -> TransferClient:
        """Its control plane."""
        ...

    async def receive_transfer(self, round_: TransferRound, version: int | None) -> None:
        """Hold requests as for a weight update, take part in `round_`, then label `version`."""
        ...


class TransferRound:
    """One send through a `TransferGroup`: every engine holds its requests, then one send.

    The sender waits until every engine holds (its `receive_transfer` called `hold`), sends,
    and then releases them; an engine that fails to hold in `ROUND_TIMEOUT_S` aborts the
    round for all.
    """

    def __init__(self, engines: int, timeout_s: float = ROUND_TIMEOUT_S) -> None:
        self._ready = threading.Barrier(engines + 1, timeout=timeout_s)
        self._done = threading.Event()
        self._error: BaseException | None = None

    def send(self, deliver: Callable[[], None]) -> None:
        """Sender (blocking): wait for every engine to hold, run `deliver`, release them."""
        try:
            self._ready.wait()
            deliver()
        except BaseException as exc:
            self._error = exc
            self._ready.abort()
            raise
        finally:
            self._done.set()

    def hold(self) -> None:
        """Engine (blocking, while it holds its requests): wait until the send is over.

        Raises:
            EngineError: the send failed or the round was aborted.
        """
        try:
            self._ready.wait()
        except threading.BrokenBarrierError:
            self._done.wait()
            raise EngineError(f"weight transfer round aborted: {self._error}") from None
        self._done.wait()
        if self._error is not None:
            raise EngineError(f"weight transfer failed: {self._error}")


async def send_by_transfer(
    group: TransferGroup,
    receivers: Sequence[TransferReceiver],
    state: Mapping[str, torch.Tensor],
    version: int | None,
) -> dict[str, BaseException]:
    """Send `state` to `receivers` in one round; the failures by engine name (empty: all have it).

    Engines are named as their `transfer_client().name`. A failure of the send itself counts
    for the engine it names (`TransferError`), or for every engine when it names none.
    """
    round_ = TransferRound(len(receivers))
    clients = [engine.transfer_client() for engine in receivers]
    names = [c.name for c in clients]
    outcomes = await asyncio.gather(
        asyncio.to_thread(round_.send, lambda: group.send(clients, state)),
        *(engine.receive_transfer(round_, version) for engine in receivers),
        return_exceptions=True,
    )
    send_outcome, engine_outcomes = outcomes[0], outcomes[1:]
    if isinstance(send_outcome, TransferError):
        return {send_outcome.engine: send_outcome}
    if isinstance(send_outcome, BaseException):
        return dict.fromkeys(names, send_outcome)
    return {
        name: outcome
        for name, outcome in zip(names, engine_outcomes, strict=True)
        if isinstance(outcome, BaseException)
    }


async def send_to_engine(
    group: TransferGroup,
    engine: TransferReceiver,
    state: Mapping[str, torch.Tensor],
    version: int | None,
) -> None:
    """One engine's update by transfer (`send_by_transfer` to it alone); raises its failure."""
    failures = await send_by_transfer(group, [engine], state, version)
    if failures:
        raise next(iter(failures.values()))
