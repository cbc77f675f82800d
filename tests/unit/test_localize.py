"""The parity localizer's logic: which stage it names, and what it says the cause is.

The engine here is a fake: a second in-memory transformers Llama standing in for vLLM's
model (its hooks give the "engine" outputs). The real engine is tested in
tests/integration/engine/test_doctor_causes.py.
"""

import asyncio
import copy
from dataclasses import dataclass

import pytest
import torch

from tir_rl.engine.base import GenerateRequest, GenerateResult
from tir_rl.engine.in_vllm.layer_capture import (
    LOGITS_MODULE,
    ForwardCapture,
    ModuleInputs,
    WeightSample,
)
from tir_rl.errors import ConfigError
from tir_rl.mismatch.localize import (
    Localization,
    StageGap,
    WeightGap,
    localize,
    stage_modules,
    trainer_forward,
)

PROBE = [3, 17, 5, 60, 22, 9, 41, 8, 13, 2, 77, 31]
PROMPT = [3, 17, 5, 60]


def tiny_llama(*, tied: bool = True, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@dataclass
class FakeModelInfo:
    dtype: str


class FakeCaptureEngine:
    """Answers the localizer's calls from a transformers model instead of vLLM."""

    def __init__(self, model, *, temperature_in_logprobs: bool = True) -> None:
        self.model = model
        self.temperature_in_logprobs = temperature_in_logprobs
        self.model_info = FakeModelInfo(str(next(model.parameters()).dtype).split(".")[-1])

    async def capture_forward(self, token_ids, names) -> ForwardCapture:
        forward = trainer_forward(self.model, token_ids, names)
        logits = forward.logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(token_ids[1:])[:, None])

        def tensors_of(call):
            args, kwargs = call
            keep = {k: v[0] for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            return ModuleInputs(args=tuple(a[0] for a in args), kwargs=keep)

        inputs = {name: tensors_of(call) for name, call in forward.calls.items()}
        final = forward.outputs["model.norm"][:-1]
        inputs[LOGITS_MODULE] = ModuleInputs(args=(None, final), kwargs={})
        return ForwardCapture(
            outputs=forward.outputs, inputs=inputs, logits=logits, prompt_logprobs=lp[:, 0].tolist()
        )

    async def weight_samples(self, stride) -> dict[str, WeightSample]:
        return {
            name: WeightSample(shape=tuple(p.shape), values=p.detach().reshape(-1)[::stride])
            for name, p in self.model.named_parameters()
        }

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ids = list(request.prompt_token_ids)
        gen = torch.Generator().manual_seed(request.seed)
        logprobs = []
        for _ in range(request.max_tokens):
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            probs = torch.softmax(logits / request.temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=gen))
            scale = request.temperature if self.temperature_in_logprobs else 1.0
            logprobs.append(float(torch.log_softmax(logits / scale, -1)[token]))
            ids.append(token)
        n = len(request.prompt_token_ids)
        return GenerateResult(
            token_ids=ids[n:], logprobs=logprobs, policy_versions=[0] * (len(ids) - n),
            finish_reason="length", stop_sequence=None, num_prompt_tokens=n,
        )  # fmt: skip


def training_forward(dtype: torch.dtype = torch.float32):
    """The trainer's own scoring forward, on the CPU in `dtype` (autocast below float32)."""
    from tir_rl.trainer.batch import Packing
    from tir_rl.trainer.forward import TrainerForward

    return TrainerForward(
        device=torch.device("cpu"), compute_dtype=dtype, sharded=False, temperature=1.0,
        micro_batch_tokens=4096, packing=Packing.PACKED,
    )  # fmt: skip


def run(engine, model, temperature=0.7, scorer=None) -> Localization:
    return asyncio.run(
        localize(
            engine, model, PROBE, scorer=scorer or training_forward(), prompt_ids=PROMPT,
            temperature=temperature,
        )
    )  # fmt: skip


def perturbed(model, where: str, scale: float = 0.1):
    copy_ = copy.deepcopy(model)
    module = dict(copy_.named_modules())[where]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * param.abs().mean() * torch.randn(param.shape, generator=gen))
    return copy_


def test_stages_follow_the_forward_and_skip_modules_that_mean_different_tensors():
    model = tiny_llama()
    names = stage_modules(model)
    assert names[0] == "model.embed_tokens" and names[-1] == "model.norm"
    assert "model.layers.1.mlp" in names and "model.layers.0.self_attn" in names
    assert not any(n.endswith(("act_fn", "o_proj", "rotary_emb")) for n in names)
    assert "model.layers.0" not in names  # a decoder layer's output: vLLM returns a part of it
    forward = trainer_forward(model, PROBE, names)
    order = forward.order
    assert order.index("model.layers.0.self_attn") < order.index("model.layers.0.mlp")
    assert forward.outputs["model.layers.1.mlp"].shape == (len(PROBE), 16)
    assert forward.logits.shape == (len(PROBE) - 1, 96)


def test_the_same_model_on_both_sides_diverges_nowhere():
    model = tiny_llama()
    report = run(FakeCaptureEngine(copy.deepcopy(model)), model)
    assert report.first_divergence is None
    hidden = [s for s in report.stages if s.role not in ("prompt logprobs", "sampled logprobs")]
    assert all(s.relative_gap == 0 and s.own_gap == 0 for s in hidden), report.table()
    assert [s.role for s in report.stages[-3:]] == ["logits", "prompt logprobs", "sampled logprobs"]
    assert "no stage diverges" in report.diagnosis


def test_the_localizer_measures_the_training_forward_under_bf16_autocast():
    """Trainer side in bf16 autocast (as training would run it), engine in float32: every
    stage from the first attention on, and both logprob stages, see the bf16 forward. A
    localizer scoring with its own float32 forward would find no gap at all here."""
    model = tiny_llama()
    engine = FakeCaptureEngine(copy.deepcopy(model))
    fp32 = {s.name: s for s in run(engine, model).stages}
    bf16 = {s.name: s for s in run(engine, model, scorer=training_forward(torch.bfloat16)).stages}
    # float32: the same numbers on both sides (measured 0 and 2e-8); bf16: 4e-5 and 8e-5
    assert fp32["prompt logprobs"].relative_gap < 1e-6
    assert bf16["prompt logprobs"].relative_gap > 1e-5
    sampled = next(name for name in bf16 if name.startswith("sampled logprobs"))
    assert fp32[sampled].relative_gap < 1e-6 and bf16[sampled].relative_gap > 1e-5
    # the hooked stages and their replays ran in bf16 too (own gaps 4e-3 here, 0 in float32)
    assert fp32["model.layers.0.self_attn"].own_gap == 0
    assert bf16["model.layers.0.self_attn"].own_gap > 1e-3


@pytest.mark.parametrize(
    "where",
    ["model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.self_attn",
     "model.layers.1.mlp"],
)  # fmt: skip
def test_a_weight_changed_in_one_module_is_named_there_and_nowhere_earlier(where):
    model = tiny_llama()
    report = run(FakeCaptureEngine(perturbed(model, where)), model)
    assert report.first_divergence is not None and report.first_divergence.name == where
    assert f"enters at {where}" in report.diagnosis
    # run on the engine's own input, every other stage gives the engine's output bit for bit
    own = [s.name for s in report.stages if s.own_gap]
    assert own == [where], report.table()


def test_a_rounded_tied_embedding_is_named_as_the_trainers_weights_rounded():
    model = tiny_llama(tied=True)
    engine_model = copy.deepcopy(model)
    with torch.no_grad():
        w = engine_model.model.embed_tokens.weight
        w.copy_(w.to(torch.bfloat16).float())
    report = run(FakeCaptureEngine(engine_model), model)
    first = report.first_divergence
    assert first is not None and first.name == "model.embed_tokens"
    assert first.weights_differ[0].rounded_to == "bfloat16"
    assert "rounded to bfloat16" in report.diagnosis
    logits = next(s for s in report.stages if s.role == "logits")
    assert logits.weights_differ, "the tied head's weights are shown at the logits too"


def test_a_norm_gain_changed_is_named_as_other_weight_values():
    model = tiny_llama()
    engine_model = copy.deepcopy(model)
    with torch.no_grad():
        engine_model.model.norm.weight.mul_(1.05)
    report = run(FakeCaptureEngine(engine_model), model)
    assert report.first_divergence.name == "model.norm"
    assert "other values of model.norm.weight" in report.diagnosis


def test_logprobs_reported_before_temperature_are_named_at_the_sampled_stage():
    model = tiny_llama()
    engine = FakeCaptureEngine(copy.deepcopy(model), temperature_in_logprobs=False)
    report = run(engine, model, temperature=0.7)
    assert report.first_divergence.role == "sampled logprobs"
    assert "logprobs_mode" in report.diagnosis
    assert run(engine, model, temperature=1.0).first_divergence is None


def test_a_lower_precision_engine_is_named_by_its_dtype():
    model = tiny_llama()
    report = run(FakeCaptureEngine(copy.deepcopy(model).to(torch.bfloat16)), model)
    first = report.first_divergence
    assert first.engine_dtype == "bfloat16" and first.trainer_dtype == "float32"
    assert "computes in bfloat16" in report.diagnosis
    assert "the trainer's weights rounded to it" in report.diagnosis


def test_a_model_without_llama_module_names_is_refused():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="Llama-family"):
        run(FakeCaptureEngine(tiny_llama()), Plain())


def gap(name, role, rel, *, dtype="float32", weights=()):
    return StageGap(
        name=name, role=role, engine_dtype=dtype, trainer_dtype="float32",
        relative_gap=rel, max_abs_diff=rel, weights=weights,
    )  # fmt: skip


def report_of(*stages) -> Localization:
    return Localization(
        stages=stages, tolerance=1e-4, temperature=1.0, num_tokens=8, unreadable_weights=4
    )


def test_the_largest_jump_is_where_the_gap_grows_most_not_the_largest_gap():
    report = report_of(
        gap("e", "embedding", 0.0), gap("a", "attention", 1e-7), gap("m", "mlp", 1e-3),
        gap("n", "final norm", 5e-3), gap("logits", "logits", 6e-3),
    )  # fmt: skip
    assert report.first_divergence.name == "m"
    assert report.largest_jump.name == "m"
    table = report.table()
    assert "m <" in table and "n *" in table and "a *" not in table


def test_a_stage_that_differs_in_dtype_alone_is_named_by_its_dtype():
    report = report_of(gap("e", "embedding", 0.0), gap("a", "attention", 2e-3, dtype="bfloat16"))
    assert "computes in bfloat16, the trainer in float32" in report.diagnosis


def test_a_stage_with_equal_weights_and_dtype_is_a_computation_difference():
    same = WeightGap(name="m.weight", max_abs_diff=0.0, rounded_to=None)
    report = report_of(gap("n", "norm", 3e-3, weights=(same,)))
    assert "computation differs" in report.diagnosis
    assert "4 engine parameters are not" in report.diagnosis


def test_doctor_localize_refuses_a_server_engine_before_starting_anything():
    from tir_rl.config import load
    from tir_rl.doctor import run_localize
    from tir_rl.run_config import RunConfig

    server = ["engine.kind=http", "engine.http.base_url=http://127.0.0.1:9"]
    config = load(RunConfig, "configs/quickstart.yaml", [*server, "engine.weights_dir=/tmp/w"])
    with pytest.raises(ConfigError, match="engine.kind=local"):
        run_localize(config)
