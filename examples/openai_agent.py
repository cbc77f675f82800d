"""An agent written with the OpenAI SDK, trained as it is: `env.id=openai_agent:LetterCount`.

The agent is an ordinary tool-calling loop over `client.chat.completions.create`; tir-rl's
chat endpoint answers its calls with the run's engine and records them in tokens, so the
run trains exactly what was sampled (docs/bring_your_agent.md). Run from this folder::

    cd examples
    tir-rl train --config ../configs/quickstart.yaml --set env.id=openai_agent:LetterCount \
        --set rollout.max_turns=4
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from tir_rl.envs import AgentEnv, Split, Task

WORDS = ("strawberry", "mirror", "carrot", "error", "barrier", "referral", "terror", "arrow")

COUNT_TOOL = {
    "type": "function",
    "function": {
        "name": "count_letter",
        "description": "Count how many times a letter occurs in a word.",
        "parameters": {
            "type": "object",
            "properties": {
                "word": {"type": "string", "description": "the word"},
                "letter": {"type": "string", "description": "one letter"},
            },
            "required": ["word", "letter"],
        },
    },
}


def count_letter(word: str, letter: str) -> str:
    """The tool, run by the agent itself (no sandbox needed for this one)."""
    return str(word.lower().count(letter.lower()[:1]))


class LetterCount(AgentEnv):
    """How many times does a letter occur in a word? The agent may call `count_letter`."""

    def generate_task(self, index: int) -> Task:
        """A word and one of its letters, drawn from `index` and the split."""
        rng = random.Random(f"{self.split.value}/{index}")
        word = rng.choice(WORDS)
        letter = rng.choice(sorted(set(word)))
        question = f"How many times does the letter '{letter}' occur in '{word}'?"
        answer = str(word.count(letter))
        return Task(f"{self.split.value}-{index}", question, answer, self.split, 1, {})

    async def agent(self, client: Any, task: Task) -> float:
        """Call the model, run the tools it asks for, until it answers (4 calls at most)."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Answer with a number. Use the tool if it helps."},
            {"role": "user", "content": task.question},
        ]
        reply = ""
        for _ in range(4):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[COUNT_TOOL]
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            reply = message.content or ""
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    result = count_letter(**json.loads(call.function.arguments))
                except (TypeError, ValueError) as exc:
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return self.score(task, reply)

    @staticmethod
    def score(task: Task, reply: str) -> float:
        """1 when the last number of the reply is the answer."""
        numbers = re.findall(r"-?\d+", reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0


__all__ = ["LetterCount", "Split"]
