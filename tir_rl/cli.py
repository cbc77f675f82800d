"""The `tir-rl` command line: train | eval | sft | rollout | serve | doctor | sandbox | models.

`build_parser` describes the commands; each runs one `cmd_*` function of
`tir_rl.commands`, whose heavy imports happen inside it, so `--help` is instant and nothing
runs at import time.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tir_rl import commands
from tir_rl.errors import TirError
from tir_rl.process import termination

if TYPE_CHECKING:
    pass

logger = logging.getLogger("tir_rl")

_EPILOG_MODELS = """examples:
  tir-rl models prepare            # bundled SmolLM2-135M-Instruct -> local HF checkpoint (once)
  tir-rl models prepare tiny       # tiny random model with the same tokenizer, for tests
  tir-rl models prepare lab        # the lab model: MultiHop's policy written into a small Llama
  tir-rl models prepare lab --logit-scale 0.45   # a more confident one (horizon 8 in 0.2-0.8)
  tir-rl models prepare lab-sft    # the trained lab model shipped with tir-rl: prints its folder
  tir-rl models path               # print where the bundled checkpoint lives
"""


_EPILOG_TRAIN = """examples:
  tir-rl train --config configs/quickstart.yaml
  tir-rl train --config configs/quickstart.yaml --set run.steps=20 --set trainer.lr=2e-6
  tir-rl train --resume runs/quickstart            # continue from the newest checkpoint
  tir-rl train --nproc-per-node 2 --config configs/fsdp2_cpu.yaml   # FSDP2, 2 processes
  tir-rl train --nnodes 2 --node-rank R --master-addr NODE0 --master-port 29500 \\
      --nproc-per-node 8 --config my.yaml                          # on each of 2 nodes
outputs (runs/NAME/): config.yaml, metrics.jsonl, tensorboard/, trajectories.jsonl,
  plots/*.png, eval_step_N.json, checkpoints/step_N/ (HF model + optimizer + RNG + step);
  with run.loggers naming wandb also wandb/ and wandb_run_id (the W&B run --resume continues)
"""

_EPILOG_EVAL = """examples:
  tir-rl eval --checkpoint bundled --env tir_rl/MathPython-v0 --split test --k 1
  tir-rl eval --checkpoint runs/quickstart --k 4 --samples 8 --tasks 64
  tir-rl eval --config configs/lab.yaml    # the config's model, env.eval_split, run.eval_tasks
a flag left out keeps the config's value; a flag and a --set of the same key are refused
"""


_EPILOG_SANDBOX = """examples:
  tir-rl sandbox build                   # local image from this machine's files (no registry)
  tir-rl sandbox check                   # hostile-input suite against the configured backend
  tir-rl sandbox check --backend bwrap   # ... against bubblewrap
  tir-rl sandbox check --case fork_bomb --set docker.pids_limit=32
  tir-rl sandbox clean                   # remove sandboxes left by crashed runs
  tir-rl sandbox clean --all             # remove every tir-rl sandbox (also of running jobs)
"""


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="tir-rl",
        description="Reinforcement learning of LLM agents that use tools over many turns.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, and vLLM's and other libraries' logs on the terminal "
        "(by default they go to a log file: the run folder's libraries.log)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="run GRPO training from a YAML config",
        epilog=_EPILOG_TRAIN,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML run config, e.g. configs/quickstart.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="train with N FSDP2 processes (re-runs itself under torchrun)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="train across N nodes, each started with the same arguments and its --node-rank",
    )
    p.add_argument("--node-rank", type=int, help="this node's index (0: the node that samples)")
    p.add_argument("--master-addr", help="node 0's address, as every node reaches it")
    p.add_argument("--master-port", type=int, help="a free port on node 0 for the rendezvous")
    p.set_defaults(func=commands.cmd_train)

    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on held-out tasks (pass@k)",
        epilog=_EPILOG_EVAL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        help="bundled, tiny, lab, a run or checkpoint folder (default: the config's model)",
    )
    p.add_argument(
        "--env",
        help="gymnasium id or module:Name-v0, e.g. tir_rl/MathPython-v0 (default: config's)",
    )
    p.add_argument("--split", help="task split (default: the config's env.eval_split)")
    p.add_argument("--k", type=int, default=1, help="pass@k")
    p.add_argument("--samples", type=int, help="samples per task (default: k)")
    p.add_argument(
        "--tasks", type=int, help="number of held-out tasks (default: the config's run.eval_tasks)"
    )
    p.add_argument("--config", help="YAML config for engine/rollout/sandbox settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--out", help="JSON report path (default: eval_report.json beside the model)")
    p.set_defaults(func=commands.cmd_eval)

    p = sub.add_parser(
        "sft",
        help="SFT warm start on an environment's oracle episodes (HF checkpoint out)",
        epilog="examples:\n  tir-rl sft --config configs/sft/multihop.yaml\n"
        "  tir-rl sft --config configs/sft/multihop.yaml --set data.num_demos=64 "
        "--set output_dir=runs/sft/small\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML SFT config, e.g. configs/sft/multihop.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an output_dir that holds a checkpoint of another config",
    )
    p.set_defaults(func=commands.cmd_sft)

    p = sub.add_parser(
        "rollout",
        help="run episodes and print/save trajectories, no training",
        epilog="""examples:
  tir-rl rollout --config configs/rollout_multihop.yaml --num 4
  tir-rl rollout --config configs/rollout_multihop.yaml --num 8 --group-size 4 \\
      --set rollout.max_turns=4 --set env.kwargs.horizon=2 --out rollouts.jsonl
  tir-rl rollout --config configs/quickstart.yaml --num 2      # any train config works
""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML run config (model, env, engine, rollout)")
    p.add_argument("--num", type=int, default=4, help="number of episodes")
    p.add_argument("--group-size", type=int, default=1, help="samples per task (same seed)")
    p.add_argument("--split", default="train", help="task pool: train or test")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--out", metavar="FILE.jsonl", help="also save the trajectories as JSONL")
    p.add_argument("--max-chars", type=int, default=300, help="cut texts to this (0: full)")
    p.add_argument("--html", metavar="FILE", help="also write the episodes as an HTML page")
    p.set_defaults(func=commands.cmd_rollout)

    p = sub.add_parser(
        "view",
        help="render a run's saved trajectories as HTML (tokens coloured by mismatch)",
        epilog="examples:\n  tir-rl view runs/quickstart            # -> runs/quickstart/"
        "trajectories.html\n  tir-rl view episodes.jsonl --model bundled --html out.html\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help="a run folder or a trajectories JSONL file")
    p.add_argument("--html", metavar="FILE", help="output page (default: beside the source)")
    p.add_argument("--model", help="model whose tokenizer decodes the ids (default: the run's)")
    p.set_defaults(func=commands.cmd_view)

    p = sub.add_parser(
        "launch",
        help="start a pool of vllm serve servers and train on it (or print a Slurm script)",
        epilog="examples:\n  tir-rl launch --config configs/quickstart.yaml --servers 2\n"
        "  tir-rl launch --config configs/quickstart.yaml --servers 4 --emit slurm \\\n"
        "      --weights-dir /shared/tir-rl-weights > job.sbatch\n"
        "see docs/scale.md\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML run config (its engine section: local)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--servers", type=int, default=2, help="vllm serve servers in the pool")
    p.add_argument(
        "--base-port", type=int, default=8000, help="first server's port (0: free ones here)"
    )
    p.add_argument(
        "--weights-dir",
        help="folder the weights are published to (default here: a fresh one in /dev/shm; "
        "Slurm: required, on a file system every node mounts)",
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=1, help="trainer ranks (FSDP2 under torchrun)"
    )
    p.add_argument(
        "--emit",
        choices=["slurm"],
        help="print the multi-node launch instead of starting anything",
    )
    p.add_argument(
        "--gpus-per-node", type=int, default=1, help="Slurm: GPUs per node (0: a CPU cluster)"
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="Slurm: the nodes' Python with tir-rl installed (default: this one, which suits "
        "an environment on a file system the nodes mount)",
    )
    p.add_argument(
        "--trainer-nodes",
        type=int,
        default=1,
        help="Slurm: nodes the trainer spans (FSDP2 across nodes, --nproc-per-node ranks each)",
    )
    p.set_defaults(func=commands.cmd_launch)

    p = sub.add_parser(
        "serve",
        help="serve the config's model as an OpenAI-compatible endpoint that records tokens",
        epilog="examples:\n  tir-rl serve --config configs/quickstart.yaml --port 8000\n"
        "  then: OpenAI(base_url='http://127.0.0.1:8000/episodes/ep1/v1',\n"
        "               api_key=open('runs/<name>/serve.secret').read().strip())\n"
        "see docs/bring_your_agent.md\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML run config (model, engine, chat, rollout)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    p.add_argument(
        "--secret-file",
        help="where to write the API key every caller must send, mode 600 (default: "
        "<run dir>/serve.secret; a new key each start)",
    )
    p.set_defaults(func=commands.cmd_serve)

    p = sub.add_parser(
        "doctor",
        help="pre-flight sampler/trainer parity audit",
        epilog="examples:\n  tir-rl doctor --config configs/quickstart.yaml\n"
        "  tir-rl doctor --config configs/quickstart.yaml --set engine.dtype=bfloat16\n"
        "  tir-rl doctor --config configs/quickstart.yaml --localize\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--episodes", type=int, default=4, help="rollouts to measure mismatch on")
    p.add_argument(
        "--localize",
        action="store_true",
        help="instead of the audit, compare the engine's and the trainer's forward stage by "
        "stage (embedding, each layer's attention and MLP, logits, logprobs) and name where "
        "they first diverge (a local engine only)",
    )
    p.set_defaults(func=commands.cmd_doctor)

    p = sub.add_parser(
        "sandbox",
        help="build, check or clean the code sandbox",
        epilog=_EPILOG_SANDBOX,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["build", "check", "clean"])
    p.add_argument("--force", action="store_true", help="build: rebuild even if up to date")
    p.add_argument(
        "--packages",
        nargs="*",
        metavar="PKG",
        help="build: extra Python packages in the image (default: numpy sympy)",
    )
    p.add_argument("--config", help="check: YAML run config whose `sandbox:` section to use")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="check: override within the sandbox section, e.g. backend=bwrap",
    )
    p.add_argument(
        "--backend",
        choices=["docker", "bwrap", "unsafe-local"],
        help="check: backend to test (shortcut for --set backend=...)",
    )
    p.add_argument("--slow", action="store_true", help="check: include slow cases (64 episodes)")
    p.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="NAME",
        help="check: run only this case (repeatable)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="clean: remove every tir-rl sandbox, not only those of dead runs",
    )
    p.set_defaults(func=commands.cmd_sandbox)

    p = sub.add_parser(
        "models",
        help="prepare the bundled model (no hub downloads)",
        epilog=_EPILOG_MODELS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["prepare", "path"])
    p.add_argument("name", nargs="?", help="'bundled' (default), 'tiny', 'lab' or 'lab-sft'")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    p.add_argument("--seed", type=int, help="lab model: seed of its token codes (default 0)")
    p.add_argument(
        "--logit-scale",
        type=float,
        help="lab model: final norm weight, i.e. its confidence (default 0.43; docs/lab_model.md)",
    )
    p.set_defaults(func=commands.cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tir-rl` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    termination.exit_on_sigterm()
    try:
        return args.func(args)
    except TirError as exc:
        print(f"tir-rl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tir-rl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
