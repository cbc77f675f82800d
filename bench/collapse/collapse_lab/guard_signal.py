"""Which guard signal foretells a collapse: k3, the failure tilt, VCPO's ESS or DPPO's binary TV,
each as a limit on its 5-step mean, replayed through the collapse guard itself over kept runs
(nothing is rerun).

    python bench/collapse/guard_signal.py bench/collapse/results/sft_long \
        --new bench/collapse/results/guard_new

Signals, per step: `mismatch/k3_kl` from the run's metrics, and the failure tilt
(`tir_rl.mismatch.failure_tilt`: Σ w A δ̄ / Σ w |A| over the trained sequences) recomputed from
the run's `sequences.jsonl` with the formula the trainer logs it with, VCPO's ESS deficit
1 − ρ (`tir_rl.trainer.ess_step`: ρ of the step's raw sequence ratios exp Σ(ℓ^old − ℓ^μ),
recomputed from the same records; higher is worse), and the mean binary total variation
`mismatch/binary_tv` of the run's metrics (DPPO's divergence, logged since 2026-12-02: runs
before it have none, and it is then judged on the new runs alone, one cause held out at a
time). Each is fed to a
`CollapseGuard` with one absolute limit on its trailing mean over `--smooth` steps, so a
firing here is an alert the shipped guard would raise.

Judged per run (the lab's verdict, `verdict.judge_run`): a **persisting collapse** is
**warned** when the guard fired at least `--lead` steps before its collapse step, and the
lead is the collapse step minus the first firing; a run that never collapsed **holds**, and
any firing in it is a **false alarm**; a collapse that recovered is reported on its own line.

The limit is chosen on the tuning runs by one rule, fixed before the new runs were read: over
a log grid, the most persisting collapses warned, then the fewest holds with a false alarm,
then the largest limit. First with leave-one-cause-out (the limit chosen on the other causes'
runs, judged on the held-out cause's), then on every tuning run, and that limit is judged on
the new runs (`--new`), which chose nothing. `k3 > 3e-3` is the issue's reference detector.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from collapse_lab.report import Run, load_runs
from collapse_lab.verdict import values_by_step
from tir_rl.mismatch import guard as guard_module
from tir_rl.mismatch.failure_tilt import TILT_KEY, tilt_sums
from tir_rl.mismatch.guard import CollapseGuard
from tir_rl.report.run_log import run_file
from tir_rl.report.sequences import SEQUENCES_FILE, SequenceRecord, read_sequences
from tir_rl.trainer.ess_step import ess_ratio

K3_KEY = "mismatch/k3_kl"
ESS_DEFICIT_KEY = "mismatch/vcpo_ess_deficit"
BINARY_TV_KEY = "mismatch/binary_tv"
GRID = tuple(round(m * 10.0**e, 12) for e in range(-5, 0) for m in (1, 1.5, 2, 3, 5, 7))
REFERENCE = (K3_KEY, 3e-3)
"""The detector the issue measured the guard against: k3's 5-step mean above 3e-3."""
CAUSES = (
    ("raw", "raw logprobs"),
    ("stale", "stale weights"),
    ("bf16", "bf16 sampler"),
    ("async", "asynchronous"),
)


def cause_of(run: Run) -> str:
    for marker, cause in CAUSES:
        if marker in run.setting:
            return cause
    return "none"


def trained_sequences(run: Run) -> list[SequenceRecord]:
    """The run's per-sequence records of the sequences an update trained."""
    path = run_file(run.folder, SEQUENCES_FILE)
    if path is None:
        raise SystemExit(
            f"{run.folder}: no {SEQUENCES_FILE}; the tilt and the ESS need per-sequence records"
        )
    return [r for r in read_sequences(path) if r.advantage is not None and r.model_tokens > 0]


def tilt_by_step(records: Sequence[SequenceRecord]) -> dict[int, float]:
    """The failure tilt of each update step, from a run's `trained_sequences`."""
    by_step: dict[int, list[SequenceRecord]] = defaultdict(list)
    for record in records:
        by_step[record.step].append(record)
    out = {}
    for step, records in by_step.items():
        weights = [
            1.0
            if r.kept_tokens is None
            else (r.kept_tokens / r.model_tokens) * (r.is_weight_mean or 0.0)
            for r in records
        ]
        tilted, mass = tilt_sums(
            torch.tensor([r.advantage for r in records]),
            torch.tensor([r.log_ratio_mean for r in records]),
            torch.tensor(weights),
        )
        if mass > 0:
            out[step] = tilted / mass
    return out


def ess_deficit_by_step(records: Sequence[SequenceRecord]) -> dict[int, float]:
    """1 − VCPO's ESS ratio of each update step's sequences, from a run's `trained_sequences`."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for record in records:
        by_step[record.step].append(record.log_ratio_sum)
    out = {}
    for step, sums in by_step.items():
        w = torch.exp(torch.tensor(sums, dtype=torch.float64).clamp(-300, 300))
        sums_w = torch.stack([w.sum(), w.square().sum(), torch.tensor(float(len(sums)))])
        out[step] = 1.0 - ess_ratio(*sums_w.tolist())
    return out


@dataclass(frozen=True)
class Signals:
    run: Run
    by_key: dict[str, dict[int, float]]
    _compared: dict[tuple[str, int], dict[int, float]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def compared(self, key: str, smooth: int) -> dict[int, float]:
        """`compared_values` of one signal, replayed once for every limit the study tries."""
        if (key, smooth) not in self._compared:
            self._compared[key, smooth] = compared_values(self.by_key[key], key, smooth)
        return self._compared[key, smooth]


def signals(run: Run) -> Signals:
    records = trained_sequences(run)
    return Signals(
        run,
        {
            K3_KEY: values_by_step(run.rows, K3_KEY),
            TILT_KEY: tilt_by_step(records),
            ESS_DEFICIT_KEY: ess_deficit_by_step(records),
            BINARY_TV_KEY: values_by_step(run.rows, BINARY_TV_KEY),
        },
    )


def logged_by_all(sigs: Sequence[Signals], key: str) -> bool:
    """Whether every run has the signal (a metric logged only by newer runs may be missing)."""
    return bool(sigs) and all(s.by_key[key] for s in sigs)


def logged_by(sigs: Sequence[Signals], key: str) -> list[Signals]:
    """The runs that logged the signal (a metric logged only by newer runs)."""
    return [s for s in sigs if s.by_key[key]]


def compared_values(values: dict[int, float], key: str, smooth: int) -> dict[int, float]:
    """What a guard with one absolute limit on `key` compares with its limit, at each step it
    compares: the trailing mean over `smooth` steps (a non-finite value: the value itself,
    which alerts at any limit). Read from the guard itself, replayed with the limit at −∞."""
    config = CollapseGuard.Config(
        watch=(), failure_tilt_limit=None, absolute={key: -math.inf}, smooth=smooth
    )
    guard = CollapseGuard(config)
    with _guard_log_off():  # the study replays a guard per run and signal: alerts are its data
        decisions = {s: guard.check(s, {key: values[s]}) for s in sorted(values)}
    return {s: d.alerts[0].value for s, d in decisions.items() if d.fired}


def fired_over(compared: dict[int, float], limit: float) -> list[int]:
    """Steps at which the guard of `compared_values` alerts with this limit (the guard alerts
    where the trailing mean is above its limit, or a value is not finite)."""
    return [s for s, v in compared.items() if not math.isfinite(v) or v > limit]


def firing_steps(values: dict[int, float], key: str, limit: float, smooth: int) -> list[int]:
    """Steps at which a guard with this one absolute limit alerts."""
    return fired_over(compared_values(values, key, smooth), limit)


@contextlib.contextmanager
def _guard_log_off() -> Iterator[None]:
    was = guard_module.logger.disabled
    guard_module.logger.disabled = True
    try:
        yield
    finally:
        guard_module.logger.disabled = was


@dataclass(frozen=True)
class Judged:
    run: Run
    first_firing: int | None
    lead: int | None
    """Collapse step minus the first firing at or before it (persisting collapses only)."""

    @property
    def kind(self) -> str:
        v = self.run.verdict
        return "collapse" if v.persisting else "recovered" if v.collapsed else "hold"


def judge(sig: Signals, key: str, limit: float, smooth: int) -> Judged:
    fired = fired_over(sig.compared(key, smooth), limit)
    verdict = sig.run.verdict
    lead = None
    if verdict.persisting and verdict.collapse_step is not None:
        before = [s for s in fired if s <= verdict.collapse_step]
        lead = verdict.collapse_step - before[0] if before else None
    return Judged(sig.run, fired[0] if fired else None, lead)


@dataclass(frozen=True)
class Score:
    warned: int
    collapses: int
    false_alarms: int
    holds: int

    def cells(self) -> str:
        return f"{self.warned}/{self.collapses} | {self.false_alarms}/{self.holds}"


def score(judged: Sequence[Judged], min_lead: int) -> Score:
    collapses = [j for j in judged if j.kind == "collapse"]
    holds = [j for j in judged if j.kind == "hold"]
    return Score(
        sum(j.lead is not None and j.lead >= min_lead for j in collapses),
        len(collapses),
        sum(j.first_firing is not None for j in holds),
        len(holds),
    )


def choose_limit(
    sigs: Sequence[Signals], key: str, smooth: int, min_lead: int
) -> tuple[float, Score]:
    """The module docstring's rule: most warned, then fewest false alarms, then largest."""
    best: tuple[tuple[int, int, float], float, Score] | None = None
    for limit in GRID:
        found = score([judge(s, key, limit, smooth) for s in sigs], min_lead)
        rank = (found.warned, -found.false_alarms, limit)
        if best is None or rank > best[0]:
            best = (rank, limit, found)
    assert best is not None
    return best[1], best[2]


NAMES = {
    K3_KEY: "k3",
    TILT_KEY: "failure tilt",
    ESS_DEFICIT_KEY: "ESS deficit 1 − ρ",
    BINARY_TV_KEY: "binary TV",
}


def loco_table(
    sigs: Sequence[Signals], smooth: int, min_lead: int, keys: Sequence[str] = (K3_KEY, TILT_KEY)
) -> list[str]:
    causes = sorted({cause_of(s.run) for s in sigs})
    lines = [
        "| signal | held-out cause | limit chosen on the other causes | "
        "held-out persisting collapses warned | held-out holds with a false alarm |",
        "|---|---|---|---|---|",
    ]
    for key in keys:
        for cause in causes:
            rest = [s for s in sigs if cause_of(s.run) != cause]
            held = [s for s in sigs if cause_of(s.run) == cause]
            limit, _ = choose_limit(rest, key, smooth, min_lead)
            found = score([judge(s, key, limit, smooth) for s in held], min_lead)
            lines.append(f"| {NAMES[key]} | {cause} | {limit:g} | {found.cells()} |")
    return lines


def per_run_table(
    sigs: Sequence[Signals], detectors: Sequence[tuple[str, float]], smooth: int, min_lead: int
) -> list[str]:
    head = " | ".join(f"{NAMES[k]} > {v:g}" for k, v in detectors)
    lines = [
        f"| run | outcome (collapse step) | {head} |",
        "|---|---|" + "---|" * len(detectors),
    ]
    columns: list[list[Judged]] = [[judge(s, k, v, smooth) for s in sigs] for k, v in detectors]
    for row, sig in enumerate(sigs):
        v = sig.run.verdict
        outcome = {"collapse": f"collapsed ({v.collapse_step})", "hold": "held"}.get(
            columns[0][row].kind, f"dipped and recovered ({v.collapse_step})"
        )
        cells = []
        for column in columns:
            j = column[row]
            if j.first_firing is None:
                cells.append("quiet")
            elif j.kind == "collapse":
                lead = "not before the collapse" if j.lead is None else f"lead {j.lead}"
                cells.append(f"step {j.first_firing} ({lead})")
            else:
                cells.append(f"step {j.first_firing}" + (" (false alarm)" * (j.kind == "hold")))
        lines.append(f"| {sig.run.folder.name} | {outcome} | " + " | ".join(cells) + " |")
    totals = [score(column, min_lead) for column in columns]
    lines.append(
        f"| **persisting collapses warned ≥ {min_lead} steps ahead; holds with a false alarm** | | "
        + " | ".join(f"{t.warned}/{t.collapses}; {t.false_alarms}/{t.holds}" for t in totals)
        + " |"
    )
    return lines


def logged_agreement(sigs: Sequence[Signals]) -> str:
    """How closely the tilt the trainer logged matches its replay from the records."""
    gaps = [
        abs(logged - s.by_key[TILT_KEY][step])
        for s in sigs
        for step, logged in values_by_step(s.run.rows, TILT_KEY).items()
        if step in s.by_key[TILT_KEY]
    ]
    if not gaps:
        return "No run logged `mismatch/failure_tilt` (runs before it was logged)."
    return (
        f"The tilt the trainer logged and its replay from the per-sequence records: "
        f"{len(gaps)} steps, max |difference| {max(gaps):.1e}."
    )


def study(tuning: list[Run], new: list[Run], smooth: int, min_lead: int) -> str:
    sigs = [signals(r) for r in tuning]
    new_sigs = [signals(r) for r in new]
    tuned = [k for k in NAMES if logged_by_all(sigs, k)]
    new_only = {k: logged for k in NAMES if k not in tuned and (logged := logged_by(new_sigs, k))}
    out = [
        f"{len(tuning)} tuning runs; limits on the {smooth}-step trailing mean; warned = first "
        f"alert at least {min_lead} steps before a persisting collapse; grid "
        f"{GRID[0]:g} to {GRID[-1]:g}",
        "",
        "Leave one cause out (tuning runs):",
        "",
        *loco_table(sigs, smooth, min_lead, tuned),
        "",
    ]
    frozen = []
    for key in tuned:
        limit, found = choose_limit(sigs, key, smooth, min_lead)
        frozen.append((key, limit))
        out.append(
            f"- {NAMES[key]}: limit {limit:g} chosen on all {len(tuning)} tuning runs; on them "
            f"{found.warned}/{found.collapses} persisting collapses warned, "
            f"{found.false_alarms}/{found.holds} holds with a false alarm"
        )
    detectors = [REFERENCE, *frozen]
    for key, logged in new_only.items():
        limit, found = choose_limit(logged, key, smooth, min_lead)
        out += [
            "",
            f"{NAMES[key]}, which the tuning runs did not log: leave one cause out among the "
            f"{len(logged)} new runs that logged it (the limit chosen on the other causes' "
            "runs, judged on the held-out cause's):",
            "",
            *loco_table(logged, smooth, min_lead, [key]),
            "",
            f"- {NAMES[key]}: limit {limit:g} chosen on all {len(logged)} of them (in sample: "
            f"no run was left to judge it on); on them {found.warned}/{found.collapses} "
            f"persisting collapses warned, {found.false_alarms}/{found.holds} holds with a "
            "false alarm",
        ]
    if new:
        out += [
            "",
            f"New runs ({len(new)}; no limit was chosen on them):",
            "",
            *per_run_table(new_sigs, detectors, smooth, min_lead),
            "",
            logged_agreement(new_sigs),
        ]
    out += ["", "Tuning runs, the same detectors:", ""]
    out += per_run_table(sigs, detectors, smooth, min_lead)
    return "\n".join(out)


def _runs(folders: Sequence[Path]) -> list[Run]:
    return [run for folder in folders for run in load_runs(folder)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="result folders of tuning runs")
    parser.add_argument("--new", type=Path, nargs="*", default=[], help="folders of new runs")
    parser.add_argument("--smooth", type=int, default=5)
    parser.add_argument("--lead", type=int, default=5, help="steps ahead that count as warned")
    args = parser.parse_args()
    tuning = _runs(args.results)
    if not tuning:
        raise SystemExit(f"no kept runs under {', '.join(map(str, args.results))}")
    print(study(tuning, _runs(args.new), args.smooth, args.lead))


if __name__ == "__main__":
    main()
