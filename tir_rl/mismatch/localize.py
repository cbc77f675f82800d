"""Locate sampler/trainer mismatch: the same tokens through both models, stage by stage.

The engine's stages come from vLLM's own forward (forward hooks installed in its worker
through `engine.in_vllm.layer_capture`); the trainer's from the same hooks on its
transformers model, run under the trainer's autocast, and its prompt and sampled logprobs
from the trainer's own scoring forward (`SequenceScorer`: the trainer's `TrainerForward`),
so that the localizer measures the forward training computes.
Both see the probe's token ids, so each stage's gap is measured on equal inputs up to what
the earlier stages already moved::

    embedding ─► [input norm ─► attention ─► post-attention norm ─► MLP] x layers
              ─► final norm ─► logits ─► prompt logprobs ─► sampled logprobs at T

Each stage's gap ‖engine − trainer‖ / ‖trainer‖ includes what earlier stages moved; its
*own* gap is the trainer's stage run on the engine's input to it. A stage diverges when its
own gap exceeds the tolerance of the trainer's dtype (the reference). The first diverging
stage is where the mismatch enters; `Localization.diagnosis` says what kind it is, from
what the stage shows:

- its weights differ (where the engine can show them: embeddings and norms; vLLM-CPU
  repacks linear weights into its kernel layout): the engine holds the trainer's weights
  rounded to a lower precision, or other values altogether (a stale or transformed sync);
- its dtype differs: the engine computes in another precision;
- only the sampled logprobs differ: the sampler processes logits into logprobs otherwise
  than the trainer (`logprobs_mode`, temperature);
- none of these: the computation itself differs (kernel, epsilon, rotary, attention).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tir_rl.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from tir_rl.engine.in_vllm.layer_capture import ForwardCapture, ModuleInputs, WeightSample
    from tir_rl.engine.vllm_local import VLLMLocalEngine


class SequenceScorer(Protocol):
    """The trainer's scoring forward as the localizer uses it (`trainer.forward.TrainerForward`)."""

    def sequence(
        self, model: Any, token_ids: Sequence[int], *, temperature: float = 1.0
    ) -> torch.Tensor:
        """[T − 1] float32 CPU teacher-forced logprobs of `token_ids[1:]` under `model`."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context the trainer's forward runs its model in (its compute dtype)."""
        ...


StageRole = Literal[
    "embedding", "norm", "attention", "mlp", "final norm", "logits", "prompt logprobs",
    "sampled logprobs",
]  # fmt: skip
MODULE_ROLES: dict[str, StageRole] = {
    "embed_tokens": "embedding",
    "input_layernorm": "norm",
    "self_attn": "attention",
    "post_attention_layernorm": "norm",
    "mlp": "mlp",
    "norm": "final norm",
}
"""Last component of a module name -> its stage. Hugging Face Llama-family names, which
vLLM's implementations of those models keep; other modules (a decoder layer's own output,
activation functions) mean different tensors on the two sides and are not compared."""
TOLERANCES = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 4e-3}
"""The own gap above which a stage diverges, by the trainer's dtype. float32: own gaps of
rounding were at most 1e-6 on the bundled model (bench/localize_records), one rounding of a
tensor to bfloat16 is about 2e-3. bfloat16: its rounding gives own gaps about 4e-3 per
stage (and cumulative gaps above 3e-2 after ten layers of the bundled model)."""
WEIGHT_STRIDE = 97
"""Every 97th element of each parameter is compared (prime: no alignment with rows)."""


@dataclass(frozen=True, kw_only=True)
class WeightGap:
    """How the engine's copy of one parameter differs from the trainer's (on a sample)."""

    name: str
    max_abs_diff: float
    rounded_to: str | None
    """A dtype such that the engine's copy equals the trainer's rounded to it, when it
    differs that way; None when equal or differing otherwise."""


@dataclass(frozen=True, kw_only=True)
class StageGap:
    """One stage of the forward: how far the engine's output is from the trainer's."""

    name: str
    """The module name, or the stage's name after the model."""
    role: StageRole
    engine_dtype: str
    trainer_dtype: str
    relative_gap: float
    """‖engine − trainer‖₂ / ‖trainer‖₂ over the stage's whole output."""
    max_abs_diff: float
    weights: tuple[WeightGap, ...] = ()
    """The stage's own parameters the engine can show, compared."""
    own_gap: float | None = None
    """The relative gap between the engine's output and the trainer's stage run on the
    engine's input to it: what this stage's computation adds by itself, whatever gap reached
    it (0: bitwise the same result from the same input). The embedding's is its gap (both
    read the same token ids); the prompt logprobs' compares the engine's with the
    trainer's log-softmax of the engine's logits; None for the sampled logprobs."""

    @property
    def weights_differ(self) -> tuple[WeightGap, ...]:
        """The stage's weights whose engine copy is not the trainer's."""
        return tuple(w for w in self.weights if w.max_abs_diff > 0)


@dataclass(frozen=True, kw_only=True)
class Localization:
    """Every stage's gap, in forward order, and where the mismatch enters."""

    stages: tuple[StageGap, ...]
    tolerance: float
    temperature: float
    num_tokens: int
    """Probe tokens the hidden stages compare."""
    unreadable_weights: int
    """Engine parameters whose values cannot be read back (vLLM-CPU's repacked linears)."""

    @property
    def first_divergence(self) -> StageGap | None:
        """Where the mismatch enters: the first stage whose own gap exceeds the tolerance.

        A stage's own gap (its computation on the engine's input) separates what it adds
        from what reached it, so rounding that accumulates over many layers in a low
        precision names no stage. The sampled logprobs, which have no own gap, diverge when
        they exceed the tolerance and 10x the prompt logprobs' largest |Δ|.
        """
        prompt = next((s for s in self.stages if s.role == "prompt logprobs"), None)
        for stage in self.stages:
            if stage.role == "sampled logprobs":
                # other tokens than the probe's, from decode steps: it diverges only by more
                # than the prefill's logprobs already do (in nats: confident tokens' logprobs
                # are near 0, where relative gaps mean little)
                floor = 10 * prompt.max_abs_diff if prompt is not None else 0.0
                if stage.relative_gap > self.tolerance and stage.max_abs_diff > floor:
                    return stage
            elif (stage.own_gap if stage.own_gap is not None else stage.relative_gap) > (
                self.tolerance
            ):
                return stage
        return None

    @property
    def largest_jump(self) -> StageGap | None:
        """The stage that multiplies the gap it receives the most (the earliest among ties)."""
        best, best_ratio, previous = None, 1.0, 0.0
        for stage in self.stages:
            if stage.role == "sampled logprobs":
                continue  # other tokens than the probe's: not a step of the same chain
            ratio = stage.relative_gap / max(previous, self.tolerance * 1e-3)
            if ratio > best_ratio:
                best, best_ratio = stage, ratio
            previous = stage.relative_gap
        return best

    @property
    def diagnosis(self) -> str:
        """One sentence: where the mismatch enters and of what kind."""
        stage = self.first_divergence
        if stage is None:
            return (
                f"no stage diverges: every gap is within {self.tolerance:g} of the trainer "
                f"(the largest, {max(s.relative_gap for s in self.stages):.2e}, is rounding)"
            )
        where = f"{stage.name} ({stage.role}, relative gap {stage.relative_gap:.2e})"
        differ = stage.weights_differ
        rounded = [w for w in differ if w.rounded_to is not None]
        if stage.engine_dtype != stage.trainer_dtype:
            held = " (it holds the trainer's weights rounded to it)" if rounded else ""
            return (
                f"the mismatch enters at {where}: the engine computes in {stage.engine_dtype}, "
                f"the trainer in {stage.trainer_dtype}{held}"
            )
        if rounded:
            return (
                f"the mismatch enters at {where}: the engine holds the trainer's "
                f"{rounded[0].name} rounded to {rounded[0].rounded_to}"
            )
        if differ:
            return (
                f"the mismatch enters at {where}: the engine holds other values of "
                f"{differ[0].name} than the trainer (max |Δ| {differ[0].max_abs_diff:.2e}): a "
                "stale sync, or the sync transforms the weights"
            )
        if stage.role == "sampled logprobs":
            return (
                f"the mismatch enters at {where}: hidden states, logits and prompt logprobs "
                "agree, so the sampler turns logits into logprobs otherwise than the trainer "
                f"at temperature {self.temperature:g} (engine.logprobs_mode must be "
                "processed_logprobs; the trainer must use the sampling temperature)"
            )
        own = "" if stage.own_gap is None else f" (on the engine's own input: {stage.own_gap:.2e})"
        return (
            f"the mismatch enters at {where}: its weights and dtype agree (where readable: "
            f"{self.unreadable_weights} engine parameters are not), so its computation "
            f"differs{own} (a kernel, an epsilon, rotary embeddings, attention), or weights "
            "the engine cannot show"
        )

    def table(self) -> str:
        """The stages as an aligned text table, the diverging ones marked."""
        first = self.first_divergence
        rows = [("stage", "role", "engine", "trainer", "rel. gap", "max |Δ|", "own gap", "weights")]
        for s in self.stages:
            weights = ", ".join(
                f"{w.name.rsplit('.', 2)[-2]} Δ{w.max_abs_diff:.1e}"
                + (f" (= {w.rounded_to})" if w.rounded_to else "")
                for w in s.weights_differ
            )
            mark = " <" if s is first else (" *" if s.relative_gap > self.tolerance else "")
            rows.append((
                s.name + mark, s.role, s.engine_dtype, s.trainer_dtype,
                f"{s.relative_gap:.2e}", f"{s.max_abs_diff:.2e}",
                "-" if s.own_gap is None else f"{s.own_gap:.2e}", weights or "-",
            ))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([
            *lines,
            f"< first stage over the tolerance {self.tolerance:g}; * later ones. Own gap: the "
            "trainer's stage run on the engine's input to it (0: bitwise equal)",
            self.diagnosis,
        ])  # fmt: skip


def stage_modules(model: Any) -> list[str]:
    """The names of `model`'s modules that are compared stages, in definition order."""
    return [
        name
        for name, _ in model.named_modules()
        if name and name.rsplit(".", 1)[-1] in MODULE_ROLES and "." in name
    ]


@dataclass(frozen=True, kw_only=True)
class TrainerForward:
    """The trainer model's forward of the probe, stage by stage."""

    order: list[str]
    """Stage module names in the order they ran."""
    outputs: dict[str, torch.Tensor]
    """Name -> the module's (first) output `[T, ...]`."""
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]]
    """Name -> the positional and keyword arguments the module was called with."""
    logits: torch.Tensor
    """`[T - 1, V]`: the logits at positions 0..T-2 (each predicts the next token)."""


def trainer_forward(
    model: Any,
    token_ids: Sequence[int],
    names: Sequence[str],
    autocast: contextlib.AbstractContextManager[object] | None = None,
) -> TrainerForward:
    """Run `token_ids` through the trainer's model, keeping what the modules `names` saw.

    `autocast`: the trainer's compute-dtype context, when given.
    """
    import torch

    modules = dict(model.named_modules())
    order: list[str] = []
    outputs: dict[str, torch.Tensor] = {}
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keeper(name: str) -> Any:
        def hook(_module: Any, args: Any, kwargs: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            outputs[name] = tensor.detach()[0]  # batch of one
            calls[name] = (args, kwargs)
            order.append(name)

        return hook

    handles = [
        modules[name].register_forward_hook(keeper(name), with_kwargs=True) for name in names
    ]
    try:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
        with torch.no_grad(), autocast or contextlib.nullcontext():
            logits = model(ids, use_cache=False).logits[0, :-1]
    finally:
        for handle in handles:
            handle.remove()
    return TrainerForward(order=order, outputs=outputs, calls=calls, logits=logits)


def replay(
    model: Any,
    forward: TrainerForward,
    name: str,
    hidden: torch.Tensor,
    autocast: contextlib.AbstractContextManager[object] | None = None,
) -> torch.Tensor:
    """The trainer's module `name` on `hidden` `[T, H]`, its other arguments as in `forward`.

    With the engine's input to a stage as `hidden`, the gap between this and the engine's
    output is the stage's own: what its computation adds, whatever reached it.
    """
    import torch

    module = model.get_submodule(name)
    args, kwargs = forward.calls[name]
    x = hidden.to(forward.outputs[name].dtype)[None]
    if args:
        args = (x, *args[1:])
    else:
        kwargs = {**kwargs, "hidden_states": x}
    with torch.no_grad(), autocast or contextlib.nullcontext():
        output = module(*args, **kwargs)
    return (output[0] if isinstance(output, tuple) else output)[0]


async def localize(
    engine: VLLMLocalEngine,
    model: Any,
    probe_ids: Sequence[int],
    *,
    scorer: SequenceScorer,
    prompt_ids: Sequence[int],
    temperature: float,
    tolerance: float | None = None,
    num_samples: int = 2,
    max_tokens: int = 16,
) -> Localization:
    """Compare the engine's forward with the trainer model's, stage by stage.

    Args:
        engine: an idle local vLLM engine (started by tir-rl, eager: hooks do not fire in a
            compiled graph), holding the weights the run would send it.
        model: the trainer's transformers causal LM (the reference); not modified.
        probe_ids: the tokens both models prefill (`parity.probe_ids_from_text`).
        scorer: the trainer's scoring forward (`Trainer.forward`): the trainer's prompt and
            sampled logprobs are its, and the hooked stages run under its autocast.
        prompt_ids: the prompt the sampled stage continues (short: a seeded chunked
            prefill kills vLLM-CPU 0.32's engine).
        temperature: the run's sampling temperature (the sampled stage's).
        tolerance: the own gap above which a stage diverges; None: `TOLERANCES` at the
            trainer's dtype.
        num_samples: seeded continuations of `prompt_ids` in the sampled stage.
        max_tokens: tokens per continuation.
    """
    import torch

    from tir_rl.engine.in_vllm.layer_capture import LOGITS_MODULE

    names = stage_modules(model)
    if not names:
        raise ConfigError(
            f"{type(model).__name__} has no module named {', '.join(MODULE_ROLES)}: the "
            "localizer compares Llama-family models (Hugging Face module names) only"
        )
    trainer_dtype = _dtype_name(next(model.parameters()).dtype)
    if tolerance is None:
        tolerance = TOLERANCES.get(trainer_dtype, TOLERANCES["bfloat16"])
    forward = trainer_forward(model, probe_ids, names, scorer.autocast())
    captured = await engine.capture_forward(probe_ids, forward.order)
    samples = await engine.weight_samples(WEIGHT_STRIDE)
    trainer_weights = _trainer_weight_samples(model)
    stages = []
    for name in forward.order:
        role = MODULE_ROLES[name.rsplit(".", 1)[-1]]
        hidden = _engine_stage_input(role, captured.inputs[name])
        own = None if hidden is None else replay(model, forward, name, hidden, scorer.autocast())
        weights = _weights_of(name, samples, trainer_weights)
        stages.append(
            _stage(name, role, captured.outputs[name], forward.outputs[name], weights, own)
        )
    head = "lm_head" if "lm_head.weight" in samples else "model.embed_tokens"
    head_input = _engine_stage_input("logits", captured.inputs[LOGITS_MODULE])
    # the trainer's head runs on all T rows (the engine's on T - 1): pad to its shape, since a
    # CPU matmul's rounding can depend on the number of rows
    last_row = forward.outputs[forward.order[-1]][-1:]
    with torch.no_grad(), scorer.autocast():
        rows = torch.cat([head_input.to(last_row.dtype), last_row])
        own_logits = model.get_output_embeddings()(rows)[:-1]
    weights = _weights_of(head, samples, trainer_weights)
    stages.append(_stage("logits", "logits", captured.logits, forward.logits, weights, own_logits))
    trainer_logprobs = scorer.sequence(model, probe_ids)
    stages.append(
        _prompt_logprob_stage(captured, trainer_logprobs, forward.logits.dtype, probe_ids)
    )
    stages.append(
        await _sampled_stage(
            engine, model, scorer, prompt_ids, temperature, num_samples, max_tokens
        )
    )
    unreadable = sum(1 for s in samples.values() if math.prod(s.shape) == 0)
    return Localization(
        stages=tuple(stages),
        tolerance=tolerance,
        temperature=temperature,
        num_tokens=len(probe_ids),
        unreadable_weights=unreadable,
    )


def _engine_stage_input(role: StageRole, inputs: ModuleInputs) -> torch.Tensor | None:
    """The hidden states a stage of the engine received; None for the embedding (token ids)."""
    if role == "embedding":
        return None
    if role == "attention" and "hidden_states" in inputs.kwargs:
        return inputs.kwargs["hidden_states"]  # beside the positions
    tensors = inputs.tensors()
    if role in ("norm", "final norm") and len(tensors) >= 2:
        return tensors[0] + tensors[1]  # vLLM's fused norm adds the residual, then normalises
    return tensors[0]


def _relative(engine: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    diff = engine.double() - reference.double()
    return float(diff.norm() / reference.double().norm().clamp_min(1e-30)), float(diff.abs().max())


def _stage(
    name: str, role: StageRole, engine_out: torch.Tensor, trainer_out: torch.Tensor,
    weights: tuple[WeightGap, ...] = (), own: torch.Tensor | None = None,
) -> StageGap:  # fmt: skip
    if engine_out.shape != trainer_out.shape:
        raise ConfigError(
            f"{name}: the engine's output has shape {tuple(engine_out.shape)}, the trainer's "
            f"{tuple(trainer_out.shape)}: the two models are not the same architecture"
        )
    relative_gap, max_abs_diff = _relative(engine_out, trainer_out)
    return StageGap(
        name=name,
        role=role,
        engine_dtype=_dtype_name(engine_out.dtype),
        trainer_dtype=_dtype_name(trainer_out.dtype),
        relative_gap=relative_gap,
        max_abs_diff=max_abs_diff,
        weights=weights,
        own_gap=relative_gap if own is None and role == "embedding" else (  # same token ids
            None if own is None else _relative(engine_out, own)[0]
        ),
    )  # fmt: skip


def _prompt_logprob_stage(
    captured: ForwardCapture,
    trainer: torch.Tensor,
    trainer_dtype: torch.dtype,
    probe_ids: Sequence[int],
) -> StageGap:
    """`trainer`: the scorer's [T − 1] logprobs of the probe, computed in `trainer_dtype`."""
    import torch

    targets = torch.tensor(list(probe_ids[1:]), dtype=torch.long)
    engine = torch.tensor(captured.prompt_logprobs, dtype=torch.float64)
    own = torch.log_softmax(captured.logits.float().cpu(), -1).gather(-1, targets[:, None])[:, 0]
    stage = _stage("prompt logprobs", "prompt logprobs", engine, trainer.cpu(), own=own)
    return dataclasses.replace(
        stage,
        engine_dtype=_dtype_name(captured.logits.dtype),
        trainer_dtype=_dtype_name(trainer_dtype),
    )


async def _sampled_stage(
    engine: VLLMLocalEngine,
    model: Any,
    scorer: SequenceScorer,
    prompt_ids: Sequence[int],
    temperature: float,
    num_samples: int,
    max_tokens: int,
) -> StageGap:
    import torch

    from tir_rl.engine.parity import sample_continuations

    results = await sample_continuations(
        engine, prompt_ids, temperature=temperature, num_samples=num_samples, max_tokens=max_tokens
    )
    engine_lp: list[float] = []
    trainer_lp: list[float] = []
    for result in results:
        full = [*prompt_ids, *result.token_ids]
        want = scorer.sequence(model, full, temperature=temperature)
        engine_lp += [float(x) for x in result.logprobs]
        trainer_lp += want[len(prompt_ids) - 1 :].tolist()
    stage = _stage(
        f"sampled logprobs (T={temperature:g})", "sampled logprobs",
        torch.tensor(engine_lp, dtype=torch.float64), torch.tensor(trainer_lp, dtype=torch.float64),
    )  # fmt: skip
    return dataclasses.replace(
        stage,
        engine_dtype=engine.model_info.dtype,
        trainer_dtype=_dtype_name(next(model.parameters()).dtype),
    )


def _trainer_weight_samples(model: Any) -> dict[str, torch.Tensor]:
    return {
        name: param.detach().reshape(-1)[::WEIGHT_STRIDE].cpu()
        for name, param in model.named_parameters()
    }


def _weights_of(
    module: str, engine: dict[str, WeightSample], trainer: dict[str, torch.Tensor]
) -> tuple[WeightGap, ...]:
    gaps = []
    for name, sample in engine.items():
        if not name.startswith(module + ".") or name.count(".") != module.count(".") + 1:
            continue  # the module's own parameters only
        want = trainer.get(name)
        if want is None or math.prod(sample.shape) == 0 or sample.values.shape != want.shape:
            continue
        gaps.append(_weight_gap(name, sample.values, want))
    return tuple(gaps)


def _weight_gap(name: str, engine: torch.Tensor, trainer: torch.Tensor) -> WeightGap:
    import torch

    gap = float((engine.double() - trainer.double()).abs().max())
    rounded_to = None
    if gap > 0:
        for dtype in (torch.bfloat16, torch.float16):
            if torch.equal(trainer.to(dtype).double(), engine.double()):
                rounded_to = _dtype_name(dtype)
                break
    return WeightGap(name=name, max_abs_diff=gap, rounded_to=rounded_to)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
