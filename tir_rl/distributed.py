"""Process groups and every collective tir-rl uses (gloo on CPU, NCCL on GPU).

Nothing outside this module calls `torch.distributed` directly. Every helper also works
without a process group (one process, world size 1): reductions return their input and
barriers return at once, so the same trainer code runs on a laptop and under torchrun.

Functions named `rank0_*` return their result on rank 0 only (an empty value elsewhere).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tir_rl.errors import ConfigError, ParityError, TirError
from tir_rl.metric import Metric, ReduceOp

__all__ = ["ReduceOp"]  # re-exported: the tensor reductions take it

logger = logging.getLogger(__name__)

Kept = TypeVar("Kept")
Part = TypeVar("Part")


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def is_rank0() -> bool:
    """Whether this process is rank 0."""
    return rank() == 0


def backend_for(device: torch.device) -> str:
    """The collective backend for `device`: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_backend(device: torch.device) -> None:
    """Refuse a process group whose backend cannot serve `device`'s tensors.

    gloo cannot run FSDP2 collectives on CUDA tensors (it crashes, it does not raise), and
    NCCL cannot reduce CPU tensors, so the group's backend must be `backend_for(device)`.

    Raises:
        ConfigError: a process group exists and its backend does not match the device.
    """
    if not is_initialized():
        return
    backend = str(dist.get_backend()).lower()
    expected = backend_for(device)
    names = {part.rsplit(":", 1)[-1] for part in backend.split(",")}  # "cpu:gloo,cuda:nccl"
    if expected not in names:
        raise ConfigError(
            f"The process group uses backend {backend!r} but the trainer runs on {device}, "
            f"which needs {expected!r}. Initialize the group with "
            f"tir_rl.distributed.init_process_group(device=...) for the trainer's device, or "
            f"set trainer.device to match the backend."
        )


def init_process_group(
    *,
    device: torch.device | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float = 600.0,
) -> bool:
    """Create the default process group if this process is part of a multi-rank job.

    Arguments default to torchrun's environment variables (`RANK`, `WORLD_SIZE`,
    `MASTER_ADDR`, `MASTER_PORT`). With world size 1 and no group requested, nothing is
    created and False is returned.

    Args:
        device: the device the trainer uses; picks gloo (CPU) or NCCL (CUDA).
        rank: this process's rank.
        world_size: number of processes.
        master_addr: rendezvous host.
        master_port: rendezvous port.
        timeout_s: collective timeout.

    Returns:
        Whether a process group is initialized after the call.
    """
    if is_initialized():
        if device is not None:
            check_backend(device)
        return True
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return False
    rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(master_port or os.environ.get("MASTER_PORT", "29500"))
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return True


def destroy_process_group() -> None:
    """Tear down the default process group, if any."""
    if is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host` (for local multi-process runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def barrier() -> None:
    """Wait for every rank."""
    if is_initialized():
        dist.barrier()


def _device() -> torch.device:
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_TORCH_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.MEAN: "SUM",
    ReduceOp.MAX: "MAX",
    ReduceOp.MIN: "MIN",
}


def all_reduce_tensor(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduce a tensor across ranks; returns a new tensor (the input is left untouched)."""
    if not is_initialized():
        return tensor.clone()
    out = tensor.detach().to(_device(), copy=True)
    dist.all_reduce(out, op=getattr(dist.ReduceOp, _TORCH_OPS[op]))
    if op is ReduceOp.MEAN:
        out = out / world_size()
    return out.to(tensor.device)


def all_reduce_scalar(value: float, op: ReduceOp = ReduceOp.SUM) -> float:
    """Reduce one float across ranks (float64 on the wire)."""
    return float(all_reduce_tensor(torch.tensor(value, dtype=torch.float64), op).item())


def all_reduce_count(value: int, op: ReduceOp = ReduceOp.SUM) -> int:
    """Reduce one integer count across ranks."""
    return int(all_reduce_tensor(torch.tensor(value, dtype=torch.int64), op).item())


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable `obj`, in rank order."""
    if not is_initialized():
        return [obj]
    out: list[object] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_metrics(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """Reduce a flat row of metrics across ranks to the values of the whole batch.

    Each value is a `Metric` that declares its reduction (`tir_rl.metric`): counts are
    summed; a mean is the global ratio, not the average of per-rank ratios: each rank's value
    is weighted by the count its `over` names (a rank holding fewer tokens counts less; one
    holding none, e.g. the masked copy a rank without a sequence trains on, counts not at
    all), and such a rank's maxima and minima are left out too. A mean without `over` is
    averaged over the ranks holding it. Ranks may hold different keys (e.g. per-turn
    buckets only some ranks have): the result has the union, each reduced over the ranks
    that have it.

    Raises:
        TypeError: a value is not a `Metric` (every metric must say how it combines), also
            without a process group, so a one-process test catches it.
    """
    undeclared = [k for k, v in metrics.items() if not isinstance(v, Metric)]
    if undeclared:
        raise TypeError(
            f"metrics {undeclared[:3]} are plain numbers: return a tir_rl.metric.Metric that "
            "declares how it combines across ranks (count, mean over a count, max, min)"
        )
    if not is_initialized():
        return {k: float(v) for k, v in metrics.items()}
    declared = all_gather_object({k: (m.reduce, m.over) for k, m in metrics.items()})
    kinds: dict[str, tuple[ReduceOp, str | None]] = {}
    for rank_kinds in declared:
        kinds.update(rank_kinds)  # type: ignore[arg-type]  # dicts of declarations
    by_op: dict[ReduceOp, list[str]] = {}
    for key in sorted(kinds):
        by_op.setdefault(kinds[key][0], []).append(key)
    out: dict[str, float] = {}
    for op, names in by_op.items():
        values = torch.tensor([float(metrics.get(k, 0.0)) for k in names], dtype=torch.float64)
        present = torch.tensor([float(k in metrics) for k in names], dtype=torch.float64)
        weight = present * torch.tensor(
            [_local_weight(metrics, kinds[k][1]) for k in names], dtype=torch.float64
        )
        if op is ReduceOp.SUM:
            reduced = all_reduce_tensor(values * present, ReduceOp.SUM)
        elif op is ReduceOp.MEAN:
            sums = all_reduce_tensor(
                torch.stack([values * weight, weight, values * present, present]), ReduceOp.SUM
            )
            weighted = sums[0] / sums[1].clamp(min=1e-300)
            plain = sums[2] / sums[3].clamp(min=1)
            reduced = torch.where(sums[1] > 0, weighted, plain)
        else:  # MAX / MIN: ranks whose count is 0 have nothing to contribute
            fill = -math.inf if op is ReduceOp.MAX else math.inf
            both = all_reduce_tensor(
                torch.stack(
                    [torch.where(weight > 0, values, fill), torch.where(present > 0, values, fill)]
                ),
                op,
            )
            reduced = torch.where(torch.isfinite(both[0]), both[0], both[1])
        out.update(zip(names, reduced.tolist(), strict=True))
    return out


def _local_weight(metrics: Mapping[str, float], over: str | None) -> float:
    if over is None:
        return 1.0
    return max(float(metrics.get(over, 0.0)), 0.0)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from rank `src` to every rank."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients of (possibly sharded) parameters, identical on all ranks.

    FSDP2 gradients are DTensor shards; the norm of the full gradient needs a reduction,
    which `full_tensor()` does. Parameters without a gradient are skipped.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total.detach().float().cpu()


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded state dict (CPU tensors) on rank 0; an empty dict on other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if not is_rank0():
        return {}
    return {k: v.detach().cpu() for k, v in state.items()}


def load_full_model_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load an unsharded state dict held by rank 0 into a (possibly sharded) model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_initialized())
    set_model_state_dict(model, dict(state), options=options)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded, FQN-keyed optimizer state on rank 0; an empty dict on other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    return state if is_rank0() else {}


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping
) -> None:
    """Load an unsharded optimizer state dict held by rank 0 (other ranks pass `{}`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_initialized())
    set_optimizer_state_dict(model, optimizer, optim_state_dict=dict(state), options=options)


def scatter_object(parts: Sequence[object] | None, src: int = 0) -> object:
    """Rank `src` hands `parts[r]` to rank r (one picklable object each); others pass None.

    Without a process group this returns `parts[0]`.
    """
    if not is_initialized():
        assert parts is not None and len(parts) == 1, "one part per rank"
        return parts[0]
    if rank() == src:
        assert parts is not None and len(parts) == world_size(), "one part per rank"
    out: list[object] = [None]
    dist.scatter_object_list(out, list(parts) if rank() == src else None, src=src)
    return out[0]


def rank0_gather_object(obj: object) -> list[object]:
    """Every rank's picklable `obj` in rank order, on rank 0; `[]` on other ranks."""
    if not is_initialized():
        return [obj]
    out: list[object] | None = [None] * world_size() if is_rank0() else None
    dist.gather_object(obj, out, dst=0)
    return out if out is not None else []


def even_split(n: int, parts: int) -> list[range]:
    """`range(n)` cut into `parts` contiguous pieces whose sizes differ by at most one."""
    assert parts >= 1, "at least one part"
    base, extra = divmod(n, parts)
    bounds = [0]
    for r in range(parts):
        bounds.append(bounds[-1] + base + (r < extra))
    return [range(bounds[r], bounds[r + 1]) for r in range(parts)]


def rank0_gather_rows(
    local: Sequence[torch.Tensor | None], *, num_rows: int, shape: Sequence[int]
) -> tuple[torch.Tensor | None, ...]:
    """Rank 0: for each of the given per-row tensors, one [num_rows, ...] from every rank.

    Rank r holds rows `even_split(num_rows, world)[r]` of each, possibly shorter in the last
    dimension than `shape` (its own padding); missing entries stay 0. One collective for all
    of them. A tensor that is None on this rank (the step had none: every rank alike) is None
    in the result; every result is None on ranks > 0.
    """
    if not is_initialized() or world_size() == 1:
        return tuple(local)
    parts = rank0_gather_object(list(local))
    if not is_rank0():
        return tuple(None for _ in local)
    return tuple(
        _joined_rows([p[i] for p in parts], num_rows, shape)  # type: ignore[index]
        for i in range(len(local))
    )


def _joined_rows(
    parts: list[torch.Tensor | None], num_rows: int, shape: Sequence[int]
) -> torch.Tensor | None:
    if parts[0] is None:
        return None
    out = torch.zeros(tuple(shape), dtype=parts[0].dtype)
    for piece, part in zip(even_split(num_rows, world_size()), parts, strict=True):
        if len(piece):  # an empty share trained on a masked filler: nothing to keep
            assert isinstance(part, torch.Tensor)
            out[piece.start : piece.stop, : part.shape[1]] = part
    return out


# --------------------------------------------------------------- rank-0-led coordination
class FailureKind(StrEnum):
    """How the other ranks re-raise a failure of rank 0's."""

    INTERRUPT = "interrupt"
    """Ctrl-C: KeyboardInterrupt (checkpoint and stop)."""
    PARITY = "parity"
    """The sampler drifted from the trainer: ParityError."""
    ERROR = "error"
    """Anything else: TirError naming rank 0's exception."""


@dataclass
class RankFailure:
    """An exception of rank 0's, in the form the other ranks re-raise it."""

    kind: FailureKind
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> RankFailure:
        """The failure the other ranks should re-raise for `exc`."""
        kind = FailureKind.ERROR
        if isinstance(exc, KeyboardInterrupt):
            kind = FailureKind.INTERRUPT
        elif isinstance(exc, ParityError):
            kind = FailureKind.PARITY
        return cls(kind, f"{type(exc).__name__}: {exc}")

    def raise_(self) -> NoReturn:
        """Raise it here: KeyboardInterrupt, ParityError, or TirError for anything else."""
        if self.kind is FailureKind.INTERRUPT:
            raise KeyboardInterrupt
        if self.kind is FailureKind.PARITY:
            raise ParityError(self.message)
        raise TirError(f"rank 0 failed: {self.message}")


class Rank0InterruptGate:
    """Rank 0 of a multi-rank run: Ctrl-C raises only inside `open()` (rank-0-only work).

    Elsewhere the other ranks may be inside a collective with rank 0; an interrupt there is
    remembered and raised when the next `open()` section starts.
    """

    def __init__(self) -> None:
        self.pending = False

    def _defer(self, signum: int, frame: Any) -> None:
        self.pending = True
        logger.warning("interrupt: checkpoint and stop when the ranks are in step")

    @contextlib.contextmanager
    def installed(self) -> Iterator[Rank0InterruptGate]:
        """Defer Ctrl-C while the context is open (the whole run)."""
        previous = signal.signal(signal.SIGINT, self._defer)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """A rank-0-only section: a pending or new Ctrl-C raises KeyboardInterrupt here."""
        if self.pending:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, raise_keyboard_interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._defer)


def raise_keyboard_interrupt(signum: int, frame: Any) -> NoReturn:
    """Ctrl-C raises KeyboardInterrupt where the main thread is, as Python's default does.

    Installed instead of `signal.default_int_handler` because `asyncio.run` treats that one
    specially: while it runs, Ctrl-C only cancels its main task, and a coroutine that absorbs
    the cancellation (library code that cleans up and returns) makes the Ctrl-C vanish
    (`tests/unit/test_ctrl_c.py`).
    """
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """One-process runs: Ctrl-C raises KeyboardInterrupt, even inside `asyncio.run`.

    Leaves a handler the caller installed (anything but Python's default) as it is.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    previous = signal.signal(signal.SIGINT, raise_keyboard_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ranks > 0: Ctrl-C is rank 0's to act on (it tells the others through `rank0_share`)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_handling() -> contextlib.AbstractContextManager[Rank0InterruptGate | None]:
    """How a run handles Ctrl-C: raised at once alone; deferred on rank 0, ignored on the others.

    Yields rank 0's gate (for `rank0_share`), or None.
    """
    if world_size() == 1:
        return sigint_raises()
    if not is_rank0():
        return sigint_ignored()
    return Rank0InterruptGate().installed()


def rank0_share(
    fn: Callable[[], tuple[Kept, Sequence[Part]]],
    *,
    gate: Rank0InterruptGate | None = None,
    on_shared_failure: Callable[[], None] = lambda: None,
) -> tuple[Kept | None, Part]:
    """Run `fn` on rank 0 only; rank r gets item r of its parts, rank 0 also what it kept.

    `fn` returns `(kept, parts)` with one part per rank. When `fn` raises on rank 0, every
    rank raises its kind (KeyboardInterrupt, ParityError, else TirError) after calling
    `on_shared_failure`, so that all of them reach the caller's next collective together.

    Returns:
        `(kept, parts[rank])`; `kept` is None on ranks > 0.
    """
    if not is_initialized() or world_size() == 1:
        kept, parts = fn()
        return kept, parts[0]
    if is_rank0():
        try:
            with gate.open() if gate is not None else contextlib.nullcontext():
                kept, parts = fn()
        except BaseException as exc:
            scatter_object([RankFailure.of(exc)] * world_size())
            on_shared_failure()
            raise
        return kept, scatter_object(parts)  # type: ignore[return-value]
    part = scatter_object(None)
    if isinstance(part, RankFailure):
        on_shared_failure()
        part.raise_()
    return None, part  # type: ignore[return-value]


def rank0_run(
    fn: Callable[[], Kept],
    *,
    gate: Rank0InterruptGate | None = None,
    on_shared_failure: Callable[[], None] = lambda: None,
) -> Kept | None:
    """Run `fn` on rank 0 only and keep its value there (None on the other ranks).

    The rank-0-only work whose result no other rank needs (an evaluation, a weight send);
    a failure is shared as in `rank0_share`.
    """
    world = world_size() if is_initialized() else 1
    kept, _ = rank0_share(
        lambda: (fn(), [None] * world), gate=gate, on_shared_failure=on_shared_failure
    )
    return kept


_LOST_PEER_SIGNS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "socket closed",
    "remote process exited",
    "nccl communicator was aborted",
)


def is_lost_peer(exc: BaseException) -> bool:
    """Whether `exc`, raised in a collective, says another rank went away."""
    if isinstance(exc, dist.DistBackendError | dist.DistNetworkError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(sign in text for sign in _LOST_PEER_SIGNS)
