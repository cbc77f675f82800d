"""`tir_rl/MultiHop-v0`: chains of lookups in a generated knowledge base (long horizon).

Each task generates a small knowledge base of people, companies and cities (see
`tir_rl.envs.knowledge_base`) and asks where a chain of ``horizon`` relations leads from a
start entity. The model has two in-process tools, ``search(query)`` and
``lookup(entity, relation)``; no sandbox is involved, so an episode costs microseconds of
CPU besides the model. An answer needs exactly ``horizon`` successful lookups.

Reward: ``correct`` is 1 when the final answer names the chain's last entity
(case and whitespace ignored), else 0; plus ``Config.format_reward`` for the ``<answer>``
tag; plus, when ``Config.progress_reward`` is set, ``progress_reward * k / horizon`` where
``k`` is the number of leading hops of the chain the model looked up (shaping, off by
default).

Splits: train and test knowledge bases come from separate seed streams and from disjoint
halves of the name pools, so no entity (hence no question) appears in both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tir_rl.envs.answers import ANSWER_INSTRUCTIONS, normalize_name
from tir_rl.envs.base import Task, ToolEnv
from tir_rl.envs.knowledge_base import KnowledgeBase, generate_kb, random_chain
from tir_rl.errors import ConfigError
from tir_rl.types import Message, ToolCall

if TYPE_CHECKING:
    from tir_rl.tools import ToolRegistry

MAX_HORIZON = 256
MAX_SEARCH_RESULTS = 8

SYSTEM_PROMPT = (
    "You answer questions about a private knowledge base of people, companies and cities. "
    "You know nothing about it yourself: use the `lookup` tool to follow one relation at a "
    "time, and `search` to find exact entity names. Follow the chain one hop after the "
    "other; the answer is the exact name of the last entity. "
) + ANSWER_INSTRUCTIONS


class MultiHopEnv(ToolEnv):
    """Answer = the end of a ``horizon``-hop chain of relations; one lookup per hop."""

    @dataclass(kw_only=True)
    class Config(ToolEnv.Config):
        """MultiHop settings."""

        horizon: int = 4
        """Number of relations in the chain (= lookups needed), 1..256."""
        entities_per_kind: int | None = None
        """Knowledge base size per kind (None: ``min(6 + horizon, 80)``)."""
        progress_reward: float = 0.0
        """Weight of the per-hop progress shaping term (0: off)."""
        invented_names: bool = False
        """Name entities with made-up words, new in every task, instead of the split's name
        pools: the answer can only be found by copying names from the tool results, never
        recalled (demonstrations for models trained from scratch use this)."""

        def validate(self) -> None:
            """Check values; raise `ConfigError` naming the bad field."""
            super().validate()
            if not 1 <= self.horizon <= MAX_HORIZON:
                raise ConfigError(f"horizon={self.horizon}: choose 1..{MAX_HORIZON}")
            if self.entities_per_kind is not None and not 2 <= self.entities_per_kind <= 80:
                raise ConfigError(f"entities_per_kind={self.entities_per_kind}: choose 2..80")

    config: Config

    def __init__(self, *args, **kwargs) -> None:  # noqa: D107 (see ToolEnv)
        super().__init__(*args, **kwargs)
        self._kb = KnowledgeBase()
        self._looked_up: set[tuple[str, str]] = set()

    @property
    def kb(self) -> KnowledgeBase:
        """The current episode's knowledge base."""
        return self._kb

    def build_tools(self) -> ToolRegistry:
        """``search`` and ``lookup`` over the current episode's knowledge base."""
        from tir_rl.tools import ToolRegistry, tool

        @tool
        def search(query: str) -> str:
            """Find entities whose name contains the query (case-insensitive).

            Args:
                query: Part of an entity name, e.g. a surname.

            Returns:
                One line per match (at most 8): the exact name, its kind and its relations.
            """
            needle = normalize_name(query)
            hits = [e for e in sorted(self._kb.kinds) if needle in e.casefold()]
            if not hits:
                raise ValueError(f"no entity name contains {query!r}; try a shorter query")
            return "\n".join(
                f"{e} ({self._kb.kinds[e]}; relations: {', '.join(self._kb.relations_of(e))})"
                for e in hits[:MAX_SEARCH_RESULTS]
            )

        @tool
        def lookup(entity: str, relation: str) -> str:
            """Follow one relation from an entity.

            Args:
                entity: The exact name of an entity.
                relation: A relation of that entity, e.g. "mentor" or "headquarters".

            Returns:
                The exact name of the related entity.
            """
            name = self._resolve(entity)
            relations = self._kb.relations_of(name)
            if relation.strip().lower() not in relations:
                raise ValueError(
                    f"{name} is a {self._kb.kinds[name]} and has no relation {relation!r}; "
                    f"its relations are: {', '.join(relations)}"
                )
            key = (name, relation.strip().lower())
            self._looked_up.add(key)
            return self._kb.links[key]

        return ToolRegistry([search, lookup])

    def _resolve(self, entity: str) -> str:
        wanted = normalize_name(entity)
        for name in self._kb.kinds:
            if name.casefold() == wanted:
                return name
        raise ValueError(f"no entity is named {entity!r}; use search to find the exact name")

    def generate_task(self, index: int) -> Task:
        """Task `index` of this env's split: a knowledge base and a chain."""
        horizon = self.config.horizon
        rng = random.Random(f"tir_rl/MultiHop/{self.split}/{horizon}/{index}")
        size = self.config.entities_per_kind or min(6 + horizon, 80)
        kb = generate_kb(rng, self.split, size, invented_names=self.config.invented_names)
        start, relations = random_chain(rng, kb, horizon)
        steps = "\n".join(f"{i + 1}. {r}" for i, r in enumerate(relations))
        question = (
            f"Start from {start} (a {kb.kinds[start]}). Follow these {horizon} relations in "
            f"order, each from the entity the previous one led to:\n{steps}\n"
            "What is the exact name of the entity you reach at the end?"
        )
        path = kb.follow(start, relations)
        return Task(
            id=f"multihop/{self.split}/h{horizon}/{index}",
            question=question,
            answer=path[-1],
            split=self.split,
            difficulty=horizon,
            data={"start": start, "relations": relations, "path": path, "kb": kb},
        )

    def on_reset(self, task: Task) -> None:
        """Load the task's knowledge base and forget earlier lookups."""
        self._kb = task.data["kb"]
        self._looked_up = set()

    def instructions(self, task: Task) -> str:
        """The system prompt."""
        return SYSTEM_PROMPT

    def demonstration(self, task: Task) -> list[Message]:
        """The oracle's turns: one ``lookup`` call per hop, then the answer tag."""
        path, relations = task.data["path"], task.data["relations"]
        turns = [
            Message.assistant("", [ToolCall("lookup", {"entity": entity, "relation": relation})])
            for entity, relation in zip(path[:-1], relations, strict=True)
        ]
        return [*turns, Message.assistant(f"<answer>{task.answer}</answer>")]

    def score(self, task: Task, answer: str) -> float:
        """1.0 when `answer` names the chain's last entity."""
        return float(normalize_name(answer) == normalize_name(task.answer))

    def progress(self, task: Task) -> int:
        """Number of leading hops of the chain the model has looked up."""
        path, relations = task.data["path"], task.data["relations"]
        hops = 0
        while hops < len(relations) and (path[hops], relations[hops]) in self._looked_up:
            hops += 1
        return hops

    def shaping(self, task: Task) -> float:
        """``progress_reward * progress / horizon``."""
        if not self.config.progress_reward:
            return 0.0
        return self.config.progress_reward * self.progress(task) / len(task.data["relations"])
