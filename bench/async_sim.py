"""Projected throughput of asynchronous RL (staleness bound k) against the synchronous loops.

A seeded discrete-event simulation (seconds to run) that replays episode, update and weight-sync
durations through the real admission bookkeeping, `tir_rl.rollout.buffer.AdmissionSchedule`
(`LateGroups.WAIT`), and prints one row per loop: first the colocated synchronous loop users
run (every device samples, then every device trains), then k = 0, 1, ... with the engines and
the trainer on separate devices. Per row: trained groups per second, its ratio to separate
k = 0 and to colocated k = 0 (same seed), how busy the engines and the trainer are, and how far
sampled tokens lag the weights they are trained from (never more than k).

    python bench/async_sim.py --scenario cpu                   # synthetic durations
    python bench/async_sim.py --scenario gpu8x8 --record run.json --ks 0,1,2 --json out.json
    python bench/async_sim.py --engines 4 --trainer-devices 4    # a pool of 4 servers
    python bench/async_sim.py --scenario gpu8x8 --record run.json \\
        --curve bench/engine_concurrency_records/bundled.json  # episodes share their engine
    python bench/async_sim.py --this-machine lab    # predicted vs measured, split cores here

`--record` is a JSON file: lists `episode_s`, `train_s`, `sync_s` (seconds, resampled with
replacement) and ints `tasks_per_step`, `group_size`. Without one, synthetic durations stand
in: episodes lognormal with median 2 s and p99 20 s (heavy-tailed, like real tool calls),
updates lognormal with median 5 s (sigma 0.2), syncs 0.5 s flat, 8 tasks x 8 samples per step.
`--curve` is `bench/engine_concurrency.py --json`'s output: an engine's total decode
tokens/s at each number of sequences it runs at once.

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
  - Without a curve an episode's duration is drawn from the episode distribution and does
    not depend on the load. With one, the drawn duration is its work at the load it was
    measured at (tasks x group size per engine) and the episodes on an engine share it
    (processor sharing): each runs at the curve's per-sequence speed for the engine's
    current load, so a step's tail of a few episodes runs faster per episode and slower in
    all. Tool time counts as engine work too (the records do not separate it), which
    overstates how much a lighter load speeds up a tool-heavy episode.
  - An engine runs at most `concurrency` episodes at once (default tasks x group size, what
    a synchronous step keeps in flight), the others wait in one FIFO queue; a free slot goes
    to the least loaded engine.
  - A group is done when its last episode is; every group is trained on (WAIT).
  - A step trains for train_s / train_speedup (linear scaling over trainer devices), then
    syncs for sync_s; rollouts go on during both; the new weights reach every engine at once
    when the sync ends (then `advance_clock(t + 1)`), and the trainer may take the next step.
  - The colocated loop is k = 0 on engines + trainer devices engines (the step's batch spread
    over all of them), whose update runs on all of them (linear scaling again) and whose
    weight reload takes sync_s; a device never samples and trains at once, so nothing
    contends.
  - Every step makes one optimizer update (no degenerate steps), so the trainer's version at
    step t is t, and a token's version is the engine's clock when it was sampled; each
    episode samples 8 tokens evenly spread over its duration; lag = t - token version.
  - Durations are drawn per task index and per step from one seed, so every loop and k
    replays the same draws (common random numbers): a ratio is a seed's own comparison.
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
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class ThroughputCurve:
    """An engine's total decode tokens/s by the number of sequences it runs at once, as
    `bench/engine_concurrency.py` measures it: (concurrency, tokens/s) in increasing order."""

    points: tuple[tuple[int, float], ...]
    source: str

    def total(self, load: int) -> float:
        """Tokens/s at `load` sequences: linear between measured loads, through (0, 0) below
        the first, flat above the last (the engine is saturated)."""
        loads = [c for c, _ in self.points]
        if load >= loads[-1]:
            return self.points[-1][1]
        i = bisect.bisect_left(loads, load)
        if loads[i] == load:
            return self.points[i][1]
        (c0, r0), (c1, r1) = ((0, 0.0), self.points[0]) if i == 0 else self.points[i - 1 : i + 1]
        return r0 + (r1 - r0) * (load - c0) / (c1 - c0)

    def speed(self, load: int, reference: int) -> float:
        """How fast one sequence runs at `load` relative to at `reference` (per-sequence
        tokens/s ratio)."""
        return (self.total(load) / load) / (self.total(reference) / reference)


def load_curve(path: Path) -> ThroughputCurve:
    data = json.loads(path.read_text())
    points = tuple(sorted((int(r["concurrency"]), float(r["tokens_per_s"])) for r in data["rows"]))
    if not points or any(rate <= 0 for _, rate in points):
        raise ValueError(f"{path}: rows must hold positive tokens_per_s")
    return ThroughputCurve(points=points, source=str(path))


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The simulated cluster and run."""

    num_inference: int = 1
    concurrency: int = 64
    """Episodes at once per engine."""
    train_speedup: float = 1.0
    num_steps: int = 50
    curve: ThroughputCurve | None = None
    """With a curve, episodes share their engine (processor sharing): each runs at the
    curve's per-sequence speed for the engine's current load, relative to `reference_load`,
    the load its measured duration was taken at. None: a duration does not depend on load."""
    reference_load: int = 64


@dataclass
class Result:
    """One simulated run."""

    k: int
    makespan_s: float
    groups_per_s: float
    engine_busy: float
    trainer_busy: float
    lags: list[int]


def colocated(setup: Setup, trainer_devices: int) -> Setup:
    """The synchronous loop users run on the same devices: every device serves as an engine
    while a step samples (the step's batch spread over engines + trainer devices), then every
    device trains (the update on all of them, linear scaling), then the weights reload."""
    devices = setup.num_inference + trainer_devices
    return replace(
        setup,
        num_inference=devices,
        train_speedup=setup.train_speedup * devices / trainer_devices,
    )


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
    return _workload(json.loads(path.read_text()), str(path))


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


class _Engines:
    """Engines that share their speed among the episodes they run (processor sharing).

    An engine's `service` grows at the per-sequence speed of its current load; an episode of
    `work` seconds (at the reference load) started at service S ends when service reaches
    S + work. All of an engine's episodes run at the same speed, so they end in that order.
    """

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        n = setup.num_inference
        self.service = [0.0] * n
        self.running: list[list[tuple[float, int, tuple]]] = [[] for _ in range(n)]
        self.busy_s = [0.0] * n
        self._order = itertools.count()

    def load(self, engine: int) -> int:
        return len(self.running[engine])

    def speed(self, engine: int) -> float:
        curve = self.setup.curve
        load = self.load(engine)
        return 1.0 if curve is None or load == 0 else curve.speed(load, self.setup.reference_load)

    def start(self, engine: int, work: float, payload: tuple) -> None:
        heapq.heappush(
            self.running[engine], (self.service[engine] + work, next(self._order), payload)
        )

    def next_end(self, now: float) -> tuple[float, int]:
        """When the next episode ends, and on which engine (inf when none runs)."""
        best = (math.inf, -1)
        for engine, running in enumerate(self.running):
            if running:
                at = now + max(0.0, running[0][0] - self.service[engine]) / self.speed(engine)
                best = min(best, (at, engine))
        return best

    def advance(self, elapsed: float) -> None:
        for engine, running in enumerate(self.running):
            if running:
                self.service[engine] += elapsed * self.speed(engine)
                self.busy_s[engine] += elapsed

    def finish(self, engine: int) -> tuple:
        target, _, payload = heapq.heappop(self.running[engine])
        self.service[engine] = max(self.service[engine], target)
        return payload


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
    engines = _Engines(setup)
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
        loads = [engines.load(e) for e in range(setup.num_inference)]
        while queue and min(loads) < setup.concurrency:
            engine = loads.index(min(loads))
            ticket, duration = queue.popleft()
            loads[engine] += 1
            engines.start(engine, duration, (ticket, now))
        if trainer_free and schedule.step < num_steps and schedule.ready():
            taken = schedule.take()
            for group in taken.groups:
                lags.extend(taken.step - v for v in group.trajectories)
            trainer_free = False
            train_busy_s += train_s[taken.step]
            push(now + train_s[taken.step], "trained", (taken.step,))

    pump()
    while True:
        ends_at, engine = engines.next_end(now)
        event_at = events[0][0] if events else math.inf
        if ends_at == event_at == math.inf:
            break
        at = min(ends_at, event_at)
        engines.advance(at - now)
        now = at
        if ends_at <= event_at:
            ticket, start = engines.finish(engine)
            for i in range(TOKENS_PER_EPISODE):
                sampled_at = start + (i + 0.5) / TOKENS_PER_EPISODE * (now - start)
                version = bisect.bisect_right(version_start, sampled_at) - 1
                token_versions[ticket.index].append(version)
            episodes_left[ticket.index] -= 1
            if episodes_left[ticket.index] == 0:
                schedule.finish(ticket, token_versions.pop(ticket.index))
        else:
            _, _, kind, (step,) = heapq.heappop(events)
            if kind == "trained":
                push(now + sync_s[step], "synced", (step,))
            else:  # "synced": the engines hold the weights of step + 1 steps
                version_start.append(now)
                schedule.advance_clock(step + 1)
                trainer_free = True
                makespan = now
        pump()

    assert schedule.step == num_steps and not queue, "the run did not finish"
    assert not any(engines.running), "an episode is still running"
    assert all(0 <= lag <= k for lag in lags), "a token lags by more than k"
    return Result(
        k=k,
        makespan_s=makespan,
        groups_per_s=num_steps * b / makespan if makespan > 0 else math.inf,
        engine_busy=statistics.fmean(engines.busy_s) / makespan if makespan > 0 else 0.0,
        trainer_busy=train_busy_s / makespan if makespan > 0 else 0.0,
        lags=lags,
    )


def table(
    work: Workload,
    setup: Setup,
    ks: list[int],
    seeds: list[int],
    *,
    trainer_devices: int | None = None,
) -> list[dict]:
    """One row per k, averaged over seeds; ratios are to k = 0 under the same seed. With
    `trainer_devices`, a first row is the colocated loop on engines + trainer devices, and
    every row's `vs_colocated` is its ratio to that row under the same seed."""
    runs = {(k, seed): simulate(work, setup, k, seed) for k in {0, *ks} for seed in seeds}
    baseline = {}
    if trainer_devices is not None:
        together = colocated(setup, trainer_devices)
        baseline = {seed: simulate(work, together, 0, seed) for seed in seeds}

    def row(k: int, loop: str, results: list[Result], reference: list[Result]) -> dict:
        ratios = [
            r.groups_per_s / ref.groups_per_s for r, ref in zip(results, reference, strict=True)
        ]
        lags = [lag for r in results for lag in r.lags]
        out = {
            "k": k,
            "loop": loop,
            "groups_per_s": statistics.fmean(r.groups_per_s for r in results),
            "ratio": statistics.fmean(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "engine_busy": statistics.fmean(r.engine_busy for r in results),
            "trainer_busy": statistics.fmean(r.trainer_busy for r in results),
            "lag_mean": statistics.fmean(lags),
            "lag_max": max(lags),
        }
        if baseline:
            vs = [
                r.groups_per_s / baseline[seed].groups_per_s
                for r, seed in zip(results, seeds, strict=True)
            ]
            out |= {"vs_colocated": statistics.fmean(vs), "vs_colocated_min": min(vs),
                    "vs_colocated_max": max(vs)}  # fmt: skip
        return out

    k0 = [runs[0, seed] for seed in seeds]
    rows = [row(0, "colocated", [baseline[s] for s in seeds], k0)] if baseline else []
    rows += [row(k, "separate", [runs[k, seed] for seed in seeds], k0) for k in ks]
    return rows


def markdown(rows: list[dict]) -> str:
    colocated_column = "vs_colocated" in rows[0]
    lines = [
        "| loop | k | groups/s | ratio to k=0 (min-max)"
        + (" | ratio to colocated k=0 (min-max)" if colocated_column else "")
        + " | engine busy | trainer busy | lag mean | lag max |",
        "|---|---|---|---|" + ("---|" if colocated_column else "") + "---|---|---|---|",
    ]
    for r in rows:
        vs = ""
        if colocated_column:
            vs = (
                f" | {r['vs_colocated']:.2f} ({r['vs_colocated_min']:.2f}"
                f"-{r['vs_colocated_max']:.2f})"
            )
        lines.append(
            f"| {r['loop']} | {r['k']} | {r['groups_per_s']:.3f} | {r['ratio']:.2f}"
            f" ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}){vs} | {r['engine_busy']:.0%}"
            f" | {r['trainer_busy']:.0%} | {r['lag_mean']:.2f} | {r['lag_max']} |"
        )
    return "\n".join(lines)


SPLIT_RESULTS = Path(__file__).resolve().parent / "async" / "results"
CURVES = Path(__file__).resolve().parent / "engine_concurrency_records"


def this_machine(setting: str, *, both_cores: Path, one_core: Path) -> str:
    """The simulation's prediction for the split-core runs of `bench/async_rl.py
    --placement split`, next to what they measured, seed by seed.

    Colocated k = 0 replays its own record (durations on both cores) with the engine's
    both-core curve; the split runs replay split k = 0's record (the engine on one core, the
    trainer on the other, never overlapping) with the one-core curve, at each k. Each run
    simulates as many steps as colocated k = 0 trained; measured groups/s are the steps'
    groups over their wall time (evaluations excluded).
    """
    folder = SPLIT_RESULTS / f"{setting}_split"
    curves = {"colocated": load_curve(both_cores), "split": load_curve(one_core)}
    lines = [
        f"### {setting}: split cores, simulated against measured (groups/s; ratio to "
        "colocated k=0, same seed)",
        "",
        "| seed | loop | k | simulated groups/s | measured groups/s | simulated ratio "
        "| measured ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for base_path in sorted(folder.glob("k0_seed*.json")):
        base = json.loads(base_path.read_text())
        seed, steps = base["seed"], base["steps_done"]
        runs = [("colocated", 0, base, base)]
        split_base_path = folder / f"split_k0_seed{seed}.json"
        if not split_base_path.exists():
            continue
        split_base = json.loads(split_base_path.read_text())
        for path in sorted(folder.glob(f"split_k*_seed{seed}.json")):
            record = json.loads(path.read_text())
            runs.append(("split", record["k"], record, split_base))
        simulated, measured = {}, {}
        for loop, k, record, durations in runs:
            work = _workload(durations, str(base_path))
            setup = Setup(
                concurrency=work.tasks_per_step * work.group_size,
                reference_load=work.tasks_per_step * work.group_size,
                curve=curves[loop],
                num_steps=steps,
            )
            simulated[loop, k] = simulate(work, setup, k, seed).groups_per_s
            wall = sum(s["perf/step_s"] for s in record["steps"])
            measured[loop, k] = len(record["steps"]) * record["tasks_per_step"] / wall
        for loop, k, _, _ in runs:
            lines.append(
                f"| {seed} | {loop} | {k} | {simulated[loop, k]:.3f} | {measured[loop, k]:.3f} "
                f"| {simulated[loop, k] / simulated['colocated', 0]:.2f} "
                f"| {measured[loop, k] / measured['colocated', 0]:.2f} |"
            )
    return "\n".join(lines)


def _workload(record: dict, source: str) -> Workload:
    lists = {
        key: tuple(float(x) for x in record[key]) for key in ("episode_s", "train_s", "sync_s")
    }
    if not all(lists.values()):
        raise ValueError(f"{source}: episode_s, train_s and sync_s must be non-empty lists")
    return Workload(
        **{key: Dist(values=values) for key, values in lists.items()},
        tasks_per_step=int(record["tasks_per_step"]),
        group_size=int(record["group_size"]),
        source=source,
    )


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
    parser.add_argument(
        "--curve",
        type=Path,
        help="an engine's tokens/s by concurrency (bench/engine_concurrency.py --json): "
        "episodes then share their engine; without one their durations ignore the load",
    )
    parser.add_argument(
        "--this-machine",
        metavar="SETTING",
        help="instead: predict bench/async_rl.py's split-core runs of SETTING from their "
        "k = 0 records and compare with what they measured",
    )
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()

    if args.this_machine:
        # bench/async_rl.py trains configs/lab.yaml's model, "lab"
        both, one = CURVES / "lab.json", CURVES / "lab_core0.json"
        print(this_machine(args.this_machine, both_cores=both, one_core=one))
        return
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
        curve=load_curve(args.curve) if args.curve else None,
        reference_load=measured_load,
    )
    ks = [int(k) for k in args.ks.split(",")]
    rows = table(work, setup, ks, list(range(args.seeds)), trainer_devices=train_devices)

    print(f"Projection (not a measurement), scenario {args.scenario}, durations: {work.source}")
    curve = setup.curve.source if setup.curve else "none (durations ignore the load)"
    print(
        f"{work.tasks_per_step} tasks x {work.group_size} samples per step, "
        f"{num_inference} engine(s), {train_devices} trainer device(s), "
        f"at most {setup.concurrency} episodes per engine, engine curve: {curve}"
    )
    print(f"seeds 0..{args.seeds - 1}; assumptions:")
    print(__doc__.split("Assumptions:\n")[1].rstrip() + "\n")
    print(markdown(rows))
    if args.json:
        payload = {"scenario": args.scenario, "source": work.source, "curve": curve,
                   "engines": num_inference, "trainer_devices": train_devices}  # fmt: skip
        args.json.write_text(json.dumps({**payload, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
