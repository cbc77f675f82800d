"""A multi-turn `verifiers` environment with a stateful tool, played by the verifiers worker.

`examples/verifiers_env/vf_ledger.py` gives the model a ledger toolset (`add`, `balance`), an
MCP tool server that verifiers starts per episode and whose state it keeps across the
episode's turns. verifiers is real (`worker.py` in `.venv-verifiers`, its `null` harness,
its tool servers), as are the endpoint, the chat format and the tokenizer; the model is the
scripted fake engine of tests/unit/test_endpoint.py, because a model that has never seen the
ledger would not call it: it reads the amounts from the prompt and, in `tools` mode, enters
them one `<tool_call>` at a time before answering, in `direct` mode it answers at once.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tir_rl.envs import WorkerAgentEnv
from tir_rl.models import prepare_bundled_model
from tir_rl.report.viewer import render_html
from tir_rl.rollout import EpisodeSpec, Rollout
from tir_rl.types import Role, RolloutStatus

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_endpoint import FakeTextEngine  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow]

VENV = Path(os.environ.get("TIR_RL_VERIFIERS_VENV", ROOT / ".venv-verifiers"))
WORKER = ROOT / "examples" / "verifiers_env" / "worker.py"
if not (VENV / "bin" / "python").exists():
    pytest.skip(
        f"no verifiers venv at {VENV}: run `bash scripts/setup_verifiers.sh` (scripts/test.sh "
        "does)",
        allow_module_level=True,
    )


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
def played(tmp_path_factory):
    """Two batches of 2 ledger episodes through one worker: the model uses the tool in the
    first and answers directly in the second. (trajectories by mode, records folder)"""
    records = tmp_path_factory.mktemp("records")
    tokenizer = AutoTokenizer.from_pretrained(prepare_bundled_model())
    model = ScriptedLedgerModel(tokenizer)
    rollout = Rollout(
        FakeTextEngine(tokenizer, model),
        tokenizer,
        Rollout.Config(max_tokens_per_turn=64, max_turns=8, agent_timeout_s=240),
    )
    argv = [
        str(VENV / "bin" / "python"),
        str(WORKER),
        "--env",
        "vf_ledger",
        "--record",
        str(records),
    ]

    class Ledger(WorkerAgentEnv):
        def __init__(self, **overrides: Any) -> None:
            super().__init__(command=argv, **overrides)

    played = {}
    try:
        for mode in ("tools", "direct"):
            model.mode = mode
            specs = [
                EpisodeSpec(
                    env_factory=Ledger, options={"task_index": i}, group_id=0, sample_index=i
                )
                for i in range(2)
            ]
            played[mode] = asyncio.run(rollout.run_batch(specs))
    finally:
        rollout.close()
    return played, records


def records_of(folder: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in folder.glob("*.json")}


def test_the_tool_keeps_its_state_across_turns_and_the_rubric_reads_it(played):
    played, folder = played
    for trajectory in played["tools"]:
        assert trajectory.status == RolloutStatus.FINISHED, trajectory.error
        assert trajectory.reward == pytest.approx(2.0)  # the total, and every amount entered
        # one sample: the history is append-only across the tool turns
        calls = [m for m in trajectory.messages if m.role == Role.ASSISTANT and m.tool_calls]
        results = [m.content for m in trajectory.messages if m.role == Role.TOOL]
        assert len(calls) == len(results) >= 2
        assert trajectory.num_tool_calls == len(calls)
        assert max(trajectory.turn_ids) == len(calls)  # one turn per call, then the answer
        # each balance is the running sum: the tool server kept the state between turns
        amounts = [c.tool_calls[0].arguments["amount"] for c in calls]
        assert [int(r) for r in results] == [sum(amounts[: i + 1]) for i in range(len(amounts))]
    # the trajectory viewer shows each call and the balance the tool answered
    tokenizer = AutoTokenizer.from_pretrained(prepare_bundled_model())
    page = render_html(played["tools"], tokenizer)
    for trajectory in played["tools"]:
        for message in trajectory.messages:
            for call in message.tool_calls:
                shown = html.escape(json.dumps(call.arguments))
                assert f"<b>tool call</b> add<code>{shown}</code>" in page
    assert page.count("<b>tool result") == sum(t.num_tool_calls for t in played["tools"])
    records = [r for r in records_of(folder).values() if r["num_calls"] > 1]
    assert len(records) == 2
    assert all(r["rewards"]["entered"]["score"] == 1.0 for r in records)


def test_an_answer_without_the_tool_gets_no_ledger_reward(played):
    played, folder = played
    for trajectory in played["direct"]:
        assert trajectory.status == RolloutStatus.FINISHED, trajectory.error
        assert trajectory.reward == pytest.approx(1.0)  # the right total, nothing entered
        assert trajectory.num_tool_calls == 0
    direct = [r for r in records_of(folder).values() if r["num_calls"] == 1]
    assert [r["rewards"]["entered"]["score"] for r in direct] == [0.0, 0.0]
    # one worker played both batches
    assert len({r["worker_pid"] for r in records_of(folder).values()}) == 1
