"""Generated knowledge bases for MultiHop: typed entities joined by functional relations.

Every entity has exactly one target per relation of its kind, so a chain of relations from a
start entity has exactly one answer, and finding it takes one lookup per hop. Names are
built from word pools that are split in two halves by `Split`: a train knowledge base and a
test knowledge base never share an entity name.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tir_rl.envs.episode import Split

RELATIONS: dict[str, dict[str, str]] = {
    "person": {"mentor": "person", "rival": "person", "employer": "company", "hometown": "city"},
    "company": {"founder": "person", "headquarters": "city", "partner": "company"},
    "city": {"mayor": "person", "twin_city": "city"},
}
"""For each entity kind: relation name -> kind of the target."""

_FIRST = (
    "Ada Alma Bela Cato Dara Elio Fina Gil Hana Ivo Jora Kael Lina Milo Nara Oren Pia Quin "
    "Rhea Silas Tova Ulan Vera Wren Xena Yara Zeno Abel Bryn Cleo Dion Esme Fenn Greta Hugo"
).split()
_LAST = (
    "Vorbeck Quillon Marsh Okafor Lindqvist Tanaka Ferreira Novak Halloran Castell Ibarra "
    "Duval Kestrel Moreau Petrov Sandoval Whitlock Yilmaz Aldane Brandt Corvin Delacroix "
    "Eskola Farrow Galen Hartwell Ingram Jaspers Kovacs Lowell Mendez Nyberg Osei Pellegrini"
).split()
_COMPANY = (
    "Zentrix Orbital Halcyon Brightwell Copperleaf Ironbark Lumen Meridian Northgate Obsidian "
    "Pinecrest Quantum Redfern Silverline Tidewater Umbra Vantage Westbrook Axiom Borealis"
).split()
_COMPANY_SUFFIX = "Labs Works Group Systems Foods Motors Energy Media".split()
_CITY_PREFIX = "Port New East West North South Lake Fort Mount Glen".split()
_CITY = (
    "Elvar Caldera Ashby Brennick Dunmore Estrel Farhaven Greyholm Harrow Istra Jolvik "
    "Kellan Lorne Marrow Norwick Oakdale Pellin Quarry Rosk Stavel Thorne Ulvik Varn Wexley"
).split()


def _half(words: list[str], split: Split) -> list[str]:
    """Train uses the even positions of a pool, test the odd ones."""
    return words[split == Split.TEST :: 2]


@dataclass
class KnowledgeBase:
    """Entities by name, their kind, and relation targets."""

    kinds: dict[str, str] = field(default_factory=dict)
    """Entity name -> kind ("person", "company", "city")."""
    links: dict[tuple[str, str], str] = field(default_factory=dict)
    """(entity, relation) -> target entity."""

    def relations_of(self, entity: str) -> list[str]:
        """Relation names available for `entity`."""
        return list(RELATIONS[self.kinds[entity]])

    def follow(self, start: str, relations: list[str]) -> list[str]:
        """The entities visited from `start` along `relations` (start included)."""
        path = [start]
        for relation in relations:
            path.append(self.links[(path[-1], relation)])
        return path


_ONSETS = "b c d f g h j k l m n p r s t v w z br dr gr kr st th sh tr".split()
_VOWELS = "a e i o u ai ea io".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "nd", "x"]


def _invented_word(rng: random.Random) -> str:
    """A pronounceable made-up word of 2-3 syllables, capitalised."""
    syllables = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice((2, 2, 3)))
    ]
    return "".join(syllables).capitalize()


def _invented_pools(rng: random.Random, num_per_kind: int) -> dict[str, list[str]]:
    """Name pools of made-up words, new for every knowledge base."""

    def unique(make: Callable[[], str]) -> list[str]:
        names: set[str] = set()
        while len(names) < 2 * num_per_kind:
            names.add(make())
        return sorted(names)

    return {
        "person": unique(lambda: f"{_invented_word(rng)} {_invented_word(rng)}"),
        "company": unique(lambda: f"{_invented_word(rng)} {rng.choice(_COMPANY_SUFFIX)}"),
        "city": unique(lambda: f"{rng.choice(_CITY_PREFIX)} {_invented_word(rng)}"),
    }


def generate_kb(
    rng: random.Random, split: Split, num_per_kind: int, *, invented_names: bool = False
) -> KnowledgeBase:
    """A knowledge base with `num_per_kind` entities of each kind.

    Args:
        rng: the task's random stream.
        split: picks the half of the name pools (train and test never share a name).
        num_per_kind: entities of each kind.
        invented_names: name entities with made-up words drawn from `rng` instead of the
            split's pools (every knowledge base gets names no other one is likely to have).
    """
    if invented_names:
        pools = _invented_pools(rng, num_per_kind)
    else:
        first, last = _half(_FIRST, split), _half(_LAST, split)
        pools = {
            "person": [f"{a} {b}" for a in first for b in last],
            "company": [f"{a} {b}" for a in _half(_COMPANY, split) for b in _COMPANY_SUFFIX],
            "city": [f"{a} {b}" for a in _CITY_PREFIX for b in _half(_CITY, split)],
        }
    kb = KnowledgeBase()
    by_kind: dict[str, list[str]] = {}
    for kind, pool in pools.items():
        assert num_per_kind <= len(pool), f"at most {len(pool)} {kind} names per split"
        by_kind[kind] = rng.sample(pool, num_per_kind)
        kb.kinds.update(dict.fromkeys(by_kind[kind], kind))
    for entity, kind in kb.kinds.items():
        for relation, target_kind in RELATIONS[kind].items():
            choices = [e for e in by_kind[target_kind] if e != entity]
            kb.links[(entity, relation)] = rng.choice(choices)
    return kb


def random_chain(rng: random.Random, kb: KnowledgeBase, horizon: int) -> tuple[str, list[str]]:
    """A start entity and `horizon` relations, each valid where the chain stands."""
    start = rng.choice(sorted(kb.kinds))
    entity, relations = start, []
    for _ in range(horizon):
        relation = rng.choice(kb.relations_of(entity))
        relations.append(relation)
        entity = kb.links[(entity, relation)]
    return start, relations
