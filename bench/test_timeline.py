"""Where a test run's wall time went: per group, per worker, and the idle tail.

`scripts/test.sh` has every test append its span to `runs/test_timeline.jsonl` (tests/conftest.py,
`TIR_RL_TEST_TIMELINE`). This prints the groups by worker-seconds (a group is what one worker
runs whole: a test file, or every sandbox test), each worker's busy seconds, and how long each
worker idled before the last test ended: the part of the wall time that better ordering could
win back, as against the part only shorter tests can.

    python bench/test_timeline.py runs/test_timeline.jsonl [--top 25]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Span:
    test: str
    group: str
    worker: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def read_spans(path: Path) -> list[Span]:
    return [Span(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def summary(spans: list[Span], top: int) -> str:
    if not spans:
        return "no test ran"
    first = min(s.start for s in spans)
    last = max(s.end for s in spans)
    by_group: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_group[span.group].append(span)
    lines = [
        f"{len(spans)} tests, wall {last - first:.0f} s (first test start to last test end)",
        "",
        "| group | tests | worker | seconds | first start (s) |",
        "|---|---:|---|---:|---:|",
    ]
    ranked = sorted(by_group.items(), key=lambda kv: -sum(s.seconds for s in kv[1]))
    for group, members in ranked[:top]:
        workers = ",".join(sorted({s.worker for s in members}))
        seconds = sum(s.seconds for s in members)
        start = min(s.start for s in members) - first
        lines.append(f"| {group} | {len(members)} | {workers} | {seconds:.0f} | {start:.0f} |")
    rest = ranked[top:]
    if rest:
        seconds = sum(s.seconds for _, members in rest for s in members)
        lines.append(f"| ({len(rest)} other groups) | | | {seconds:.0f} | |")
    lines += ["", "| worker | busy seconds | last end (s) | idle before the run's end (s) |"]
    lines.append("|---|---:|---:|---:|")
    by_worker: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_worker[span.worker].append(span)
    for worker, members in sorted(by_worker.items()):
        end = max(s.end for s in members)
        busy = sum(s.seconds for s in members)
        lines.append(f"| {worker} | {busy:.0f} | {end - first:.0f} | {last - end:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=25, help="groups listed one by one")
    args = parser.parse_args()
    print(summary(read_spans(args.timeline), args.top))


if __name__ == "__main__":
    main()
