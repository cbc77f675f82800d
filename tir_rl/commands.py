"""What each `tir-rl` subcommand does: one `cmd_*` function per command (`tir_rl.cli` parses).

Heavy imports happen inside each function, so `tir-rl --help` is instant and nothing runs
at import time. A command returns its exit status; a `TirError` it raises is printed by
`tir_rl.cli.main`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tir_rl.errors import ConfigError, TirError

if TYPE_CHECKING:
    from tir_rl.process.torchrun import Nodes

logger = logging.getLogger("tir_rl")


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


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    """This node's place in a multi-node job, or None for a job on this machine alone."""
    from tir_rl.process.torchrun import Nodes

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


def cmd_train(args: argparse.Namespace) -> int:
    """`tir-rl train`: GRPO on a run config (under torchrun with `--nproc-per-node`)."""
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
    nodes = nodes_of(args)
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


def cmd_eval(args: argparse.Namespace) -> int:
    """`tir-rl eval`: held-out pass@k of a model on an environment."""
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


def cmd_launch(args: argparse.Namespace) -> int:
    """`tir-rl launch`: start a pool of `vllm serve` servers and the trainer that drives them."""
    import yaml

    from tir_rl.config import load
    from tir_rl.distributed import free_port
    from tir_rl.engine.weights.files import default_weights_dir
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


def cmd_serve(args: argparse.Namespace) -> int:
    """`tir-rl serve`: the OpenAI-compatible endpoint that records each episode in tokens."""
    import signal
    import threading

    from tir_rl.config import load
    from tir_rl.endpoint import EndpointServer
    from tir_rl.process.run_secret import RunSecret
    from tir_rl.run_config import RunConfig
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


def cmd_sft(args: argparse.Namespace) -> int:
    """`tir-rl sft`: fine-tune a model on an environment's oracle episodes."""
    from tir_rl.lab.sft import run_sft
    from tir_rl.lab.sft_config import load_sft_config

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


def cmd_doctor(args: argparse.Namespace) -> int:
    """`tir-rl doctor`: the parity audit of a config's sampler and trainer."""
    from tir_rl.config import load
    from tir_rl.doctor import Verdict, format_findings, run_doctor
    from tir_rl.run_config import RunConfig

    config = load(RunConfig, args.config, args.set)
    _route_library_output(args, _command_log("doctor"))
    if args.localize:
        from tir_rl.doctor import run_localize

        print(run_localize(config).table())
        return 0
    findings = run_doctor(config, num_episodes=args.episodes)
    print(format_findings(findings))
    return 1 if any(f.verdict is Verdict.FAIL for f in findings) else 0


def cmd_models(args: argparse.Namespace) -> int:
    """`tir-rl models`: prepare the bundled, tiny and lab checkpoints."""
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


def cmd_sandbox(args: argparse.Namespace) -> int:
    """`tir-rl sandbox`: build, check or clean the Docker sandbox."""
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


def cmd_rollout(args: argparse.Namespace) -> int:
    """`tir-rl rollout`: play episodes and print them, without training."""
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


def cmd_view(args: argparse.Namespace) -> int:
    """`tir-rl view`: the HTML trajectory viewer of a run."""
    from transformers import AutoTokenizer

    from tir_rl.config import load
    from tir_rl.models import resolve_model
    from tir_rl.report.run_log import TRAJECTORIES_FILE
    from tir_rl.report.viewer import render_saved
    from tir_rl.run_config import RunConfig

    source = Path(args.source)
    run_dir = source if source.is_dir() else source.parent
    jsonl = source / TRAJECTORIES_FILE if source.is_dir() else source
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
