"""Soak of the asynchronous pool: agent and native episodes, k = 2, two servers, faults.

Real parts: two `vllm serve` servers of the tiny model (`tir-rl launch`'s, each asking for
the run's secret), the trainer as `tir-rl train` on them (`engine.kind: http`, file
transfer, `run.max_staleness: 2`), and, in the same run and the same steps
(`bench/soak_env.py`, `SoakMixed-v0`), agent episodes played by a separate process each
(`CommandAgentEnv` running `bench/soak_agent.py`) through the run's chat endpoint next to
native episodes stepped by tir-rl's own loop, whose tool answers every turn.

Faults, in this order:

=====================  ===================================================================
fault                  how
=====================  ===================================================================
server hung            after step 2, server 1's API process is SIGSTOPped until the
                       trainer's log says the pool left it (then SIGCONT)
trainer killed         after step 4, the trainer's process group is SIGKILLed the moment a
during a transfer      new version's folder appears (published; the servers are being told
                       to load it); the run is then resumed with `tir-rl train --resume`
                       on the same servers
server killed          after step 6 (of the resumed run), server 1's process group is
mid-update             SIGKILLed the moment a new version's folder appears
agent faults           by task (`bench/soak_agent.py`): malformed JSON, a 20 MB body, an
                       unknown episode id, a finished one, 32 concurrent calls, an agent
                       that hangs past `rollout.agent_timeout_s`
a tool that hangs      by task (`bench/soak_env.py`): a native episode's tool never
                       returns; `rollout.tool_call_timeout_s` must end the episode
=====================  ===================================================================

Counted after everything stopped: steps trained, episodes by status, episodes lost (a step
that took fewer than tasks_per_step x group_size episodes), processes left (agents,
servers, trainers, engine cores: anything whose command line names this soak's folder or
script), sandbox containers left. Usage::

    nice -n 19 .venv/bin/python bench/soak_pool.py --seed 11 \\
        --record bench/soak_records/pool_seed11.txt
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import yaml
from soak_agent import FAULTS  # bench/ is this script's folder, first on sys.path
from soak_env import TOOL_FAULTS

HERE = Path(__file__).resolve().parent
AGENT = HERE / "soak_agent.py"

STEPS = 8
TASKS_PER_STEP = 4
GROUP_SIZE = 2
PHASE_TIMEOUT_S = 900.0


def soak_config(root: Path, seed: int) -> dict:
    return {
        "model": "tiny",
        "run": {
            "seed": seed,
            "name": "soak",
            "out_dir": str(root / "runs"),
            "steps": STEPS,
            "tasks_per_step": TASKS_PER_STEP,
            "group_size": GROUP_SIZE,
            "eval_tasks": 1,
            "checkpoint_every": 1,
            "max_staleness": 2,
            "save_trajectories": 1000,  # every sample of every step: the episodes' record
        },
        "env": {
            "id": "soak_env:SoakMixed-v0",  # imported from bench/ (PYTHONPATH)
            "kwargs": {"command": [sys.executable, str(AGENT), "{base_url}", "{index}"]},
        },
        "engine": {"max_model_len": 2048, "kv_cache_gib": 0.25},
        "rollout": {
            "max_turns": 2,
            "max_tokens_per_turn": 16,
            "agent_timeout_s": 20,
            "tool_call_timeout_s": 5,
            # The tiny model fills its turns: a cut-off turn still goes to the native
            # episode's tool (otherwise the episode would end before any tool call).
            "end_on_truncated_turn": False,
        },
        "trainer": {"lr": 1e-3},
        "correction_preset": "token_tis",
    }


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return out


def trained_steps(run_dir: Path) -> list[int]:
    return sorted({r["step"] for r in rows(run_dir) if "train/loss" in r})


def wait_for(what: str, check, trainer: subprocess.Popen, timeout_s: float = PHASE_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if trainer.poll() is not None:
            raise RuntimeError(f"the trainer exited ({trainer.returncode}) waiting for {what}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def published(weights_dir: Path) -> int:
    """The newest published version's number (its folder appears once written, before the
    servers are told to load it)."""
    numbers = [int(p.name.rpartition("-")[2]) for p in weights_dir.glob("weights-[0-9]*")]
    return max(numbers, default=0)


def start_trainer(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    out = log.open("a")
    return subprocess.Popen(
        command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def leftovers(root: Path) -> list[str]:
    left = []
    for p in psutil.process_iter():
        try:
            line = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if p.pid != os.getpid() and (str(root) in line or str(AGENT) in line):
            left.append(f"{p.pid} {line[:120]}")
    return left


def recorded_episodes(path: Path) -> dict[tuple[int, int, int], dict]:
    """(step, group, episode) -> its kind, status, error and fault, from the saved samples.

    An agent episode's fault is the one `soak_agent.py` gives the task whose index the agent
    wrote into its first message; an agent episode without any call (an agent that hung
    first) has none. A native episode's prompt names its task and tool fault.
    """
    out: dict[tuple[int, int, int], dict] = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        key = (sample["step"], sample["group_id"], sample["episode_id"])
        if key in out:
            continue
        text = " ".join(str(m.get("content", "")) for m in sample.get("messages", ()))
        native = re.search(r"native task (\d+)", text)
        found = re.search(r"task (\d+), turn", text)
        if native:
            fault = "native: tool " + TOOL_FAULTS[int(native.group(1)) % len(TOOL_FAULTS)]
        elif found:
            fault = "agent: " + FAULTS[int(found.group(1)) % len(FAULTS)]
        elif "flood" in text:  # the flood's calls carry no task line
            fault = "agent: flood"
        else:
            fault = "agent: (no call recorded)"
        out[key] = {
            "step": sample["step"], "status": sample["status"],
            "error": sample.get("error") or "", "fault": fault,
        }  # fmt: skip
    return out


def sandbox_containers() -> int:
    done = subprocess.run(
        ["docker", "ps", "-aq", "--filter", "label=tir-rl.sandbox"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return len(done.stdout.split())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--record", type=Path, help="also write the report here")
    args = parser.parse_args()

    from tir_rl.config import load
    from tir_rl.distributed import free_port
    from tir_rl.launch import plan_local_launch, running_servers
    from tir_rl.run_config import RunConfig

    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="tir-rl-soak-pool-"))
    config_file = root / "soak.yaml"
    config_file.write_text(yaml.safe_dump(soak_config(root, args.seed)))
    config = load(RunConfig, config_file, [])
    plan = plan_local_launch(
        config, servers=2, ports=[free_port(), free_port()], weights_dir=root / "weights"
    )
    # Quicker to call a server hung than the default (30 s + 2 x 10 s): the soak is short.
    command = [*plan.train_command, "--set", "engine.http.hang_check_s=10",
               "--set", "engine.http.health_timeout_s=5"]  # fmt: skip
    run_dir = config.run_dir
    agent_log = root / "agents.jsonl"
    trainer_log = root / "trainer.log"
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "SOAK_AGENT_LOG": str(agent_log), "PYTHONPATH": path}
    events: list[str] = []
    containers_before = sandbox_containers()

    def note(text: str) -> None:
        events.append(f"{time.monotonic() - started:7.1f} s  {text}")
        print(events[-1], flush=True)

    exit_codes = []
    with running_servers(plan.servers, plan.secret_file) as servers:
        note(f"2 servers up: {[s.url for s in plan.servers]}")
        trainer = start_trainer(command, trainer_log, env)

        # 1. server 1 hung (SIGSTOP on its API process) until the pool leaves it
        wait_for("step 2", lambda: len(trained_steps(run_dir)) >= 2, trainer)
        hung = psutil.Process(servers[1].pid)
        hung.suspend()
        note("server 1 SIGSTOPped (hung)")
        wait_for(
            "the pool to leave the hung server",
            lambda: "is hung" in trainer_log.read_text(),
            trainer,
        )
        note("the trainer's pool left server 1")
        hung.resume()
        note("server 1 SIGCONTed")

        # 2. the trainer SIGKILLed as a weight reload reaches server 0, then resumed
        wait_for("step 4", lambda: len(trained_steps(run_dir)) >= 4, trainer)
        before = published(plan.weights_dir)
        wait_for("a new version", lambda: published(plan.weights_dir) > before, trainer)
        os.killpg(trainer.pid, signal.SIGKILL)
        exit_codes.append(trainer.wait())
        note(f"trainer SIGKILLed as the servers load a new version; steps {trained_steps(run_dir)}")
        resume = [sys.executable, "-m", "tir_rl.cli", "train", "--resume", str(run_dir)]
        trainer = start_trainer(resume, trainer_log, env)
        note("trainer resumed")

        # 3. server 1 SIGKILLed as a weight reload reaches it
        wait_for("step 6", lambda: len(trained_steps(run_dir)) >= 6, trainer)
        before = published(plan.weights_dir)
        wait_for("a new version", lambda: published(plan.weights_dir) > before, trainer)
        os.killpg(servers[1].pid, signal.SIGKILL)
        note("server 1 SIGKILLed as the servers load a new version")

        exit_codes.append(trainer.wait(timeout=PHASE_TIMEOUT_S))
        note(f"trainer exited {exit_codes[-1]}")
    time.sleep(5)
    left = leftovers(root)
    containers_left = sandbox_containers() - containers_before

    steps = trained_steps(run_dir)
    episodes = recorded_episodes(run_dir / "trajectories.jsonl")
    step_rows = {r["step"]: r for r in rows(run_dir) if "train/loss" in r}
    per_step = {s: int(r.get("rollout/episodes", 0)) for s, r in sorted(step_rows.items())}
    expected = TASKS_PER_STEP * GROUP_SIZE
    lost = sum(max(0, expected - per_step.get(s, 0)) for s in range(1, STEPS + 1))
    statuses: Counter = Counter()
    for s, r in step_rows.items():
        for key, share in r.items():
            if key.startswith("rollout/status/"):
                statuses[key.removeprefix("rollout/status/")] += round(share * per_step[s])
    agents = [json.loads(line) for line in agent_log.read_text().splitlines()]
    faults = Counter(a["fault"] for a in agents)
    answers: dict[str, Counter] = {}
    for a in agents:
        answers.setdefault(a["fault"], Counter())[json.dumps(a.get("status"))] += 1
    by_fault: dict[str, Counter] = {}
    for e in episodes.values():
        by_fault.setdefault(e["fault"], Counter())[e["status"]] += 1
    errors = sorted({(e["fault"], e["error"][:150]) for e in episodes.values() if e["error"]})
    trainer_text = trainer_log.read_text(errors="replace")

    lines = [
        f"# soak_pool: seed {args.seed}, {time.monotonic() - started:.0f} s wall",
        f"command: nice -n 19 .venv/bin/python bench/soak_pool.py --seed {args.seed}",
        "",
        "## events",
        *events,
        "",
        "## outcome",
        f"steps trained: {steps} (of {STEPS}); trainer exit codes: {exit_codes}",
        f"episodes the steps took (rollout/episodes): {sum(per_step.values())}; per step: "
        f"{per_step} (each step takes {expected})",
        f"by status: {dict(sorted(statuses.items()))}",
        f"episodes lost (a step with fewer than {expected}): {lost}",
        f"episodes trained on (their samples in trajectories.jsonl): {len(episodes)}",
        f"processes left: {len(left)} {left}",
        f"sandbox containers left: {containers_left}",
        f"pool warnings in the trainer's log: {trainer_text.count('leaves the pool')}",
        "",
        "## agent faults (agent processes started with a fault; what the endpoint answered)",
        *(
            f"{fault}: {n} agents; statuses {dict(answers[fault])}"
            for fault, n in sorted(faults.items())
        ),
        "",
        "## the trained episodes of each fault, by status (an agent that hung never called;",
        "## its episode sampled nothing and counts in the statuses above only)",
        *(f"{f}: {dict(sorted(c.items()))}" for f, c in sorted(by_fault.items())),
        "",
        "## their errors",
        *(f"{f}: {text}" for f, text in errors),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(report)
    ok = steps == list(range(1, STEPS + 1)) and lost == 0 and not left and containers_left <= 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
