"""`tir-rl doctor`: the pre-flight parity audit, run before spending compute.

Each check yields a `Finding` (pass / warn / fail, what was seen, and the fix). The checks
follow `docs/mismatch.md`: remove mismatch at the source first (chat template, logprobs
semantics, temperature, dtypes, prefix cache), then measure what is left on real rollouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tir_rl.config_audit import Finding, Verdict, static_findings
from tir_rl.engine.reaping import EngineProcess, reap_leftovers
from tir_rl.run_config import RunConfig
from tir_rl.types import Trajectory

if TYPE_CHECKING:
    import torch

    from tir_rl.chat import ChatFormat
    from tir_rl.engine.base import Engine
    from tir_rl.engine.parity import InferencePathReport
    from tir_rl.engine.truncation import SamplingTruncation
    from tir_rl.mismatch.injection import MismatchInjection
    from tir_rl.mismatch.localize import Localization
    from tir_rl.trainer.forward import TrainerForward

# Sampler vs trainer gaps on this kind of machine (docs/machine-facts): fp32 vLLM CPU gives
# max |Δ| ~6e-5; bf16 gives ~0.3. Above WARN the correction matters; above FAIL it is a bug.
MAX_ABS_DIFF_WARN = 1e-3
MAX_ABS_DIFF_FAIL = 0.5
K3_KL_WARN = 1e-4
PROBE_EXACT = 1e-4
"""An fp32 sampler matches the fp32 trainer to ~1e-6 (tiny model) / ~6e-5 (SmolLM2-135M) on
the probes; a larger gap means the sampler computes something else."""
ATTRIBUTION_RATIO = 0.1
"""A cause explains a gap when modelling it on the trainer side shrinks the gap this much."""
SYNC_PERTURBATION = 0.1
"""The sync check adds this × (each matrix's std) × N(0, 1) to a copy of the trainer."""


def rendering_findings(trajectories: Sequence[Trajectory], chat_format: Any) -> list[Finding]:
    """Template consistency and re-tokenization drift on real rollouts."""
    from tir_rl.chat import compare_incremental_with_full

    out = []
    diffs = [
        compare_incremental_with_full(t.messages, chat_format=chat_format) for t in trajectories
    ]
    bad = [d for d in diffs if not d.equal]
    if not bad:
        out.append(Finding(
            "incremental vs full render", Verdict.PASS,
            f"identical on {len(diffs)} replayed conversations",
        ))  # fmt: skip
    else:
        out.append(Finding(
            "incremental vs full render", Verdict.WARN,
            f"{len(bad)}/{len(diffs)} differ; first: {bad[0].describe()}",
            "tir-rl never re-renders (TITO), so training is unaffected; a trainer that "
            "re-renders chats would see other tokens. Check the chat template if this is new.",
        ))  # fmt: skip
    drifted = sum(_retokenization_drifts(t, chat_format) for t in trajectories)
    verdict = Verdict.PASS if drifted == 0 else Verdict.WARN
    out.append(Finding(
        "re-tokenization drift", verdict,
        f"{drifted}/{len(trajectories)} episodes hold sampled tokens that decode+encode "
        "would change",
        "" if drifted == 0 else "expected with sampling; tir-rl trains on the sampled ids",
    ))  # fmt: skip
    return out


def template_finding(chat_format: ChatFormat) -> Finding:
    """Our rendering against the tokenizer's own chat template, on the probe conversation.

    PASS when the token ids are identical (or the tokenizer has no template to compare
    with), WARN naming the first differing token and the two texts there otherwise.
    """
    from tir_rl.chat import template_diff
    from tir_rl.chat.family import chat_template_of
    from tir_rl.chat.probe import probe_conversations
    from tir_rl.errors import ChatFormatError

    check = "chat template"
    family = chat_format.name.value
    if chat_template_of(chat_format.tokenizer) is None:
        return Finding(
            check, Verdict.PASS,
            f"chat.format={family}; the tokenizer has no chat_template to compare with",
        )  # fmt: skip
    fix = (
        "tir-rl trains on its own rendering (TITO), so rollouts and training agree; the model "
        "was tuned on its template's. Check the difference against the known ones in "
        "docs/bring_your_model.md; otherwise set chat.format to the family the model was "
        "trained with (chatml, qwen, llama3, template)"
    )
    differences = []
    for label, messages in probe_conversations(chat_format).items():
        try:
            diff = template_diff(chat_format, messages)
        except ChatFormatError as exc:
            cause = exc.__cause__ or exc
            differences.append(
                f"the tokenizer's chat_template cannot render the {label} "
                f"({type(cause).__name__}: {cause}), so it was not compared"
            )
            continue
        if diff is not None:
            differences.append(f"on the {label}, {diff.describe('ours', 'template')}")
    if not differences:
        return Finding(
            check, Verdict.PASS,
            f"chat.format={family} renders the probe conversations (with and without a system "
            "message) exactly as the tokenizer's chat_template",
        )  # fmt: skip
    return Finding(
        check, Verdict.WARN,
        f"chat.format={family} against the tokenizer's chat_template: " + "; ".join(differences),
        fix,
    )  # fmt: skip


def measured_finding(metrics: dict[str, float], num_episodes: int) -> Finding:
    """Verdict on the measured sampler/trainer gap over real rollouts."""
    worst = metrics.get("mismatch/abs_diff_max", float("nan"))
    k3 = metrics.get("mismatch/k3_kl", float("nan"))
    detail = (
        f"{num_episodes} episodes: max |Δ| {worst:.2e}, mean |Δ| "
        f"{metrics.get('mismatch/abs_diff_mean', float('nan')):.2e}, k3 KL {k3:.2e}, "
        f"kl {metrics.get('mismatch/kl', float('nan')):.2e}"
    )
    if not worst <= MAX_ABS_DIFF_FAIL:
        return Finding(
            "sampler vs trainer logprobs", Verdict.FAIL, detail,
            "the engine and trainer do not run the same model: check model paths, dtype, "
            "and that weights were synced",
        )  # fmt: skip
    if worst > MAX_ABS_DIFF_WARN or k3 > K3_KL_WARN:
        return Finding(
            "sampler vs trainer logprobs", Verdict.WARN, detail,
            "turn on a correction (correction_preset=geo_rs_token_tis) and watch mismatch/*",
        )  # fmt: skip
    return Finding("sampler vs trainer logprobs", Verdict.PASS, detail)


def _replayed(config: RunConfig) -> SamplingTruncation | None:
    """The kept set the run's trainer replays (None: the whole vocabulary)."""
    return config.rollout.truncation if config.trainer.replay_kept_set else None


def truncation_finding(
    replayed: torch.Tensor,
    unreplayed: torch.Tensor,
    sampler: torch.Tensor,
    loss_mask: torch.Tensor,
    truncation: SamplingTruncation,
) -> Finding:
    """What the kept-set replay does to the ratio, on the doctor's episodes.

    Args:
        replayed: [B, T] the trainer's logprobs over the kept set (what training uses).
        unreplayed: [B, T] its logprobs over the whole vocabulary.
        sampler: [B, T] the sampler's processed logprobs (normalized over its kept set).
        loss_mask: [B, T], 1 at sampled tokens.
        truncation: the run's min-p, top-k and top-p.
    """
    mask = loss_mask.bool()
    mass = (unreplayed - replayed)[mask].double().exp().mean()
    without = (unreplayed - sampler)[mask].double().exp().mean()
    with_replay = (replayed - sampler)[mask].double().exp().mean()
    detail = (
        f"top_p {truncation.top_p:g}, top_k {truncation.top_k}, min_p {truncation.min_p:g}: "
        f"mean kept mass {mass:.4f}; the ratio π/μ averages {without:.4f} without the replay "
        f"and {with_replay:.4f} with it (the trainer replays the kept set)"
    )
    if abs(float(with_replay) - 1) > 0.01:
        return Finding(
            "truncated sampling", Verdict.WARN, detail,
            "the replayed ratio should average 1: check that the engine samples with the "
            "rollout section's top_p / top_k / min_p and the processed logprobs mode",
        )  # fmt: skip
    return Finding("truncated sampling", Verdict.PASS, detail)


def leftover_engine_finding(ended: Sequence[EngineProcess]) -> Finding:
    """Verdict on engine processes of exited runs (the doctor has just ended them)."""
    if not ended:
        return Finding("leftover engine processes", Verdict.PASS, "none")
    owners = sorted({p.owner_pid for p in ended})
    return Finding(
        "leftover engine processes", Verdict.WARN,
        f"ended {len(ended)} process(es) of exited run(s) (owner pids {owners}): "
        + ", ".join(f"{p.pid} {p.command[:40]}" for p in ended),
        "a run was killed (SIGKILL, OOM) and its watchdog too; nothing to do, they are gone",
    )  # fmt: skip


def run_doctor(config: RunConfig, *, num_episodes: int = 4) -> list[Finding]:
    """Run every check; starts the engine and trainer of `config` and plays a few episodes."""
    import json

    import torch

    from tir_rl.engine.parity import (
        DEFAULT_SAMPLED_PROBE_PROMPT,
        probe_ids_from_text,
        probe_parity,
    )
    from tir_rl.envs.agent_env import AgentEnv
    from tir_rl.envs.episode import ResetInfo
    from tir_rl.mismatch import mismatch_metrics
    from tir_rl.mismatch.injection import MismatchInjection
    from tir_rl.runtime import env_factory, open_runtime, task_specs
    from tir_rl.trainer import Trainer
    from tir_rl.trainer.batch import TrainBatch

    findings: list[Finding] = [leftover_engine_finding(reap_leftovers())]
    injection = MismatchInjection(config.inject)
    with open_runtime(config) as runtime:
        model_config = json.loads((runtime.model_path / "config.json").read_text())
        tied = model_config.get("tie_word_embeddings")
        findings += static_findings(config, tie_word_embeddings=tied)
        trainer = Trainer(config.trainer, truncation=_replayed(config))
        if injection.transforms_weights:  # the sampler gets what training would send it
            state = trainer.rank0_full_state_dict()  # merged weights under LoRA
            sent = injection.sampler_state(state, 0, force=True)
            asyncio.run(runtime.engine.update_weights(sent))
        factory = env_factory(config.env, config.env.eval_split)
        env = factory()
        schemas: Sequence[dict[str, Any]] = ()  # an AgentEnv's agent sends its own tools
        if not isinstance(env, AgentEnv):
            schemas = ResetInfo.from_info(env.reset(seed=0)[1]).tool_schemas
        env.close()
        chat_format = runtime.rollout.chat_format_for(schemas)
        findings.append(template_finding(chat_format))
        specs = task_specs(factory, num_tasks=num_episodes, group_size=1)
        trajectories = [t for t in runtime.run_episodes(specs) if t.num_model_tokens > 0]
        if not trajectories:
            findings.append(Finding(
                "rollouts", Verdict.FAIL, "no episode sampled any token",
                "run `tir-rl rollout --config ...` to see the episodes' errors",
            ))  # fmt: skip
            return findings
        findings += rendering_findings(trajectories, chat_format)
        batch = TrainBatch.from_trajectories(trajectories)
        trainer_logprobs = trainer.compute_logprobs(batch)
        metrics = mismatch_metrics(
            trainer_logprobs, batch.sampler_logprobs, batch.loss_mask, batch.turn_ids
        )
        findings.append(measured_finding(metrics, len(trajectories)))
        if config.rollout.truncation.active:
            with torch.no_grad():
                unreplayed = trainer.forward.score(batch, trainer.model, replay=False)
            findings.append(
                truncation_finding(
                    trainer_logprobs, unreplayed, batch.sampler_logprobs, batch.loss_mask,
                    config.rollout.truncation,
                )
            )  # fmt: skip
        probe = asyncio.run(
            probe_parity(
                runtime.engine,
                lambda ids: trainer.sequence_logprobs(ids).tolist(),
                probe_ids_from_text(runtime.tokenizer),
                tolerance=float("inf"),
            )
        )
        within = probe.max_abs_diff <= config.run.parity_tolerance
        verdict = Verdict.PASS if within else Verdict.WARN
        findings.append(Finding(
            "parity probe (prompt logprobs)", verdict,
            f"max |Δ| {probe.max_abs_diff:.2e} over {probe.num_tokens} tokens "
            f"(tolerance run.parity_tolerance={config.run.parity_tolerance:g})",
            "" if verdict is Verdict.PASS else "raise run.parity_tolerance for a low-precision "
            "sampler, or align dtypes; training stops when the probe fails after a sync",
        ))  # fmt: skip
        # The engine holds HF-named weights; under LoRA check against the merged plain model
        # (the trainer is not used after this).
        model = trainer.model.merge_and_unload() if trainer.lora_enabled else trainer.model
        findings += asyncio.run(
            engine_findings(
                runtime.engine,
                model,
                probe_ids=probe_ids_from_text(runtime.tokenizer),
                prompt_ids=probe_ids_from_text(runtime.tokenizer, DEFAULT_SAMPLED_PROBE_PROMPT),
                temperature=config.rollout.temperature,
                injection=injection,
                forward=trainer.forward,
            )
        )
    return findings


def run_localize(config: RunConfig) -> Localization:
    """`tir-rl doctor --localize`: where in the network the run's sampler leaves the trainer.

    The engine gets what training would send it (injected weights included). Under
    `inject.sync_every > 1` the trainer is compared after one step of perturbed weights
    whose sync the rule skips, as a stale engine would be.
    """
    from tir_rl.engine.engine_config import EngineKind
    from tir_rl.engine.parity import DEFAULT_SAMPLED_PROBE_PROMPT, probe_ids_from_text
    from tir_rl.engine.vllm_local import VLLMLocalEngine
    from tir_rl.errors import ConfigError
    from tir_rl.mismatch.injection import MismatchInjection
    from tir_rl.mismatch.localize import localize
    from tir_rl.runtime import open_runtime
    from tir_rl.trainer import Trainer

    if config.engine.kind is not EngineKind.LOCAL:
        raise ConfigError(
            "doctor --localize hooks the engine's modules inside its worker, which only a "
            "local engine lets tir-rl reach: run it with --set engine.kind=local (same model "
            "and engine settings) on a machine that can hold the model"
        )
    injection = MismatchInjection(config.inject)
    with open_runtime(config) as runtime:
        engine = cast(VLLMLocalEngine, runtime.engine.inner)  # engine.kind local
        trainer = Trainer(config.trainer, truncation=_replayed(config))
        model = trainer.model.merge_and_unload() if trainer.lora_enabled else trainer.model
        state = trainer.rank0_full_state_dict()
        if injection.transforms_weights:
            asyncio.run(engine.update_weights(injection.sampler_state(state, 0, force=True)))
        if not injection.syncs_after(1):
            model = stepped_copy(model)  # the trainer one step on; the engine kept step 0
        return asyncio.run(
            localize(
                engine,
                model,
                probe_ids_from_text(runtime.tokenizer),
                scorer=trainer.forward,
                prompt_ids=probe_ids_from_text(runtime.tokenizer, DEFAULT_SAMPLED_PROBE_PROMPT),
                temperature=config.rollout.temperature,
            )
        )


async def engine_findings(
    engine: Engine,
    model: Any,
    *,
    probe_ids: Sequence[int],
    prompt_ids: Sequence[int],
    temperature: float,
    injection: MismatchInjection,
    forward: TrainerForward,
) -> list[Finding]:
    """Measured checks of each mismatch cause against the running engine.

    Args:
        engine: the sampler, holding the weights the run would send it (injected ones
            included: call after `injection.sampler_state(state, 0, force=True)` was sent).
        model: the trainer's transformers causal LM (fp32 reference); never modified.
        probe_ids: the prompt-logprob parity probe (`probe_ids_from_text`).
        prompt_ids: a prompt the sampled probe continues.
        temperature: the run's sampling temperature.
        injection: the run's injection; the sync check sends weights through it, as training
            does (`sampler_state`), so an injected stale sync is exercised, not simulated.
        forward: the trainer's forward (`Trainer.forward`), which scores every probe here,
            `model` and its perturbed copies alike: what training would compute.

    Returns:
        One finding per cause: "sampled logprobs", "raw vs processed logprobs",
        "lm_head precision (measured)", "weight sync" and "inference path (prefix cache,
        batching)"; all pass on a faithful sampler.
        The engine holds the run's weights again afterwards.
    """
    from tir_rl.engine.parity import probe_inference_paths, probe_parity, probe_sampled

    def trainer_at(reference: Any) -> Any:
        return lambda ids, t: forward.sequence(reference, ids, temperature=t).tolist()

    sampled = await probe_sampled(engine, trainer_at(model), prompt_ids, temperature=temperature)
    out = [_sampled_finding(sampled.max_abs_diff, sampled.num_tokens, temperature)]
    out.append(_raw_logprobs_finding(sampled.max_abs_diff, sampled.max_abs_diff_raw, temperature))
    prompt_gap = (
        await probe_parity(engine, _scorer(forward, model), probe_ids, tolerance=float("inf"))
    ).max_abs_diff
    rounded = _with_rounded_output_projection(model)
    rounded_gap = (
        await probe_parity(engine, _scorer(forward, rounded), probe_ids, tolerance=float("inf"))
    ).max_abs_diff
    del rounded
    out.append(_lm_head_finding(prompt_gap, rounded_gap))
    out.append(await _weight_sync_finding(engine, model, probe_ids, injection, forward))
    half = len(probe_ids) // 2  # a rotation of the probe: a prompt the prefix cache never saw
    unseen = [*probe_ids[half:], *probe_ids[:half]]
    paths = await probe_inference_paths(engine, unseen, temperature=temperature)
    out.append(_inference_path_finding(paths, engine.model_info.enable_prefix_caching))
    return out


def _scorer(forward: TrainerForward, model: Any) -> Any:
    """`ids -> logprobs of ids[1:]` of `model` by the trainer's forward, at temperature 1."""
    return lambda ids: forward.sequence(model, ids).tolist()


def _inference_path_finding(paths: InferencePathReport, prefix_caching: bool | None) -> Finding:
    check = "inference path (prefix cache, batching)"
    if paths.max_abs_diff_cached is None:
        cache = "the prefix cache's path not measured (a server cannot skip it per request)"
    elif prefix_caching is False:
        cache = "prefix caching off"
    elif paths.num_cached_prompt_tokens == 0:
        cache = (
            f"prefix caching on, but none of the {paths.num_context_tokens} context tokens "
            "came from the cache (shorter than a KV block: engine.local.block_size)"
        )
    else:
        of = paths.num_cached_prompt_tokens
        cached_part = "" if of is None else f"{of} of {paths.num_context_tokens} tokens cached, "
        cache = (
            f"a second turn from the prefix cache ({cached_part}the first turn's prefill and "
            f"decode) against a full prefill: max |Δ| {paths.max_abs_diff_cached:.2e}"
        )
    detail = (
        f"{cache}; alone against beside {paths.num_neighbours} other requests: max |Δ| "
        f"{paths.max_abs_diff_batched:.2e}; over {paths.num_tokens} tokens"
    )
    from_cache = paths.max_abs_diff_cached or 0.0
    worst = max(from_cache, paths.max_abs_diff_batched)
    if worst <= PROBE_EXACT and not paths.tokens_diverged:
        return Finding(check, Verdict.PASS, detail)
    causes = []
    if from_cache > PROBE_EXACT:
        causes.append(
            "a prefix-cache hit changes the logprobs: engine.local.enable_prefix_caching=false"
        )
    if paths.max_abs_diff_batched > PROBE_EXACT:
        causes.append(
            "the batch a request runs in changes its logprobs (batch-variant kernels, async "
            "scheduling): keep a per-token correction on (correction_preset=token_tis or "
            "geo_rs_token_tis), or use batch-invariant kernels"
        )
    if paths.tokens_diverged and not causes:
        detail += "; the same seed drew other tokens"
        causes.append("the engine's seeded sampling depends on the path; logprobs agree")
    return Finding(
        check, Verdict.WARN if worst <= MAX_ABS_DIFF_FAIL else Verdict.FAIL, detail,
        "; ".join(causes),
    )  # fmt: skip


def _sampled_finding(gap: float, num_tokens: int, temperature: float) -> Finding:
    detail = f"max |Δ| {gap:.2e} over {num_tokens} tokens sampled at temperature {temperature:g}"
    if gap <= PROBE_EXACT:
        return Finding("sampled logprobs", Verdict.PASS, detail)
    return Finding(
        "sampled logprobs", Verdict.WARN if gap <= MAX_ABS_DIFF_FAIL else Verdict.FAIL, detail,
        "the sampler's logprobs of its own tokens are not the trainer's: see the causes below",
    )  # fmt: skip


def _raw_logprobs_finding(gap: float, gap_raw: float, temperature: float) -> Finding:
    check = "raw vs processed logprobs"
    if temperature == 1.0:
        return Finding(check, Verdict.PASS, "temperature 1: raw and processed logprobs coincide")
    if gap > PROBE_EXACT and gap_raw <= ATTRIBUTION_RATIO * gap:
        return Finding(
            check, Verdict.FAIL,
            f"sampled logprobs match the trainer at temperature 1 (max |Δ| {gap_raw:.2e}) "
            f"instead of at {temperature:g} ({gap:.2e}): the engine reports raw logprobs",
            "--set engine.logprobs_mode=processed_logprobs (and inject.raw_logprobs=false)",
        )  # fmt: skip
    return Finding(
        check, Verdict.PASS,
        f"sampled logprobs follow temperature {temperature:g} (max |Δ| {gap:.2e}; "
        f"{gap_raw:.2e} against temperature 1)",
    )  # fmt: skip


def _lm_head_finding(gap: float, rounded_gap: float) -> Finding:
    check = "lm_head precision (measured)"
    if gap > PROBE_EXACT and rounded_gap <= ATTRIBUTION_RATIO * gap:
        return Finding(
            check, Verdict.WARN,
            f"the engine matches a trainer whose output projection is rounded to bfloat16 "
            f"(max |Δ| {rounded_gap:.2e}) far better than the fp32 trainer ({gap:.2e}): "
            "the sampler's lm_head is bf16",
            "keep the sampler's lm_head (and tied embeddings) in float32: "
            "inject.lm_head_dtype=null, engine.dtype=float32; or a correction "
            "(correction_preset=geo_rs_token_tis)",
        )  # fmt: skip
    return Finding(
        check, Verdict.PASS,
        f"prompt-logprob gap {gap:.2e}; a bf16 output projection would give {rounded_gap:.2e}",
    )  # fmt: skip


def _with_rounded_output_projection(model: Any) -> Any:
    """A copy of `model` whose output projection went through bfloat16.

    In a tied model the input embedding is the same tensor and is rounded too, as
    `inject.lm_head_dtype=bfloat16` or a sampler storing the shared matrix in bf16 gives.
    """
    import copy

    import torch

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        head = rounded.get_output_embeddings().weight
        head.copy_(head.to(torch.bfloat16).to(head.dtype))
    return rounded.eval()


async def _weight_sync_finding(
    engine: Engine,
    model: Any,
    probe_ids: Sequence[int],
    injection: MismatchInjection,
    forward: TrainerForward,
) -> Finding:
    """Sync perturbed trainer weights through the run's sync rule; the engine must follow."""
    from tir_rl.engine.parity import probe_parity

    check = "weight sync"
    perturbed = stepped_copy(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    new_state = {k: v.detach() for k, v in perturbed.state_dict().items()}
    sent = injection.sampler_state(new_state, 1)  # the sync after the first optimizer step
    try:
        if sent is not None:
            await engine.update_weights(sent)
        new, old = _scorer(forward, perturbed), _scorer(forward, model)
        to_new = await probe_parity(engine, new, probe_ids, tolerance=float("inf"))
        to_old = await probe_parity(engine, old, probe_ids, tolerance=float("inf"))
    finally:
        await engine.update_weights(injection.sampler_state(state, 0, force=True))
    detail = (
        f"after a sync of perturbed weights the engine is at max |Δ| {to_new.max_abs_diff:.2e} "
        f"from them and {to_old.max_abs_diff:.2e} from the previous weights"
    )
    if to_new.max_abs_diff < to_old.max_abs_diff:
        return Finding(check, Verdict.PASS, detail)
    skipped = (
        " (the run's sync rule skipped this sync: inject.sync_every > 1)" if sent is None else ""
    )
    return Finding(
        check, Verdict.FAIL, f"stale sampler: {detail}{skipped}",
        "sync after every optimizer step (inject.sync_every=1); check that update_weights "
        "reaches the engine and that its prefix cache is reset after a sync",
    )  # fmt: skip


def stepped_copy(model: Any) -> Any:
    """A copy of the trainer as after an optimizer step (seeded).

    Every matrix moves by `SYNC_PERTURBATION` x its std x N(0, 1); the norms' gains stay.
    """
    import copy

    import torch

    perturbed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in perturbed.parameters():
            if param.dim() == 2:
                noise = torch.randn(param.shape, generator=gen).to(param.device, param.dtype)
                param.add_(SYNC_PERTURBATION * param.std() * noise)
    return perturbed.eval()


def format_findings(findings: Sequence[Finding]) -> str:
    """The doctor's table: one line per check, then the fixes of non-passing checks."""
    width = max(len(f.check) for f in findings)
    lines = [f"{'check'.ljust(width)}  verdict  detail", "-" * (width + 60)]
    lines += [f"{f.check.ljust(width)}  {f.verdict.value.upper():7}  {f.detail}" for f in findings]
    fixes = [f for f in findings if f.verdict is not Verdict.PASS and f.fix]
    if fixes:
        lines += ["", "fixes:"] + [f"  {f.check}: {f.fix}" for f in fixes]
    return "\n".join(lines)


def _retokenization_drifts(trajectory: Trajectory, chat_format: Any) -> bool:
    turns: dict[int, list[int]] = {}
    for tok, mask, turn in zip(
        trajectory.completion_ids, trajectory.loss_mask, trajectory.turn_ids, strict=True
    ):
        if mask:
            turns.setdefault(turn, []).append(tok)
    stops = set(chat_format.stop_token_ids)
    for ids in turns.values():
        body = [t for t in ids if t not in stops]
        if chat_format.encode_assistant_text(chat_format.decode(body)) != body:
            return True
    return False
