"""The chat endpoint on real vLLM-CPU (tiny random Llama) with the real `openai` client.

`tir-rl serve` runs in a subprocess and is reached over HTTP; an `AgentEnv` whose agent is
written with the OpenAI Agents SDK (examples/agents_sdk_agent.py) trains 2 steps in process.
"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch

from tir_rl.config import load
from tir_rl.distributed import free_port
from tir_rl.engine.parity import transformers_logprobs
from tir_rl.models import prepare_tiny_model
from tir_rl.report.run_log import load_trajectories, read_metrics
from tir_rl.rl_loop import run_train
from tir_rl.run_config import RunConfig

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.vllm, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from agents_sdk_agent import AgentsSdkLetterCount  # noqa: E402
from openai_agent import COUNT_TOOL  # noqa: E402

TINY = (
    "model=tiny",
    "engine.local.max_model_len=2048",
    "engine.local.kv_cache_gib=0.25",
    "rollout.max_tokens_per_turn=24",
    "rollout.max_turns=4",
    "run.plot_every=0",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tir-rl serve` on the tiny model: (url, process, its output, the API key's file)."""
    port = free_port()
    folder = tmp_path_factory.mktemp("serve")
    out = (folder / "serve.out").open("w+")
    config = folder / "serve.yaml"
    config.write_text("{}\n")
    args = [
        sys.executable,
        "-m",
        "tir_rl.cli",
        "serve",
        "--port",
        str(port),
        "--secret-file",
        str(folder / "key"),
        "--config",
        str(config),
    ]
    sets = [arg for item in TINY for arg in ("--set", item)]
    proc = subprocess.Popen([*args, *sets], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, out.seek(0) or out.read()
            try:
                key = {"Authorization": f"Bearer {(folder / 'key').read_text().strip()}"}
                if httpx.get(f"{url}/health", headers=key, timeout=2).status_code == 200:
                    break
            except (httpx.HTTPError, FileNotFoundError):
                pass
            time.sleep(1)
        else:
            pytest.fail("tir-rl serve did not come up")
        yield url, proc, out, folder / "key"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_the_openai_client_samples_through_the_endpoint_and_every_token_is_recorded(served):
    url, _, _, key_file = served
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    refused = openai.OpenAI(base_url=f"{url}/episodes/ep-a/v1", api_key="none")
    with pytest.raises(openai.AuthenticationError):
        refused.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    client = openai.OpenAI(base_url=f"{url}/episodes/ep-a/v1", api_key=key)
    question = [{"role": "user", "content": "How many r in 'mirror'?"}]
    first = client.chat.completions.create(
        model="tiny",
        messages=question,
        tools=[COUNT_TOOL],
        n=2,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    assert len(first.choices) == 2
    prompt_ids = first.model_extra["prompt_token_ids"]
    recorded = _calls(url, key, "ep-a")
    for choice, call in zip(first.choices, recorded, strict=True):
        ids = choice.model_extra["token_ids"]
        assert call["completion_ids"] == ids
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(call["logprobs"])
        assert call["prompt_ids"] == prompt_ids

    # The recorded sampler logprobs are the model's: recomputed in fp32 by transformers.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(prepare_tiny_model(), dtype="float32").eval()
    for call in _calls(url, key, "ep-a"):
        recomputed = transformers_logprobs(model, call["prompt_ids"] + call["completion_ids"])
        sampled = torch.tensor(call["logprobs"])
        assert (recomputed[len(call["prompt_ids"]) - 1 :] - sampled).abs().max().item() < 1e-3

    # A follow-up after choice 0 extends its tokens verbatim; choice 1 stays a sample of its own.
    reply = first.choices[0].message.model_dump(exclude_none=True)
    follow_up = [*question, reply, {"role": "user", "content": "Say it again."}]
    client.chat.completions.create(
        model="tiny", messages=follow_up, tools=[COUNT_TOOL], max_completion_tokens=8
    )
    # Other tools are another system turn: the same messages without them start afresh.
    client.chat.completions.create(model="tiny", messages=follow_up, max_completion_tokens=8)
    calls = _calls(url, key, "ep-a")
    assert [c["extends_call"] for c in calls] == [None, None, [0, 0], None]
    head = calls[0]["prompt_ids"] + calls[0]["completion_ids"]
    assert calls[2]["prompt_ids"][: len(head)] == head

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=question, temperature=0.5)

    finish = f"{url}/episodes/ep-a/finish"
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.post(finish, json={"reward": 0.5}).status_code == 401
    samples = httpx.post(finish, json={"reward": 0.5}, headers=auth).json()["samples"]
    assert len(samples) == 3
    assert sorted(sum(s["loss_mask"]) for s in samples) == sorted(
        [
            len(calls[1]["completion_ids"]),
            len(calls[0]["completion_ids"]) + len(calls[2]["completion_ids"]),
            len(calls[3]["completion_ids"]),
        ]
    )
    assert {s["reward"] for s in samples} == {0.5}


def test_ctrl_c_stops_the_server_and_its_engine(served):
    url, proc, out, key_file = served
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    out.seek(0)
    printed = out.read()
    assert f"at {url}/v1" in printed and "stopped" in printed
    assert str(key_file) in printed and key_file.read_text().strip() not in printed
    assert "EngineCore" not in printed  # vLLM's own logs went to the command's log file
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left running: {alive}"


def _calls(url: str, key: str, episode: str) -> list[dict[str, Any]]:
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{url}/episodes/{episode}", headers=auth).json()["calls"]


class HashRewardLetterCount(AgentsSdkLetterCount):
    """The Agents SDK example, then a summary call with a fresh history (a second sample);
    the reward is hashed from the replies, since a random tiny model never answers right."""

    async def agent(self, client: Any, task: Any) -> float:
        await super().agent(client, task)
        summary = [{"role": "user", "content": f"In one line: {task.question}"}]
        final = await client.chat.completions.create(model="policy", messages=summary)
        return (sum(map(ord, final.choices[0].message.content or "")) % 97) / 97


def test_an_agent_written_with_the_openai_agents_sdk_trains_two_steps(tmp_path):
    pytest.importorskip("agents", reason='openai-agents is not installed ("tir-rl[agents]")')
    config = load(
        RunConfig,
        None,
        [
            *TINY,
            f"run.out_dir={tmp_path}",
            "run.name=agent",
            "run.steps=2",
            "run.tasks_per_step=2",
            "run.group_size=2",
            "run.eval_tasks=2",
            "rollout.max_turns=6",  # the SDK's 4 turns and the summary
            f"env.id={Path(__file__).stem}:HashRewardLetterCount",
            "trainer.lr=1e-3",
            "correction_preset=geo_rs_token_tis",
        ],
    )
    summary = run_train(config)
    assert summary.steps_done == 2
    rows = read_metrics(summary.run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/grad_norm" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert any(r["train/num_loss_tokens"] > 0 and r["train/grad_norm"] > 0 for r in train_rows)
    rollout_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert all(r.get("rollout/samples_per_episode", 1.0) >= 2.0 for r in rollout_rows)
    saved = load_trajectories(summary.run_dir / "trajectories.jsonl")
    assert saved and all(s.trajectory.episode_id is not None for s in saved)
    report = json.loads((summary.run_dir / "eval_step_2.json").read_text())
    assert report["num_tasks"] == 2
