"""Projected throughput of asynchronous RL (staleness bound k) over the synchronous loop (k = 0).

A seeded discrete-event simulation (seconds to run) that replays episode, update and weight-sync
durations through the real admission bookkeeping, `tir_rl.rollout.buffer.AdmissionSchedule`
(`LateGroups.WAIT`), and prints one row per k: trained groups per second, its ratio to k = 0,
how busy the engines and the trainer are, and how far sampled tokens lag the weights they are
trained from (never more than k).

    python bench/async_sim.py --scenario cpu                   # synthetic durations
    python bench/async_sim.py --scenario gpu8x8 --record run.json --ks 0,1,2 --json out.json
    python bench/async_sim.py --engines 4 --trainer-devices 4    # a pool of 4 servers

`--record` is a JSON file: lists `episode_s`, `train_s`, `sync_s` (seconds, resampled with
replacement) and ints `tasks_per_step`, `group_size`. Without one, synthetic durations stand
in: episodes lognormal with median 2 s and p99 20 s (heavy-tailed, like real tool calls),
updates lognormal with median 5 s (sigma 0.2), syncs 0.5 s flat, 8 tasks x 8 samples per step.

Scenarios (projections from the durations given, not measurements):
  cpu     1 inference engine, the trainer as measured, the batch as measured. It assumes the
          engine and the trainer do not slow each other down: true of separate devices, not
          of the 2-core CPU machine, where they share the cores.
  gpu8x8  "8 inference GPUs beside 8 trainer GPUs": 8 engines, each playing as many
          episodes at once as the measured one did, so a step has 8x the groups; the update
          of 8x the batch on 8x the devices takes the measured time (linear scaling); the
          sync as measured. `--tasks-per-step` sets another batch (the update time scales
          with it).
  --engines N, --trainer-devices M replace a scenario's counts (the batch grows with the
          engines, as in gpu8x8): the pool of N servers of docs/scale.md.

Assumptions:
  - An episode's duration is drawn from the episode distribution and does not depend on the
    load: an engine runs at most `concurrency` episodes at once (default tasks x group size,
    what a synchronous step keeps in flight, so the measured times stay valid), the others
    wait in one FIFO queue; a free slot goes to the least loaded engine.
  - A group is done when its last episode is; every group is trained on (WAIT).
  - A step trains for train_s / train_speedup (linear scaling over trainer GPUs), then syncs
    for sync_s; rollouts go on during both; the new weights reach every engine at once when
    the sync ends (then `advance_clock(t + 1)`), and the trainer may take the next step.
  - Every step makes one optimizer update (no degenerate steps), so the trainer's version at
    step t is t, and a token's version is the engine's clock when it was sampled; each
    episode samples 8 tokens evenly spread over its duration; lag = t - token version.
  - Durations are drawn per task index and per step from one seed, so every k replays the same
    draws (common random numbers): a ratio is a seed's own k-vs-0 comparison.
  - Makespan ends when the last step's sync does; trainer busy counts training, not syncs;
    an engine is busy while at least one episode runs on it.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tir_rl.rollout.buffer import AdmissionSchedule, GroupTicket, LateGroups

TOKENS_PER_EPISODE = 8
Z99 = 2.3263478740408408
"""The standard normal's 99th percentile (a lognormal's p99 is median * exp(Z99 * sigma))."""
SCENARIOS = {"cpu": (1, 1), "gpu8x8": (8, 8)}
"""Scenario -> (inference engines, trainer devices); the batch grows with the engines."""


@dataclass(frozen=True)
class Dist:
    """Durations in seconds: resampled from `values` if any, else lognormal(median, sigma)."""

    values: tuple[float, ...] = ()
    median: float = 1.0
    sigma: float = 0.0

    def draw(self, rng: random.Random) -> float:
        if self.values:
            return rng.choice(self.values)
        return self.median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else self.median


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is replayed: the duration distributions and the shape of a step."""

    episode_s: Dist
    train_s: Dist
    sync_s: Dist
    tasks_per_step: int
    group_size: int
    source: str


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The simulated cluster and run."""

    num_inference: int = 1
    concurrency: int = 64
    """Episodes at once per engine."""
    train_speedup: float = 1.0
    num_steps: int = 50


@dataclass
class Result:
    """One simulated run."""

    k: int
    makespan_s: float
    groups_per_s: float
    engine_busy: float
    trainer_busy: float
    lags: list[int]


def synthetic_workload() -> Workload:
    return Workload(
        episode_s=Dist(median=2.0, sigma=math.log(20.0 / 2.0) / Z99),
        train_s=Dist(median=5.0, sigma=0.2),
        sync_s=Dist(median=0.5),
        tasks_per_step=8,
        group_size=8,
        source="synthetic",
    )


def load_record(path: Path) -> Workload:
    data = json.loads(path.read_text())
    lists = {key: tuple(float(x) for x in data[key]) for key in ("episode_s", "train_s", "sync_s")}
    if not all(lists.values()):
        raise ValueError(f"{path}: episode_s, train_s and sync_s must be non-empty lists")
    return Workload(
        **{key: Dist(values=values) for key, values in lists.items()},
        tasks_per_step=int(data["tasks_per_step"]),
        group_size=int(data["group_size"]),
        source=str(path),
    )


def draw_durations(
    work: Workload, setup: Setup, seed: int
) -> tuple[list[list[float]], list[float], list[float]]:
    """Episode durations per task index (G each), then train_s and sync_s per step."""
    rng = random.Random(seed)
    b, g, num_steps = work.tasks_per_step, work.group_size, setup.num_steps
    episode_s = [[work.episode_s.draw(rng) for _ in range(g)] for _ in range(num_steps * b)]
    train_s = [work.train_s.draw(rng) / setup.train_speedup for _ in range(num_steps)]
    sync_s = [work.sync_s.draw(rng) for _ in range(num_steps)]
    return episode_s, train_s, sync_s


def simulate(work: Workload, setup: Setup, k: int, seed: int) -> Result:
    """Run producer, engines and trainer as events; see the module docstring."""
    b, g, num_steps = work.tasks_per_step, work.group_size, setup.num_steps
    episode_s, train_s, sync_s = draw_durations(work, setup, seed)

    schedule = AdmissionSchedule(
        groups_per_step=b, max_staleness=k, num_steps=num_steps, late_groups=LateGroups.WAIT
    )
    events: list[tuple[float, int, str, tuple]] = []
    order = itertools.count()
    queue: deque[tuple[GroupTicket, float]] = deque()
    load = [0] * setup.num_inference
    busy_since = [0.0] * setup.num_inference
    engine_busy_s = [0.0] * setup.num_inference
    episodes_left: dict[int, int] = {}
    token_versions: dict[int, list[int]] = {}
    version_start = [0.0]  # version_start[v]: when the engines began to hold version v
    lags: list[int] = []
    now, train_busy_s, trainer_free, makespan = 0.0, 0.0, True, 0.0

    def push(at: float, kind: str, payload: tuple) -> None:
        heapq.heappush(events, (at, next(order), kind, payload))

    def pump() -> None:
        nonlocal trainer_free, train_busy_s
        while (ticket := schedule.admit()) is not None:
            assert ticket.index < num_steps * b
            episodes_left[ticket.index] = g
            token_versions[ticket.index] = []
            queue.extend((ticket, duration) for duration in episode_s[ticket.index])
        while queue and min(load) < setup.concurrency:
            engine = load.index(min(load))
            ticket, duration = queue.popleft()
            if load[engine] == 0:
                busy_since[engine] = now
            load[engine] += 1
            push(now + duration, "episode", (engine, ticket, now, duration))
        if trainer_free and schedule.step < num_steps and schedule.ready():
            taken = schedule.take()
            for group in taken.groups:
                lags.extend(taken.step - v for v in group.trajectories)
            trainer_free = False
            train_busy_s += train_s[taken.step]
            push(now + train_s[taken.step], "trained", (taken.step,))

    pump()
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "episode":
            engine, ticket, start, duration = payload
            load[engine] -= 1
            if load[engine] == 0:
                engine_busy_s[engine] += now - busy_since[engine]
            for i in range(TOKENS_PER_EPISODE):
                sampled_at = start + (i + 0.5) / TOKENS_PER_EPISODE * duration
                version = bisect.bisect_right(version_start, sampled_at) - 1
                token_versions[ticket.index].append(version)
            episodes_left[ticket.index] -= 1
            if episodes_left[ticket.index] == 0:
                schedule.finish(ticket, token_versions.pop(ticket.index))
        elif kind == "trained":
            (step,) = payload
            push(now + sync_s[step], "synced", (step,))
        else:  # "synced": the engines hold the weights of step + 1 steps
            (step,) = payload
            version_start.append(now)
            schedule.advance_clock(step + 1)
            trainer_free = True
            makespan = now
        pump()

    assert schedule.step == num_steps and not queue and not any(load), "the run did not finish"
    assert all(0 <= lag <= k for lag in lags), "a token lags by more than k"
    return Result(
        k=k,
        makespan_s=makespan,
        groups_per_s=num_steps * b / makespan if makespan > 0 else math.inf,
        engine_busy=statistics.fmean(engine_busy_s) / makespan if makespan > 0 else 0.0,
        trainer_busy=train_busy_s / makespan if makespan > 0 else 0.0,
        lags=lags,
    )


def table(work: Workload, setup: Setup, ks: list[int], seeds: list[int]) -> list[dict]:
    """One row per k, averaged over seeds; the ratio is to k = 0 under the same seed."""
    runs = {(k, seed): simulate(work, setup, k, seed) for k in {0, *ks} for seed in seeds}
    rows = []
    for k in ks:
        results = [runs[k, seed] for seed in seeds]
        ratios = [runs[k, seed].groups_per_s / runs[0, seed].groups_per_s for seed in seeds]
        lags = [lag for r in results for lag in r.lags]
        rows.append(
            {
                "k": k,
                "groups_per_s": statistics.fmean(r.groups_per_s for r in results),
                "ratio": statistics.fmean(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "engine_busy": statistics.fmean(r.engine_busy for r in results),
                "trainer_busy": statistics.fmean(r.trainer_busy for r in results),
                "lag_mean": statistics.fmean(lags),
                "lag_max": max(lags),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| k | groups/s | ratio to k=0 (min-max) | engine busy | trainer busy"
        " | lag mean | lag max |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']} | {r['groups_per_s']:.3f} | {r['ratio']:.2f}"
            f" ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['engine_busy']:.0%}"
            f" | {r['trainer_busy']:.0%} | {r['lag_mean']:.2f} | {r['lag_max']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", type=Path, help="JSON of measured durations")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="cpu")
    parser.add_argument("--ks", default="0,1,2,4", help="staleness bounds, comma-separated")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--concurrency", type=int, help="per engine (default tasks x group)")
    parser.add_argument("--tasks-per-step", type=int, help="override the record's")
    parser.add_argument(
        "--engines", type=int, help="inference servers of the pool (overrides the scenario's)"
    )
    parser.add_argument(
        "--trainer-devices", type=int, help="trainer devices (overrides the scenario's)"
    )
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()

    work = load_record(args.record) if args.record else synthetic_workload()
    num_inference, train_devices = SCENARIOS[args.scenario]
    num_inference = args.engines or num_inference
    train_devices = args.trainer_devices or train_devices
    measured_load = work.tasks_per_step * work.group_size  # episodes at once, as measured
    tasks_per_step = args.tasks_per_step or work.tasks_per_step * num_inference
    batch_scale = tasks_per_step / work.tasks_per_step
    work = replace(work, tasks_per_step=tasks_per_step)
    setup = Setup(
        num_inference=num_inference,
        concurrency=args.concurrency or measured_load,
        train_speedup=train_devices / batch_scale,  # the update grows with the batch
        num_steps=args.steps,
    )
    ks = [int(k) for k in args.ks.split(",")]
    rows = table(work, setup, ks, list(range(args.seeds)))

    print(f"Projection (not a measurement), scenario {args.scenario}, durations: {work.source}")
    print(f"{work.tasks_per_step} tasks x {work.group_size} samples per step, {asdict(setup)}")
    print(f"seeds 0..{args.seeds - 1}; assumptions:")
    print(__doc__.split("Assumptions:\n")[1].rstrip() + "\n")
    print(markdown(rows))
    if args.json:
        payload = {"scenario": args.scenario, "source": work.source, "setup": asdict(setup)}
        args.json.write_text(json.dumps({**payload, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
