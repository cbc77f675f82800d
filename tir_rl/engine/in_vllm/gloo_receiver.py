"""A `gloo` backend for vLLM's weight-transfer engines: NCCL's protocol on CPUs.

vLLM ships NCCL and CUDA-IPC weight transfer (`vllm.distributed.weight_transfer`); both need
CUDA. This backend speaks the same protocol (the same HTTP routes, the same worker-side
lifecycle: init, start, update, finish, and the same trainer-side `send_weights`) with
torch's gloo collectives as the data plane, so the path a GPU run takes with `nccl` runs,
and is tested, on a CPU. It is registered with vLLM as a general plugin
(`[project.entry-points."vllm.general_plugins"]` in pyproject.toml), which vLLM loads in
every engine process.

Wire format: one broadcast per dtype from the trainer (rank 0) to every worker, of all the
tensors of that dtype flattened end to end in the order of the update info; the workers
cut the buffer back into tensors and load them with the model's `load_weights` inside
vLLM's layerwise-reload lifecycle, as the NCCL engine does.

The group meets at torch's TCP store on the trainer, which asks no one for credentials. Its
keys live under a random prefix made for each group (`group_key`), which reaches the
workers only in the authenticated `/init_weight_transfer_engine` call: a stranger who
connects to the store cannot read or overwrite the addresses the ranks exchange.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

BACKEND = "gloo"
"""The name this backend registers under, in `--weight-transfer-config '{"backend": ...}'`."""


@dataclass(kw_only=True)
class GlooWorkerInitInfo(WeightTransferInitInfo):
    """Worker side of the rendezvous: where the trainer listens and this server's ranks."""

    master_address: str
    master_port: int
    rank_offset: int
    """Group rank of this server's first worker (the trainer is 0)."""
    world_size: int
    """The trainer plus every worker of every server in the group."""
    group_key: str
    """The group's store prefix, new for each group (see the module docstring)."""


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update's tensors, in the order they are packed."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"gloo update info: {len(self.names)} names, {len(self.dtype_names)} dtypes "
                f"and {len(self.shapes)} shapes; they must be as many"
            )


@dataclass(kw_only=True)
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the rendezvous (the trainer opens it as rank 0)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int


def _group(address: str, port: int, rank: int, world_size: int, key: str) -> ProcessGroup:
    """A gloo group outside torch's global state, its store's keys under `key`."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_timeout
    from torch.distributed.rendezvous import rendezvous
    from vllm.distributed.utils import init_gloo_process_group
    from vllm.utils.network_utils import get_tcp_uri

    timeout = _get_default_timeout("gloo")
    store, rank, world_size = next(
        rendezvous(get_tcp_uri(address, port), rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    return init_gloo_process_group(
        prefix_store=PrefixStore(f"tir-rl-transfer/{key}", store),
        group_rank=rank,
        group_size=world_size,
        timeout=timeout,
    )


def _by_dtype(dtype_names: Sequence[str]) -> dict[str, list[int]]:
    """Indices of the tensors of each dtype, dtypes in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(dtype_names):
        groups.setdefault(name, []).append(i)
    return groups


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GlooWeightTransferEngine(WeightTransferEngine[GlooWorkerInitInfo, GlooUpdateInfo]):
    """Worker side: receives the trainer's broadcasts and loads them into the model."""

    init_info_cls = GlooWorkerInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._group: ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooWorkerInitInfo) -> None:
        """Join the trainer's group at this worker's rank."""
        p = self.parallel_config
        worker_rank = p.data_parallel_index * p.world_size + p.rank
        self._group = _group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker_rank,
            init_info.world_size,
            init_info.group_key,
        )

    def start_weight_update(self) -> None:
        """Begin an update (vLLM's layerwise reload)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """End the update (vLLM's layerwise reload finishes the layers)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive one buffer per dtype and load the tensors cut from it."""
        if self._group is None:
            raise RuntimeError("gloo weight transfer: receive before init_transfer_engine")
        for dtype_name, indices in _by_dtype(update_info.dtype_names).items():
            sizes = [_numel(update_info.shapes[i]) for i in indices]
            buffer = torch.empty(sum(sizes), dtype=getattr(torch, dtype_name))
            self._group.broadcast(buffer, 0).wait()
            pieces = buffer.split(sizes)
            self.model.load_weights(
                [
                    (update_info.names[i], piece.view(update_info.shapes[i]))
                    for i, piece in zip(indices, pieces, strict=True)
                ]
            )

    def update_weights(self, update_info: dict[str, object]) -> None:
        """Receive one update and load it."""
        # The base class ends with torch.accelerator.synchronize(), which needs an
        # accelerator; gloo's broadcasts are complete when `wait()` returns.
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        """Leave the transfer group."""
        self._group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 broadcasts the source's tensors to every worker."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._group: ProcessGroup | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Open the group as rank 0 while the workers join it (every trainer rank calls this)."""
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = GlooWorkerInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            group_key=secrets.token_hex(16),
        )
        # The workers block in the rendezvous; it completes when the trainer joins too.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine._group = _group(
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                worker_info.group_key,
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        """Broadcast the source's tensors, one buffer per dtype, while the workers receive."""
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        assert self._group is not None, "trainer_init must run before send_weights"
        meta = self.source.metadata()
        info = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        tensors = dict(self._checked(self.source, [m.name for m in meta]))
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(info))
            for indices in _by_dtype(info.dtype_names).values():
                flat = torch.cat([tensors[info.names[i]].reshape(-1) for i in indices])
                self._group.broadcast(flat, 0).wait()
            received.result()
        finally:
            # If the broadcast failed, the workers are stuck in theirs: do not wait on them.
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    @staticmethod
    def _checked(source: WeightSource, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, tensor) in enumerate(source):
            if i >= len(names) or name != names[i]:
                raise ValueError(
                    f"weight source yielded {name!r} at position {i}; its metadata() "
                    "declared another order"
                )
            yield name, tensor.detach().contiguous()

    def shutdown(self) -> None:
        """Leave the transfer group."""
        self._group = None


def register() -> None:
    """Make `backend: gloo` known to vLLM in this process (its general-plugin hook; idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
