"""Judge, plot and tabulate the runs of a collapse-lab folder.

    python bench/collapse/report.py runs/collapse [--plots docs/collapse]

Runs are the sub-folders `<setting>_s<seed>` holding a `metrics.jsonl` (or the kept `.gz`). Each
run is judged with `verdict.judge_run` from this folder (collapse = gradient-norm spike and/or
lasting reward drop; see `verdict.py`). Prints two markdown tables (also written to `report.md`
in the runs folder): one row per setting, seeds pooled; one row per run with its reward at every
step (block means for long runs) and its entropy first → last; and, when runs evaluated during
training, one row per run with its held-out pass@1 at every evaluation. Writes PNG plots, one
line per setting (mean over seeds, a band from the lowest to the highest seed).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collapse_lab.settings import CORRECTIONS
from collapse_lab.verdict import CollapseVerdict, judge_run, values_by_step
from tir_rl.report.eval_stats import (
    Estimate,
    bootstrap_paired_change,
    bootstrap_seeds_and_tasks,
)
from tir_rl.report.run_log import METRICS_FILE, read_metrics, run_file

_RUN = re.compile(r"^(?P<setting>.+)_s(?P<seed>\d+)$")
_TURN = re.compile(r"^mismatch/turn_(\d+)/k3_kl$")
_TOOL_DIST = re.compile(r"^mismatch/tool_dist_[^/]+/k3_kl$")
ORDER = ("no_mismatch", "uncorrected", *CORRECTIONS)
LOG_FLOOR = 1e-7
HELDOUT = "eval/pass_at_1"
CLEAN_HELDOUT = "eval_clean/pass_at_1"
REJECTED = ("token", "turn", "seq")
"""What a correction rejects, each logged as `masked_key(what)`."""


def masked_key(what: str) -> str:
    """The metric holding the fraction of `what` (one of `REJECTED`) a correction masked."""
    return f"mismatch/correction/masked_{what}_fraction"


@dataclass
class Run:
    setting: str
    seed: int
    rows: list[dict[str, Any]]
    verdict: CollapseVerdict
    folder: Path


def load_runs(root: Path) -> list[Run]:
    """Every finished or partial run under `root`, judged."""
    runs = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        match = _RUN.match(folder.name)
        metrics = run_file(folder, METRICS_FILE)
        if match is None or metrics is None:
            continue
        rows = read_metrics(metrics)
        runs.append(Run(match["setting"], int(match["seed"]), rows, judge_run(rows), folder))
    return runs


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def _by_setting(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs grouped by setting (one list of seeds each)."""
    grouped: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        grouped[run.setting].append(run)
    return grouped


def _heldout_prefix(run: Run) -> str:
    """`eval_clean` when the run evaluated with a clean sampler, else `eval` (its own)."""
    return "eval_clean" if values_by_step(run.rows, CLEAN_HELDOUT) else "eval"


def _heldout(run: Run) -> dict[int, float]:
    """The run's held-out pass@1 by step, clean sampler where it has one."""
    return values_by_step(run.rows, f"{_heldout_prefix(run)}/pass_at_1")


def _longest(runs: list[Run]) -> int:
    """The most training steps any run logged."""
    return max((len(values_by_step(r.rows, "rollout/reward_mean")) for r in runs), default=0)


def table(runs: list[Run]) -> str:
    """One markdown row per setting (seeds pooled)."""
    by_setting = _by_setting(runs)
    header = (
        "| setting | collapsed | collapse step | first guard alert | alert lead | "
        "reward peak → final | held-out before → after | clean sampler before → after | "
        "mean k3 KL | max grad norm | masked tokens |\n" + "|---" * 11 + "|"
    )
    lines = [header]
    for setting in _ordered(by_setting):
        group = by_setting[setting]
        verdicts = [r.verdict for r in group]
        collapsed = sum(v.collapsed for v in verdicts)
        steps = [str(v.collapse_step) for v in verdicts if v.collapse_step is not None]
        alerts = [str(v.first_alert_step) for v in verdicts if v.first_alert_step is not None]
        leads = [str(v.alert_lead_steps) for v in verdicts if v.alert_lead_steps is not None]
        k3 = _mean([_mean(list(values_by_step(r.rows, "mismatch/k3_kl").values())) for r in group])
        grad = max((max(values_by_step(r.rows, "train/grad_norm").values(), default=math.nan)
                    for r in group), default=math.nan)  # fmt: skip
        masked = _mean(
            [_mean(list(values_by_step(r.rows, masked_key("token")).values())) for r in group]
        )
        before = _mean([v.heldout_before for v in verdicts if v.heldout_before is not None])
        after = _mean([v.heldout_after for v in verdicts if v.heldout_after is not None])
        clean = [values_by_step(r.rows, "eval_clean/pass_at_1") for r in group]
        clean_before = _mean([c[min(c)] for c in clean if c])
        clean_after = _mean([c[max(c)] for c in clean if len(c) > 1])
        lines.append(
            f"| {setting} | {collapsed}/{len(group)} | {', '.join(steps) or '–'} | "
            f"{', '.join(alerts) or '–'} | {', '.join(leads) or '–'} | "
            f"{_mean([v.peak_reward for v in verdicts]):.3f} → "
            f"{_mean([v.final_reward for v in verdicts]):.3f} | "
            f"{_fmt(before)} → {_fmt(after)} | {_fmt(clean_before)} → {_fmt(clean_after)} | "
            f"{_fmt(k3, '.2e')} | {_fmt(grad, '.3g')} | "
            f"{_fmt(masked, '.3f')} |"
        )
    return "\n".join(lines)


REWARD_BLOCK = 25
"""Runs longer than this many steps show their rollout reward as block means of this size."""


def trajectories(runs: list[Run]) -> str:
    """One markdown row per run: its training reward per step, its entropy first → last.

    The numbers the write-up quotes per run, so that none of them needs a script of its own.
    Runs of more than `REWARD_BLOCK` steps show the mean of each block of that many steps
    instead of every step, for the reward and also for the trainer entropy and the k3 KL
    (whose drift over a long run is what a guard with limits relative to a rolling median
    cannot see), and the share of sequences a correction masked ("–" when it masked none).
    """
    longest = _longest(runs)
    blocked = longest > REWARD_BLOCK
    what = f"mean per {REWARD_BLOCK} steps" if blocked else "per step"
    header = f"| run | rollout reward ({what}) | entropy first → last |"
    if blocked:
        header += (
            f" entropy (mean per {REWARD_BLOCK} steps) | k3 KL (mean per {REWARD_BLOCK} steps) |"
            f" sequences masked (mean per {REWARD_BLOCK} steps) |"
        )
    else:
        header += " k3 KL (per step) |"
    lines = [header, "|---" * header.count(" | ") + "|---|"]
    for run in sorted(runs, key=lambda r: (_ordered([r.setting])[0], r.seed)):
        rewards = values_by_step(run.rows, "rollout/reward_mean")
        entropy = values_by_step(run.rows, "train/entropy")
        if blocked:
            reward_text = _block_means(rewards, ".2f")
        else:
            reward_text = ", ".join(f"{rewards[s]:.2f}" for s in sorted(rewards)) or "–"
        entropy_text = (
            f"{entropy[min(entropy)]:.2f} → {entropy[max(entropy)]:.2f}" if entropy else "–"
        )
        row = f"| {run.setting}_s{run.seed} | {reward_text} | {entropy_text} |"
        k3 = values_by_step(run.rows, "mismatch/k3_kl")
        if blocked:
            masked = values_by_step(run.rows, masked_key("seq"))
            masked_text = _block_means(masked, ".2f") if any(masked.values()) else "–"
            row += f" {_block_means(entropy, '.2f')} | {_block_means(k3, '.1e')} | {masked_text} |"
        else:
            row += f" {', '.join(f'{k3[s]:.1e}' for s in sorted(k3)) or '–'} |"
        lines.append(row)
    return "\n".join(lines)


EARLY_BLOCK = 15
"""Steps over which `early_mismatch_by_position` averages: before the long runs' bypass
collapses set in."""


def early_mismatch_by_position(runs: list[Run]) -> str:
    """Per run of more than `REWARD_BLOCK` steps: mean k3 KL over steps 1-`EARLY_BLOCK` by
    turn and by distance from the last tool result (where in an episode the gap sits before
    anything has gone wrong). Empty when no run is that long."""
    long_runs = [
        r for r in runs if len(values_by_step(r.rows, "rollout/reward_mean")) > REWARD_BLOCK
    ]
    if not long_runs:
        return ""
    keys = sorted({k for r in long_runs for row in r.rows for k in row
                   if _TURN.match(k) or _TOOL_DIST.match(k)}, key=_position_order)  # fmt: skip
    names = [k.split("/")[1] for k in keys]
    lines = [
        f"mean k3 KL over steps 1-{EARLY_BLOCK}, by turn and by tokens since the last tool result:",
        "",
        "| run | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for run in sorted(long_runs, key=lambda r: (_ordered([r.setting])[0], r.seed)):
        cells = []
        for key in keys:
            early = [v for step, v in values_by_step(run.rows, key).items() if step <= EARLY_BLOCK]
            cells.append(_fmt(_mean(early), ".1e"))
        lines.append(f"| {run.setting}_s{run.seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _position_order(key: str) -> tuple[int, int]:
    """Turns first (by index), then tool distances (by their lower bound, `none` last)."""
    if match := _TURN.match(key):
        return (0, int(match[1]))
    bucket = key.split("/")[1].removeprefix("tool_dist_")
    return (1, int(bucket.split("-")[0]) if bucket[0].isdigit() else 10**9)


def _block_means(values: dict[int, float], spec: str) -> str:
    """Means of `values` over steps 1-25, 26-50, ... (`REWARD_BLOCK`), comma-separated."""
    blocks: dict[int, list[float]] = defaultdict(list)
    for step, value in values.items():
        blocks[(step - 1) // REWARD_BLOCK].append(value)
    return ", ".join(format(_mean(blocks[b]), spec) for b in sorted(blocks)) or "–"


def heldout_curves(runs: list[Run]) -> str:
    """One markdown row per run: held-out pass@1 at every evaluation, own sampler / clean.

    Empty when no run evaluated between its first and last step.
    """
    curves = {(r.setting, r.seed): values_by_step(r.rows, "eval/pass_at_1") for r in runs}
    steps = sorted({s for c in curves.values() for s in c})
    if len(steps) <= 2:
        return ""
    header = "| run | " + " | ".join(f"step {s}" for s in steps) + " |"
    lines = [
        "held-out pass@1, the run's own sampler / the clean fp32 sampler (– where not run):",
        "",
        header,
        "|---" * (len(steps) + 1) + "|",
    ]
    for run in sorted(runs, key=lambda r: (_ordered([r.setting])[0], r.seed)):
        own = curves[(run.setting, run.seed)]
        clean = values_by_step(run.rows, "eval_clean/pass_at_1")
        cells = [
            f"{_fmt(own.get(s))} / {_fmt(clean.get(s))}" if s in clean else _fmt(own.get(s))
            for s in steps
        ]
        lines.append(f"| {run.setting}_s{run.seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_scores(run: Run, step: int) -> list[float] | None:
    """Pass@1 per held-out task at `step` (clean sampler where the run has it); None when that
    evaluation's file is missing or has no per-task scores."""
    path = run.folder / f"{_heldout_prefix(run)}_step_{step}.json"
    if not path.is_file():
        return None
    scores = json.loads(path.read_text()).get("task_pass_at_1") or []
    return [float(x) for x in scores] or None


def final_task_scores(run: Run) -> list[float] | None:
    """The trained policy's pass@1 per held-out task (clean sampler where the run has it);
    None when the last evaluation's file has no per-task scores."""
    points = _heldout(run)
    return task_scores(run, max(points)) if len(points) > 1 else None


def paired_change(run: Run) -> Estimate | None:
    """Final minus starting held-out pass@1, paired by task, with its 95% bootstrap interval
    (`bootstrap_paired_change`); None without per-task scores at both ends."""
    points = _heldout(run)
    if len(points) < 2:
        return None
    before, after = task_scores(run, min(points)), task_scores(run, max(points))
    if before is None or after is None or len(before) != len(after):
        return None
    return bootstrap_paired_change(before, after)


def wall_minutes(run: Run) -> float:
    """The run's wall time over all its attempts, from its `DONE` marker (`run.py`), else NaN."""
    done = run.folder / "DONE"
    text = done.read_text() if done.is_file() else ""
    return float(text.split()[0]) / 60 if text.strip() else math.nan


def corrections_table(runs: list[Run]) -> str:
    """One row per setting, seeds pooled: what issue 12's corrections question asks.

    Outcomes are `outcome` per seed; "steps to collapse" is the training curve's collapse step
    (`verdict.py`) of the seeds whose held-out outcome collapsed or degraded; the final
    held-out pass@1 pools seeds and tasks with an interval that resamples both
    (`bootstrap_seeds_and_tasks`; runs without per-task scores are left out of it and
    counted); rejected fractions are means over the steps that made an update.
    """
    by_setting = _by_setting(runs)
    lines = [
        "| setting | seeds | held-out outcome per seed | paired change per seed [95% CI] | "
        "collapsed or degraded | "
        "steps to collapse | final held-out pass@1 [95% CI, seeds × tasks] | start | "
        "tokens / turns / sequences rejected | wall min |",
        "|---" * 10 + "|",
    ]
    for setting in _ordered(by_setting):
        group = sorted(by_setting[setting], key=lambda r: r.seed)
        outcomes = [outcome(r) for r in group]
        failed = [r for r, o in zip(group, outcomes, strict=True) if o in ("collapsed", "degraded")]
        judged = [o for o in outcomes if o != "unfinished"]
        steps = [
            str(r.verdict.collapse_step) if r.verdict.collapse_step is not None else "–"
            for r in failed
        ]
        pooled = [scores for r in group if (scores := final_task_scores(r)) is not None]
        lengths = {len(p) for p in pooled}
        final = "–"
        if pooled and len(lengths) == 1:
            estimate = bootstrap_seeds_and_tasks(pooled)
            missing = len(group) - len(pooled)
            final = f"{estimate}" + (f" ({len(pooled)} of {len(group)} seeds)" if missing else "")
        starts = [points[min(points)] for r in group if (points := _heldout(r))]
        rejected = " / ".join(
            _fmt(
                _mean(
                    [
                        _mean(list(values_by_step(r.rows, key).values()))
                        for r in group
                        if values_by_step(r.rows, key)
                    ]
                ),
                ".2f",
            )
            for key in map(masked_key, REJECTED)
        )
        counts = ", ".join(
            f"{judged.count(o)} {o}"
            for o in ("collapsed", "degraded", "no change", "learned", "no signal", "unpaired")
            if judged.count(o)
        )
        changes = "; ".join(
            f"s{r.seed} {_signed(change)}" for r in group if (change := paired_change(r))
        )
        unfinished = len(outcomes) - len(judged)
        if unfinished:
            counts += f"{', ' if counts else ''}{unfinished} unfinished"
        rate = f"{len(failed)}/{len(judged)}" if judged else "–"
        lines.append(
            f"| {setting} | {', '.join(str(r.seed) for r in group)} | {counts} | "
            f"{changes or '–'} | {rate} | "
            f"{', '.join(steps) or '–'} | {final} | {_fmt(_mean(starts), '.2f')} | {rejected} | "
            f"{_fmt(_mean([wall_minutes(r) for r in group]), '.1f')} |"
        )
    return "\n".join(lines)


_MAP_SETTING = re.compile(
    r"^h(?P<horizon>\d+)_(?:(?P<mode>bypass|decoupled)_(?P<mismatch>.+)|no_mismatch)$"
)


def outcome(run: Run) -> str:
    """learned / no change / degraded / collapsed / no signal, from held-out pass@1.

    The trained policy is judged with the clean sampler when the run evaluated with one, else
    with its own, against the run's own start, task by task: `learned` / `degraded` when the
    95% interval of the paired change (`paired_change`) lies wholly above / below 0;
    `collapsed`: degraded to at most 0.05; `no signal`: no step made an update (every group
    degenerate); `unpaired`: the per-task scores of the first or last evaluation are missing.
    """
    points = _heldout(run)
    if len(points) < 2:
        return "unfinished"
    if not values_by_step(run.rows, "train/grad_norm"):
        return "no signal"
    change = paired_change(run)
    if change is None:
        return "unpaired"
    if change.high < 0:
        return "collapsed" if points[max(points)] <= 0.05 else "degraded"
    return "learned" if change.low > 0 else "no change"


def breaking_point_map(runs: list[Run]) -> str:
    """The `map` suite as one table: mismatch x (horizon, mode) -> outcome and gap size.

    Empty when no run is named like the map's settings (`h<H>_<mode>_<mismatch>`).
    """
    cells: dict[tuple[str, int, str], list[Run]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: r.seed):
        match = _MAP_SETTING.match(run.setting)
        if match is not None:
            mismatch = match["mismatch"] or "none"
            cells[(mismatch, int(match["horizon"]), match["mode"] or "both")].append(run)
    if not cells:
        return ""
    horizons = sorted({h for _, h, _ in cells}, reverse=True)
    columns = [(h, m) for h in horizons for m in ("bypass", "decoupled")]
    mismatches = sorted({m for m, _, _ in cells}, key=lambda m: (m != "none", m))
    lines = [
        "breaking-point map: outcome (held-out pass@1 before → after, clean sampler where run; "
        f"mean k3 KL and largest max |Δ logprob| over steps 1-{EARLY_STEPS}):",
        "",
        "| mismatch | " + " | ".join(f"h{h} {m}" for h, m in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for mismatch in mismatches:
        row = []
        for h, mode in columns:
            group = cells.get((mismatch, h, mode)) or cells.get((mismatch, h, "both"), [])
            if len(group) == 1:
                row.append(_map_cell(group[0]))
            else:  # one line per seed
                row.append("<br>".join(f"s{r.seed}: {_map_cell(r)}" for r in group) or "–")
        lines.append(f"| {mismatch} | " + " | ".join(row) + " |")
    return "\n".join(lines)


EARLY_STEPS = 4
"""The map sizes a mismatch over the first steps: a full cycle of `sync_every=4`, and before
a bypass collapse inflates the gap it caused."""


def early_gap(run: Run) -> tuple[float, float] | None:
    """Mean k3 KL and largest max |Δ logprob| over the first `EARLY_STEPS` steps; None if
    the run logged no mismatch metrics."""
    k3 = values_by_step(run.rows, "mismatch/k3_kl")
    gap = values_by_step(run.rows, "mismatch/abs_diff_max")
    early = sorted(k3)[:EARLY_STEPS]
    if not early:
        return None
    return _mean([k3[s] for s in early]), max((gap[s] for s in early if s in gap), default=math.nan)


def _map_cell(run: Run) -> str:
    points = _heldout(run)
    heldout = f"{points[min(points)]:.2f} → {points[max(points)]:.2f}" if len(points) > 1 else "–"
    sizes = early_gap(run)
    gap = f"; k3 {sizes[0]:.1e}, max {sizes[1]:.2g}" if sizes is not None else ""
    return f"**{outcome(run)}** {heldout}{gap}"


def _signed(change: Estimate) -> str:
    return f"{change.value:+.3f} [{change.low:+.3f}, {change.high:+.3f}]"


def _ordered(settings: Any) -> list[str]:
    names = list(settings)
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def plot(runs: list[Run], out: Path) -> list[Path]:
    """Overlay plots, one line per setting (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    by_setting = _by_setting(runs)
    longest = _longest(runs)
    window = 10 if longest > REWARD_BLOCK else 3  # 2-4 tasks a step: a long run needs more
    panels = (
        ("rollout/reward_mean", f"training reward (trailing mean of {window})", False, window),
        (HELDOUT, "held-out pass@1 (dotted, x: clean sampler)", False, 1),
        ("train/grad_norm", "gradient norm (pre-clip)", True, 1),
        ("mismatch/k3_kl", "mismatch k3 KL", True, 1),
        ("train/entropy", "trainer entropy (nats/token)", False, 1),
        (masked_key("token"), "masked token fraction", False, 1),
    )
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, log, smooth) in zip(axes.flat, panels, strict=True):
        for setting in _ordered(by_setting):
            group = by_setting[setting]
            steps, values, low, high = _mean_curve(group, key, smooth)
            if log:  # k3 of an exact sampler is ±1e-10 noise: draw it at the floor
                values, low, high = ([max(v, LOG_FLOOR) for v in vs] for vs in (values, low, high))
            if not steps:
                continue
            style = "--" if setting in ("no_mismatch", "uncorrected") else "-"
            few = len(steps) < 4 or key == HELDOUT
            (line,) = ax.plot(steps, values, style, label=setting, marker="." if few else "")
            if len({r.seed for r in group}) > 1:  # the band: lowest to highest seed
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
            if key == HELDOUT:
                clean_steps, clean, _, _ = _mean_curve(group, CLEAN_HELDOUT, 1)
                if clean_steps:
                    ax.plot(clean_steps, clean, ":", color=line.get_color(), marker="x")
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 9), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    written = [out / "collapse_overview.png"]
    fig.savefig(written[0], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for setting in _ordered(by_setting):
        turns = _by_turn(by_setting[setting])
        if turns:
            values = [max(v, LOG_FLOOR) for v in turns.values()]
            ax.plot(list(turns), values, marker="o", label=setting)
    ax.set_yscale("log")
    ax.set_xlabel("assistant turn index")
    ax.set_title("mismatch k3 KL by turn (mean over steps and seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "collapse_by_turn.png")
    fig.savefig(written[1], dpi=90)
    plt.close(fig)
    if (map_plot := _plot_map(runs, out / "breaking_point_map.png")) is not None:
        written.append(map_plot)
    return written


OUTCOME_COLORS = {
    "learned": "tab:green",
    "no change": "tab:gray",
    "degraded": "tab:orange",
    "collapsed": "tab:red",
    "no signal": "black",
    "unfinished": "white",
}


def _plot_map(runs: list[Run], path: Path) -> Path | None:
    """The map's runs on one axis of mismatch size (mean k3 over the first steps), one row per
    horizon and mode, coloured by outcome; None without map runs."""
    import matplotlib.pyplot as plt

    points = []
    for run in runs:
        match = _MAP_SETTING.match(run.setting)
        sizes = early_gap(run)
        if match is None or sizes is None:
            continue
        modes = [match["mode"]] if match["mode"] else ["bypass", "decoupled"]
        for mode in modes:
            row = f"h{match['horizon']} {mode}"
            points.append((row, max(sizes[0], LOG_FLOOR), outcome(run), match["mismatch"]))
    if not points:
        return None
    rows = sorted({p[0] for p in points}, key=lambda r: (-int(r.split()[0][1:]), r))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(rows)))
    for row, k3, verdict, mismatch in points:
        y = rows.index(row)
        ax.scatter(k3, y, s=90, c=OUTCOME_COLORS[verdict], edgecolors="black", zorder=3)
        ax.annotate(mismatch or "none", (k3, y), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=7)  # fmt: skip
    for verdict, color in OUTCOME_COLORS.items():
        if any(p[2] == verdict for p in points):
            ax.scatter([], [], s=90, c=color, edgecolors="black", label=verdict)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.6, len(rows) - 0.3)
    ax.set_xlabel(
        f"mismatch: mean k3 KL over steps 1-{EARLY_STEPS} (an exact sampler is drawn at 1e-7)"
    )
    ax.set_title("breaking-point map: outcome of uncorrected GRPO per mismatch, horizon and mode")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _mean_curve(
    runs: list[Run], key: str, smooth: int
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, the mean over seeds of the trailing-`smooth` mean, and the seeds' min and max."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        values = values_by_step(run.rows, key)
        steps = sorted(values)
        for i, step in enumerate(steps):
            window = [values[s] for s in steps[max(0, i - smooth + 1) : i + 1]]
            per_step[step].append(statistics.fmean(window))
    steps = sorted(per_step)
    return (
        steps,
        [statistics.fmean(per_step[s]) for s in steps],
        [min(per_step[s]) for s in steps],
        [max(per_step[s]) for s in steps],
    )


def _by_turn(runs: list[Run]) -> dict[int, float]:
    per_turn: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for row in run.rows:
            for key, value in row.items():
                match = _TURN.match(key)
                if match and isinstance(value, (int, float)) and math.isfinite(value):
                    per_turn[int(match[1])].append(value)
    return {t: statistics.fmean(v) for t, v in sorted(per_turn.items())}


def report_text(runs: list[Run]) -> str:
    """`report.md`: every table of the runs, in order."""
    parts = (
        table(runs),
        corrections_table(runs),
        trajectories(runs),
        early_mismatch_by_position(runs),
        heldout_curves(runs),
        breaking_point_map(runs),
    )
    return "\n\n".join(t for t in parts if t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, nargs="?", default=Path("runs/collapse"))
    parser.add_argument("--plots", type=Path, default=None, help="default: <root>/plots")
    args = parser.parse_args()
    runs = load_runs(args.root)
    if not runs:
        raise SystemExit(f"no runs with metrics.jsonl(.gz) under {args.root}")
    text = report_text(runs)
    print(text)
    (args.root / "report.md").write_text(text + "\n")
    for path in plot(runs, args.plots or args.root / "plots"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
