"""Evaluation statistics: unbiased pass@k with confidence intervals, and the `EvalReport`.

pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): for a task with n samples of which c are correct,

    pass@k = 1 − C(n − c, k) / C(n, k)

computed as a stable product, then averaged over tasks. A sample counts as correct when its
reward is at least `success_threshold` (1.0 by default: rewards with format shaping below 1
do not count).

Confidence intervals (95% by default) come from a percentile bootstrap over *tasks*: tasks
are resampled with replacement and the per-task estimates re-averaged, `num_bootstrap`
times, with a fixed seed so a report is reproducible. Resampling tasks (not samples) is what
captures the variance that matters: which problems the model can solve. With a single task
the interval degenerates to the point estimate; for one sample per task pass@1 is a plain
proportion and the `wilson_interval` helper gives the textbook alternative.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from tir_rl.report.run_log import finite_or_none
from tir_rl.types import Role, RolloutStatus, Trajectory, one_per_episode

DEFAULT_NUM_BOOTSTRAP = 1000
DEFAULT_SEED = 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples (drawn from n) is correct.

    Args:
        n: Samples drawn for the task.
        c: Correct samples among them.
        k: Budget; must satisfy 1 <= k <= n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


@dataclass(frozen=True)
class Estimate:
    """A mean with its confidence interval."""

    value: float
    low: float
    high: float
    confidence: float = 0.95

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap_mean(
    per_task: Sequence[float],
    *,
    confidence: float = 0.95,
    num_bootstrap: int = DEFAULT_NUM_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
) -> Estimate:
    """Mean of `per_task` with a percentile bootstrap interval over tasks (fixed seed)."""
    if not per_task:
        raise ValueError("bootstrap_mean needs at least one task")
    n = len(per_task)
    mean = sum(per_task) / n
    rng = random.Random(seed)
    means = [sum(rng.choices(per_task, k=n)) / n for _ in range(num_bootstrap)]
    return _percentile_interval(mean, means, confidence)


def _percentile_interval(mean: float, means: list[float], confidence: float) -> Estimate:
    """`mean` with the percentile interval of its bootstrap replicates `means`."""
    means = sorted(means)
    alpha = (1.0 - confidence) / 2
    low = means[int(math.floor(alpha * (len(means) - 1)))]
    high = means[int(math.ceil((1.0 - alpha) * (len(means) - 1)))]
    # Percentile bounds can miss the mean by float noise on degenerate data; keep it inside.
    return Estimate(mean, min(low, mean), max(high, mean), confidence)


def bootstrap_paired_change(
    before: Sequence[float],
    after: Sequence[float],
    *,
    confidence: float = 0.95,
    num_bootstrap: int = DEFAULT_NUM_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
) -> Estimate:
    """Mean of `after[j] - before[j]` over tasks, with a bootstrap interval over tasks.

    Both evaluations scored the same tasks in the same order, so each task is its own control:
    how hard a task is cancels out of its difference, and the interval of the change is
    narrower than the two marginal intervals suggest. The question "did this run improve the
    policy?" is whether this interval lies above 0, not whether `bootstrap_mean`'s intervals of
    before and after are disjoint (a stricter and far less powerful test).

    Raises:
        ValueError: no tasks, or the two evaluations scored different numbers of tasks.
    """
    if len(before) != len(after):
        raise ValueError(
            f"a paired change needs the same tasks before and after; got {len(before)} tasks "
            f"before and {len(after)} after"
        )
    return bootstrap_mean(
        [a - b for b, a in zip(before, after, strict=True)],
        confidence=confidence,
        num_bootstrap=num_bootstrap,
        seed=seed,
    )


def bootstrap_seeds_and_tasks(
    per_seed_per_task: Sequence[Sequence[float]],
    *,
    confidence: float = 0.95,
    num_bootstrap: int = DEFAULT_NUM_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
) -> Estimate:
    """Mean over runs (seeds) and tasks, with an interval that resamples both.

    `per_seed_per_task[i][j]` is run i's score on task j; every run scored the same tasks in
    the same order. Each bootstrap draw resamples the runs and, independently, the tasks, so
    the interval carries the spread between seeds as well as which tasks were held out. With
    one run it equals `bootstrap_mean` over that run's tasks.

    Raises:
        ValueError: no runs, no tasks, or runs of different lengths.
    """
    rows = [list(r) for r in per_seed_per_task]
    if not rows or not rows[0]:
        raise ValueError("bootstrap_seeds_and_tasks needs at least one run and one task")
    if len({len(r) for r in rows}) != 1:
        raise ValueError(
            f"every run must score the same tasks; got {sorted({len(r) for r in rows})} tasks"
        )
    if len(rows) == 1:
        return bootstrap_mean(
            rows[0], confidence=confidence, num_bootstrap=num_bootstrap, seed=seed
        )
    num_runs, num_tasks = len(rows), len(rows[0])
    mean = sum(map(sum, rows)) / (num_runs * num_tasks)
    rng = random.Random(seed)
    means = []
    for _ in range(num_bootstrap):
        picked_runs = rng.choices(range(num_runs), k=num_runs)
        picked_tasks = rng.choices(range(num_tasks), k=num_tasks)
        total = sum(rows[i][j] for i in picked_runs for j in picked_tasks)
        means.append(total / (num_runs * num_tasks))
    return _percentile_interval(mean, means, confidence)


def wilson_interval(successes: int, trials: int, *, confidence: float = 0.95) -> Estimate:
    """Wilson score interval of a proportion (for pass@1 with independent samples)."""
    if trials <= 0 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials > 0, got {successes}/{trials}")
    z = _normal_quantile(1 - (1 - confidence) / 2)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    # At p = 0 or 1 the bound equals p analytically; clamp so float noise cannot exclude it.
    low = min(p, max(0.0, centre - half))
    high = max(p, min(1.0, centre + half))
    return Estimate(p, low, high, confidence)


def _normal_quantile(q: float) -> float:
    """Inverse standard normal CDF by bisection on erf (no scipy needed)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class EvalSampling:
    """How the evaluated episodes were sampled.

    The run's `rollout` settings; an evaluation may sample otherwise than training
    (`tir-rl eval --set rollout.temperature=0.6 --set rollout.top_p=0.95`).
    """

    temperature: float
    top_p: float = 1.0
    top_k: int | None = None
    """None: off."""
    min_p: float = 0.0

    def describe(self) -> str:
        """One line, as the eval table prints it."""
        top_k = "off" if self.top_k is None else str(self.top_k)
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {top_k}, "
            f"min_p {self.min_p:g}"
        )


@dataclass
class EvalReport:
    """Result of evaluating a policy on one environment split."""

    env_id: str
    split: str
    num_tasks: int
    samples_per_task: int
    """Samples per task (the minimum over tasks if they differ); the largest usable k."""
    k: int
    pass_at_1: Estimate
    pass_at_k: Estimate
    mean_reward: float
    mean_turns: float
    """Assistant turns per episode."""
    mean_tool_calls: float
    tool_error_rate: float
    """Failed tool calls / all tool calls (0 when no tool was called)."""
    status_counts: dict[str, int] = field(default_factory=dict)
    """Episodes per `RolloutStatus` value (every status listed, zeros included)."""
    wall_time_s: float = 0.0
    success_threshold: float = 1.0
    num_bootstrap: int = DEFAULT_NUM_BOOTSTRAP
    task_pass_at_1: list[float] = field(default_factory=list)
    """pass@1 of each task, in task (group id) order: what pools runs that evaluated the same
    tasks (`bootstrap_seeds_and_tasks`)."""
    sampling: EvalSampling | None = None
    """How the episodes were sampled (None: not stated by the caller)."""

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)

    def to_json(self) -> str:
        """Indented JSON (non-finite numbers as null)."""
        return json.dumps(finite_or_none(self.to_dict()), indent=2, allow_nan=False)


def build_report(
    trajectories: Iterable[Trajectory],
    *,
    env_id: str,
    split: str,
    k: int,
    wall_time_s: float = 0.0,
    success_threshold: float = 1.0,
    confidence: float = 0.95,
    num_bootstrap: int = DEFAULT_NUM_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
    sampling: EvalSampling | None = None,
) -> EvalReport:
    """Group trajectories by `group_id` (one group per task) and summarise them.

    Raises:
        ValueError: no trajectories, or `k` larger than the samples of some task.
    """
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("build_report needs at least one trajectory")
    groups: dict[int, list[Trajectory]] = defaultdict(list)
    for t in one_per_episode(trajectories):  # an agent episode's samples count once
        groups[t.group_id].append(t)
    samples = min(len(g) for g in groups.values())
    if not 1 <= k <= samples:
        raise ValueError(
            f"k={k} needs at least k samples per task, but a task has only {samples}: "
            f"sample more per task or lower k"
        )
    ordered = [groups[g] for g in sorted(groups)]
    correct = [sum(t.reward >= success_threshold for t in g) for g in ordered]
    sizes = [len(g) for g in ordered]

    def per_task(budget: int) -> list[float]:
        return [pass_at_k(n, c, budget) for n, c in zip(sizes, correct, strict=True)]

    def estimate(scores: list[float]) -> Estimate:
        return bootstrap_mean(scores, confidence=confidence, num_bootstrap=num_bootstrap, seed=seed)

    at_1 = per_task(1)

    episodes = one_per_episode(trajectories)
    num = len(episodes)  # per episode; an agent episode's samples add their turns and calls
    num_calls = sum(t.num_tool_calls for t in trajectories)
    statuses = Counter(str(t.status) for t in episodes)
    return EvalReport(
        env_id=env_id,
        split=split,
        num_tasks=len(groups),
        samples_per_task=samples,
        k=k,
        pass_at_1=estimate(at_1),
        pass_at_k=estimate(at_1 if k == 1 else per_task(k)),
        mean_reward=sum(t.reward for t in episodes) / num,
        mean_turns=sum(num_turns(t) for t in trajectories) / num,
        mean_tool_calls=num_calls / num,
        tool_error_rate=sum(t.num_tool_errors for t in trajectories) / num_calls
        if num_calls
        else 0.0,
        status_counts={s.value: statuses.get(s.value, 0) for s in RolloutStatus},
        wall_time_s=wall_time_s,
        success_threshold=success_threshold,
        num_bootstrap=num_bootstrap,
        task_pass_at_1=at_1,
        sampling=sampling,
    )


def num_turns(trajectory: Trajectory) -> int:
    """Assistant turns of an episode (from its messages, else from its turn ids)."""
    from_messages = sum(m.role == Role.ASSISTANT for m in trajectory.messages)
    if from_messages:
        return from_messages
    model_turns = {t for t, m in zip(trajectory.turn_ids, trajectory.loss_mask, strict=True) if m}
    return len(model_turns)


def format_table(report: EvalReport) -> str:
    """A one-screen text summary of `report`."""
    pct = int(round(report.pass_at_1.confidence * 100))
    lines = [
        f"Evaluation: {report.env_id}  split={report.split}",
        f"  tasks {report.num_tasks} x {report.samples_per_task} samples"
        f"   wall {report.wall_time_s:.1f} s",
        *([f"  sampling: {report.sampling.describe()}"] if report.sampling else []),
        "",
        f"  {'metric':<18}{'value':>9}   {pct}% CI (bootstrap over tasks)",
        f"  {'pass@1':<18}{report.pass_at_1.value:>9.3f}   "
        f"[{report.pass_at_1.low:.3f}, {report.pass_at_1.high:.3f}]",
    ]
    if report.k != 1:
        lines.append(
            f"  {f'pass@{report.k}':<18}{report.pass_at_k.value:>9.3f}   "
            f"[{report.pass_at_k.low:.3f}, {report.pass_at_k.high:.3f}]"
        )
    lines += [
        f"  {'mean reward':<18}{report.mean_reward:>9.3f}",
        f"  {'mean turns':<18}{report.mean_turns:>9.2f}",
        f"  {'mean tool calls':<18}{report.mean_tool_calls:>9.2f}",
        f"  {'tool error rate':<18}{report.tool_error_rate:>9.3f}",
        "",
        "  status counts:",
    ]
    nonzero = {s: n for s, n in report.status_counts.items() if n}
    for status, count in sorted(nonzero.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {status:<24}{count:>6}")
    return "\n".join(lines)


def describe_change(
    what: str,
    before: Estimate | None,
    after: Estimate | None,
    change: Estimate | None = None,
) -> str:
    """One line: `what` before -> after with intervals, and the change.

    With `change` (the paired difference over the same tasks, `bootstrap_paired_change`) the
    line gives its interval; without it, whether the two marginal intervals overlap.
    """
    if before is None or after is None:
        shown = [
            f"{name} {e}" for name, e in (("before", before), ("after", after)) if e is not None
        ]
        return f"{what}: " + (", ".join(shown) if shown else "not measured")
    if change is not None:
        return (
            f"{what}: {before} -> {after} (change {change.value:+.3f} "
            f"[{change.low:+.3f}, {change.high:+.3f}], paired over the same tasks)"
        )
    apart = after.low > before.high or after.high < before.low
    pct = int(round(after.confidence * 100))
    return (
        f"{what}: {before} -> {after} (change {after.value - before.value:+.3f}; the {pct}% "
        f"intervals {'do not overlap' if apart else 'overlap'})"
    )
