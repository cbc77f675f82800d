"""A SIGKILLed `tir-rl train` leaves no vLLM process behind, and `--resume` completes it.

Real vLLM on the tiny model, real `tir-rl train` in a subprocess, asynchronous (k = 2: the
producer thread has groups in flight): the run is killed right after the step-1
checkpoint, the way the OOM killer would.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tir_rl.engine.reaping import engine_processes, owner_id

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

TIR_RL = str(Path(sys.executable).parent / "tir-rl")
CONFIG = """\
model: tiny
run: {name: crash, steps: 3, tasks_per_step: 2, group_size: 2, eval_tasks: 1,
      checkpoint_every: 1, max_staleness: 2, plot_every: 0}
env: {id: tir_rl/MultiHop-v0, kwargs: {horizon: 2}}
engine: {kv_cache_gib: 0.25}
rollout: {max_turns: 2, max_tokens_per_turn: 24, end_on_truncated_turn: false}
"""


def wait_for(predicate, *, timeout_s: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(0.1)


def test_sigkilled_run_leaves_no_engine_and_resumes(tmp_path):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    run_dir = tmp_path / "crash"
    log = (tmp_path / "run.log").open("w")
    train = [TIR_RL, "train", "--config", "tiny.yaml", "--set", f"run.out_dir={tmp_path}"]
    run = subprocess.Popen(train, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    owner = owner_id(run.pid)
    try:
        step_1 = run_dir / "checkpoints" / "step_1" / "trainer_state.json"
        wait_for(step_1.is_file, timeout_s=400, what="step-1 checkpoint", proc=run)
        time.sleep(1.0)  # step 2's rollouts are under way
        engine = engine_processes(owner=owner)
        assert any("EngineCore" in p.command for p in engine), [p.command for p in engine]
        run.send_signal(signal.SIGKILL)
        run.wait()
        killed_at = time.monotonic()
        wait_for(lambda: not engine_processes(owner=owner), timeout_s=10, what="engine exit")
        print(f"engine processes gone {time.monotonic() - killed_at:.1f} s after SIGKILL")
        assert not (run_dir / "checkpoints" / "step_3").exists()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        log.close()

    resumed = subprocess.run(
        [TIR_RL, "train", "--resume", str(run_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    terminal = resumed.stdout + resumed.stderr
    library_log = (run_dir / "libraries.log").read_text()
    for line in ("Initializing a V1 LLM engine", "(EngineCore"):  # vLLM's start-up chatter
        assert line not in terminal, terminal[-3000:]
    assert "Initializing a V1 LLM engine" in library_log
    assert "steps done: 3" in terminal
    assert (run_dir / "checkpoints" / "step_3" / "trainer_state.json").is_file()
    state = json.loads((run_dir / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert state["data_position"]["step"] == 3  # the steps of the run, all done
    assert state["data_position"]["pending_groups"] == []  # no task left behind
