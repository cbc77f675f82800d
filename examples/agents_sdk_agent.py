"""An agent written with the OpenAI Agents SDK (`openai-agents` on PyPI), trained as it is.

The agent, its tool and its run loop are the SDK's; tir-rl only hands it a client whose
calls the run's chat endpoint answers and records in tokens (docs/bring_your_agent.md).
Run from this folder, with ``pip install "tir-rl[agents]"``::

    cd examples
    tir-rl train --config ../configs/quickstart.yaml \
        --set env.id=agents_sdk_agent:AgentsSdkLetterCount --set rollout.max_turns=4
"""

from __future__ import annotations

from typing import Any

from openai_agent import LetterCount, count_letter

from tir_rl.envs import Task

INSTRUCTIONS = "Answer with a number. Use the count_letter tool if it helps."


class AgentsSdkLetterCount(LetterCount):
    """`LetterCount`'s tasks and score, played by an OpenAI Agents SDK agent."""

    max_agent_turns = 4
    """The SDK's own turn limit (keep it at most `rollout.max_turns`)."""

    async def agent(self, client: Any, task: Task) -> float:
        """Run the SDK agent on the question; its final output is scored."""
        from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
        from agents.exceptions import MaxTurnsExceeded

        agent = Agent(
            name="letter-counter",
            instructions=INSTRUCTIONS,
            tools=[function_tool(count_letter)],
            model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        )
        try:
            result = await Runner.run(
                agent,
                task.question,
                max_turns=self.max_agent_turns,
                run_config=RunConfig(tracing_disabled=True),  # no trace upload
            )
        except MaxTurnsExceeded:
            return 0.0
        return self.score(task, str(result.final_output or ""))
