"""`tir-rl launch --emit slurm` submitted to a real Slurm (tiny model, CPU).

The cluster is Debian's Slurm on this machine (`scripts/slurm_local_cluster.sh`): a
controller and two node daemons, each node a network namespace with its own address and
host name. Node 0 trains, node 1 runs `vllm serve`; the trainer reaches the server over the
bridge between them, as it would reach another machine. docs/scale.md, "The Slurm run".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tir_rl.report.run_log import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.model,
    pytest.mark.skipif(os.geteuid() != 0, reason="a Slurm cluster's daemons need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2 for the nodes"),
    pytest.mark.xdist_group("slurm"),
]

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts" / "slurm_local_cluster.sh"
NODE_NAMESPACES = ("tirrl-node0", "tirrl-node1", "tirrl-node2")
JOB_TIMEOUT_S = 900
# The job's environment, a module in the folder it is submitted from (an env id `module:Class`
# resolves from the current folder). A random tiny model never solves a real task, so every
# group would be degenerate and no update, nor weight push, would happen.
FAKE_ENV = """
from tir_rl.envs.multihop import MultiHopEnv


class FakeParityReward(MultiHopEnv):
    def step(self, action):
        return [], (sum(map(ord, action.content)) % 97) / 97, True, False, {}
"""


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")
    up = subprocess.run(
        ["bash", str(CLUSTER), "up", str(folder), str(len(NODE_NAMESPACES))],
        capture_output=True,
        text=True,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    yield env
    subprocess.run(["bash", str(CLUSTER), "down", str(folder)], check=False)


def emit_job(run_root: Path, env: dict[str, str], steps: int, trainer_nodes: int = 1) -> Path:
    """The documented command, through the installed console script, on the quickstart."""
    tir_rl = Path(sys.executable).parent / "tir-rl"
    sets = [
        "model=tiny",
        "env.id=slurm_fake_env:FakeParityReward",
        "env.kwargs={}",  # the quickstart's options are MathPython's
        "env.kwargs={horizon: 2}",
        f"run.out_dir={run_root / 'runs'}",
        f"run.steps={steps}",
        "run.tasks_per_step=2",
        "run.group_size=2",
        "run.eval_tasks=2",
        "run.checkpoint_every=1",
        "run.plot_every=0",
        "rollout.max_tokens_per_turn=24",
    ]
    (run_root / "slurm_fake_env.py").write_text(FAKE_ENV)
    command = [str(tir_rl), "launch", "--config", str(ROOT / "configs" / "quickstart.yaml")]
    for value in sets:
        command += ["--set", value]
    command += ["--servers", "1", "--trainer-nodes", str(trainer_nodes)]
    command += ["--gpus-per-node", "0", "--emit", "slurm"]
    command += ["--weights-dir", str(run_root / "weights")]
    done = subprocess.run(command, cwd=run_root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    script = run_root / "job.sbatch"
    script.write_text(done.stdout)
    return script


def submit(script: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        cwd=script.parent, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def job_fields(job: str, env: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True
    )
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_ended(job: str, env: dict[str, str]) -> dict[str, str]:
    """The job's fields once Slurm has ended it and cleaned its nodes (not COMPLETING)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        fields = job_fields(job, env)
        if fields.get("JobState") not in {None, "PENDING", "RUNNING", "COMPLETING"}:
            if "COMPLETING" not in fields.get("Reason", "") and not _completing(job, env):
                return fields
        time.sleep(2)
    subprocess.run(["scancel", job], env=env, check=False)
    raise AssertionError(f"job {job} did not end within {JOB_TIMEOUT_S} s: {fields}")


def _completing(job: str, env: dict[str, str]) -> bool:
    queue = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%t"], env=env, capture_output=True, text=True
    )
    return queue.stdout.strip() == "CG"


def processes_left(job: str) -> list[str]:
    """Processes that carry the job's id, and any in a node's namespace but its slurmd."""
    left = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("SLURM_JOB_ID") == job:
                left.append(f"{process.pid} {process.cmdline()[:3]}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    for namespace in NODE_NAMESPACES:
        pids = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                name = psutil.Process(int(pid)).name()
            except psutil.NoSuchProcess:
                continue
            if name != "slurmd":
                left.append(f"{pid} {name} in {namespace}")
    return left


def test_the_emitted_script_trains_two_steps_on_two_trainer_nodes_of_a_real_slurm(
    slurm_env, tmp_path
):
    job = submit(emit_job(tmp_path, slurm_env, steps=2, trainer_nodes=2), slurm_env)
    fields = wait_ended(job, slurm_env)
    launch = tmp_path / "runs" / "quickstart" / "launch"
    output = (launch / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output[-3000:]
    assert "steps done: 2" in output
    rows = read_metrics(tmp_path / "runs" / "quickstart" / "metrics.jsonl")
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["train/skipped"] == 0.0 for r in trained)
    # the server on node 1 took each update: its logprobs match the trainer's after the push
    assert all(r["sync/parity_max_abs_diff"] < 1e-3 for r in trained)
    assert (launch / "server-tnode2.log").exists()  # nodes 0 and 1 train, node 2 serves
    ranks = re.findall(r"rank (\d) of 2 on (tnode\d)", output)
    assert sorted(ranks) == [("0", "tnode0"), ("1", "tnode1")], output[-3000:]
    assert oct((launch / "secret").stat().st_mode & 0o777) == "0o600"
    assert processes_left(job) == []
    keep_record(tmp_path, job, "trains", fields)


def test_scancel_mid_run_leaves_no_process_and_the_trainer_s_checkpoint(slurm_env, tmp_path):
    job = submit(emit_job(tmp_path, slurm_env, steps=100), slurm_env)
    metrics = tmp_path / "runs" / "quickstart" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.exists() and any("train/loss" in r for r in read_metrics(metrics))):
        assert job_fields(job, slurm_env).get("JobState") in {"PENDING", "RUNNING"}
        assert time.monotonic() < deadline, "no step was trained"
        time.sleep(2)
    running = processes_left(job)
    assert any("vllm" in p for p in running) and any("tir_rl.cli" in p for p in running)
    subprocess.run(["scancel", job], env=slurm_env, check=True)
    fields = wait_ended(job, slurm_env)
    assert fields["JobState"] == "CANCELLED"
    assert processes_left(job) == []
    # SIGTERM unwinds the trainer like Ctrl-C: it checkpoints the steps it finished
    trained = max(r["step"] for r in read_metrics(metrics) if "train/loss" in r)
    checkpoints = tmp_path / "runs" / "quickstart" / "checkpoints"
    assert (checkpoints / f"step_{trained}").is_dir(), sorted(checkpoints.iterdir())
    keep_record(tmp_path, job, "scancel", fields)


def keep_record(run_root: Path, job: str, name: str, fields: dict[str, str]) -> None:
    """With TIR_RL_SLURM_RECORD=DIR, keep the job's script, Slurm output and end state there."""
    folder = os.environ.get("TIR_RL_SLURM_RECORD")
    if not folder:
        return
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    launch = run_root / "runs" / "quickstart" / "launch"
    root = str(run_root)
    script = (run_root / "job.sbatch").read_text().replace(root, "$RUN_ROOT")
    (out / f"{name}.sbatch").write_text(script)
    output = (launch / f"slurm-{job}.out").read_text().replace(root, "$RUN_ROOT")
    (out / f"{name}.out").write_text(output)
    kept = ("JobState", "ExitCode", "RunTime", "NodeList", "NumNodes")
    (out / f"{name}.job").write_text("".join(f"{k}={fields.get(k, '')}\n" for k in kept))
