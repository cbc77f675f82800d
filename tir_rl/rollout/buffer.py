"""The buffer between rollouts and updates, and the admission control that bounds staleness.

Groups (the G samples of one task) are admitted, played and taken by the trainer in
steps of `groups_per_step`. Two clocks drive it:

- `step`: the next step the trainer takes (it trains from the weights of `step` steps);
- `clock`: the steps whose weights the engine holds (it lags `step` while a sync runs).

Admission gives every group a *due step*: the earliest step, from `step` on, with a free
slot (each step has `groups_per_step`), and never later than `clock + max_staleness`. A
group is trained at a step no later than its due step, and every token it samples comes
from weights at least as new as those the engine held when it was admitted, so no token
lags the weights it is trained from by more than `max_staleness` steps (nor versions:
a step makes at most one optimizer update). With `max_staleness` 0 a group is admitted
only for the step whose weights the engine holds: the synchronous loop.

The trainer's step takes `groups_per_step` finished groups: every group due at that step
first (with `LateGroups.WAIT` it waits for them), then the finished groups due latest,
earliest first (which frees their slots for new admissions). With `LateGroups.DROP` it
waits for no group in particular: it takes the first finished ones, and a group still
running when its due step is taken is dropped (its task is skipped, a new one is admitted).

With refill on (`max_draws_per_step`, DAPO's dynamic sampling), a finished group whose
rewards all tie carries no learning signal: it gives its slot back, so another task is drawn
for the same step, until the step holds `groups_per_step` groups with signal or it has drawn
`max_draws_per_step` tasks. Then the step takes what it has; its tied groups go with it (they
are scored and counted, not trained on).

`AdmissionSchedule` is the bookkeeping alone (single-threaded, no clock of its own, so a
simulation can drive it: `bench/async_sim.py`); `GroupBuffer` shares one between the
producer thread and the trainer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tir_rl.errors import ConfigError
from tir_rl.types import Trajectory


class LateGroups(StrEnum):
    """What a step does about groups due at it that are still being played."""

    WAIT = "wait"
    """Wait for them: every admitted group is trained on, a slow group holds its step back."""
    DROP = "drop"
    """Take the first finished groups and drop the ones still running when their due step
    is taken (counted in `async/dropped_groups`); a new task replaces each. Favours short
    episodes: a bias towards what finishes fast."""


@dataclass(frozen=True)
class GroupTicket:
    """One admitted group."""

    index: int
    """Position in the task stream (the task's seed and its `group_id` derive from it)."""
    due_step: int
    """The latest step that may train on it."""
    admitted_clock: int
    """The engine's clock (steps of weights it held) when the group was admitted."""


@dataclass
class FinishedGroup:
    """A played group waiting in the buffer."""

    ticket: GroupTicket
    trajectories: list[Trajectory]
    tied: bool = False
    """Its rewards all tie (no learning signal) and refill is on: it holds no slot."""


def rewards_tie(trajectories: Sequence[Trajectory]) -> bool:
    """Whether a group's rewards are all equal: its advantages are all 0 (no signal)."""
    rewards = [t.reward for t in trajectories]
    return not rewards or min(rewards) == max(rewards)


@dataclass
class TakenStep:
    """What the trainer takes for one step."""

    step: int
    groups: list[FinishedGroup]
    """`groups_per_step` groups, in task-stream order; with refill, the groups with signal
    (fewer when the step drew its most tasks) and then the step's tied ones."""
    dropped: list[GroupTicket] = field(default_factory=list)
    """Groups due at this step that were still running (`LateGroups.DROP`)."""
    wait_s: float = 0.0
    """How long the trainer waited for the step."""
    num_drawn: int = 0
    """Tasks admitted for this step (with refill: the tied ones and their replacements)."""

    @property
    def num_tied(self) -> int:
        """Groups of this step whose rewards tie, set aside by refill."""
        return sum(group.tied for group in self.groups)


class AdmissionSchedule:
    """Due steps, admissions and takes; see the module docstring. Not thread-safe."""

    def __init__(
        self,
        *,
        groups_per_step: int,
        max_staleness: int,
        num_steps: int,
        late_groups: LateGroups = LateGroups.WAIT,
        first_step: int = 0,
        next_index: int | None = None,
        replay: Sequence[int] = (),
        max_draws_per_step: int | None = None,
    ) -> None:
        """Start at `first_step` (a resumed run's), with the engine holding its weights.

        Args:
            groups_per_step: groups the trainer takes per step.
            max_staleness: k; the most steps a token may lag the weights it is trained from.
            num_steps: the run's last step is `num_steps - 1`; nothing is admitted beyond it.
            late_groups: `LateGroups.WAIT` or `LateGroups.DROP`.
            first_step: the first step to take.
            next_index: the first fresh task index (default `first_step * groups_per_step`).
            replay: task indices to admit again before fresh ones (those a stopped run had
                admitted but not trained on).
            max_draws_per_step: refill tied groups (the module docstring), drawing at most
                this many tasks for one step; None: no refill.
        """
        if groups_per_step < 1 or num_steps < 1:
            raise ConfigError("groups_per_step and num_steps must be >= 1")
        if max_staleness < 0:
            raise ConfigError(f"run.max_staleness must be >= 0, got {max_staleness}")
        if max_draws_per_step is not None and max_draws_per_step < groups_per_step:
            raise ConfigError(
                f"run.max_tasks_per_step ({max_draws_per_step}) must be at least "
                f"run.tasks_per_step ({groups_per_step})"
            )
        self.max_draws_per_step = max_draws_per_step
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.num_steps = num_steps
        self.late_groups = LateGroups(late_groups)
        self.step = first_step
        self.clock = first_step
        self._replay = list(replay)
        self._next_index = first_step * groups_per_step if next_index is None else next_index
        self._assigned: dict[int, int] = {}
        """Due step -> groups admitted for it and not yet taken (running, or finished and not
        tied)."""
        self._drawn: dict[int, int] = {}
        """Due step -> tasks admitted for it so far (tied ones included)."""
        self._running: dict[int, GroupTicket] = {}
        self._finished: dict[int, FinishedGroup] = {}
        self.num_dropped = 0

    # ------------------------------------------------------------------ producer side

    def admit(self) -> GroupTicket | None:
        """A ticket for the next task, or None when no step within the bound has a slot."""
        last = min(self.clock + self.max_staleness, self.num_steps - 1)
        for due in range(self.step, last + 1):
            if self._assigned.get(due, 0) < self.groups_per_step and self._may_draw(due):
                index = self._replay.pop(0) if self._replay else self._take_fresh_index()
                ticket = GroupTicket(index, due, self.clock)
                self._assigned[due] = self._assigned.get(due, 0) + 1
                self._drawn[due] = self._drawn.get(due, 0) + 1
                self._running[index] = ticket
                return ticket
        return None

    def _may_draw(self, due: int) -> bool:
        """Whether step `due` may draw one more task (always, without refill)."""
        bound = self.max_draws_per_step
        return bound is None or self._drawn.get(due, 0) < bound

    def _take_fresh_index(self) -> int:
        index = self._next_index
        self._next_index += 1
        return index

    def finish(self, ticket: GroupTicket, trajectories: list[Trajectory]) -> bool:
        """Record a played group; False when it was dropped meanwhile (then it is discarded).

        With refill, a group whose rewards tie gives its slot back (`tied`).
        """
        if self._running.pop(ticket.index, None) is None:
            return False
        tied = self.max_draws_per_step is not None and rewards_tie(trajectories)
        if tied:
            self._assigned[ticket.due_step] -= 1
        self._finished[ticket.index] = FinishedGroup(ticket, trajectories, tied)
        return True

    def abandon(self, ticket: GroupTicket) -> None:
        """Forget a group that will not finish (its play failed or was cancelled)."""
        if self._running.pop(ticket.index, None) is not None:
            self._assigned[ticket.due_step] -= 1
            self._drawn[ticket.due_step] -= 1  # it is drawn again
            self._replay.insert(0, ticket.index)  # the task is played again

    # ------------------------------------------------------------------ trainer side

    def ready(self) -> bool:
        """Whether the trainer can take `step` now."""
        late_running = any(t.due_step == self.step for t in self._running.values())
        waits = self.late_groups is LateGroups.WAIT and late_running
        with_signal = sum(not g.tied for g in self._finished.values())
        if with_signal >= self.groups_per_step:
            return not waits
        # Refill drew its most tasks for this step: once they are played, it trains what it has.
        return not self._may_draw(self.step) and not late_running

    def take(self) -> TakenStep:
        """Take `step`'s groups (call when `ready`) and move on to the next step."""
        assert self.ready(), "take() before the step is ready"
        with_signal = [g for g in self._finished.values() if not g.tied]
        order = sorted(with_signal, key=lambda g: (g.ticket.due_step, g.ticket.index))
        chosen = order[: self.groups_per_step]
        assert all(g.ticket.due_step >= self.step for g in chosen)
        for group in chosen:
            del self._finished[group.ticket.index]
            self._assigned[group.ticket.due_step] -= 1
        tied = [g for g in self._finished.values() if g.tied and g.ticket.due_step == self.step]
        for group in tied:
            del self._finished[group.ticket.index]
        dropped = [t for t in self._running.values() if t.due_step == self.step]
        for ticket in dropped:
            del self._running[ticket.index]
            self._assigned[ticket.due_step] -= 1
        self.num_dropped += len(dropped)
        groups = sorted(chosen, key=lambda g: g.ticket.index) + tied
        taken = TakenStep(self.step, groups, dropped, num_drawn=self._drawn.pop(self.step, 0))
        self._assigned.pop(self.step, None)
        self.step += 1
        return taken

    def advance_clock(self, clock: int) -> None:
        """The engine now holds the weights of `clock` steps.

        After a sync, or after a step that changed nothing.
        """
        assert clock >= self.clock, "the engine's clock never goes back"
        self.clock = clock

    # ------------------------------------------------------------------ state

    @property
    def running(self) -> list[GroupTicket]:
        """Groups admitted and still being played."""
        return list(self._running.values())

    @property
    def num_finished(self) -> int:
        """Played groups waiting in the buffer."""
        return len(self._finished)

    def pending_indices(self) -> list[int]:
        """Task indices admitted but not yet trained on, in order (a checkpoint replays them)."""
        return sorted([*self._running, *self._finished, *self._replay])

    @property
    def next_index(self) -> int:
        """The next fresh task index."""
        return self._next_index


@dataclass(frozen=True)
class BufferSnapshot:
    """The buffer's state at one moment (`GroupBuffer.snapshot`)."""

    next_index: int
    """The next fresh task index."""
    pending: list[int]
    """Task indices admitted but not yet trained on (a checkpoint replays them)."""
    num_finished: int
    """Played groups waiting in the buffer."""
    num_dropped: int
    """Groups dropped so far (`LateGroups.DROP`)."""


class GroupBuffer:
    """An `AdmissionSchedule` shared by the producer thread and the trainer.

    The producer admits and finishes groups; the trainer blocks in `take` until its step is
    ready. `on_change` callbacks run (in the thread that changed the state) whenever an
    admission may have become possible: the producer registers one that wakes its loop.
    """

    def __init__(self, schedule: AdmissionSchedule) -> None:
        self._schedule = schedule
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []
        self._closed: BaseException | None = None

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever admissions may have opened (or the buffer closed)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        self._cond.notify_all()
        for callback in self._listeners:
            callback()

    def admit(self) -> GroupTicket | None:
        """The producer: a ticket for the next group, or None (wait for `on_change`)."""
        with self._cond:
            return None if self._closed is not None else self._schedule.admit()

    def finish(self, ticket: GroupTicket, trajectories: list[Trajectory]) -> None:
        """The producer: a group is played (a tied one may open an admission: refill)."""
        with self._cond:
            self._schedule.finish(ticket, trajectories)
            self._changed()

    def abandon(self, ticket: GroupTicket) -> None:
        """The producer: a group will not finish; its task goes back to the front."""
        with self._cond:
            self._schedule.abandon(ticket)
            self._changed()

    def close(self, error: BaseException) -> None:
        """The producer failed: `take` raises `error` (admissions stop)."""
        with self._cond:
            self._closed = error
            self._changed()

    def take(self, *, poll_s: float = 0.5) -> TakenStep:
        """The trainer: block until the next step is ready and take it.

        Raises:
            BaseException: what the producer closed the buffer with.
        """
        started = time.perf_counter()
        with self._cond:
            while not self._schedule.ready():
                if self._closed is not None:
                    raise self._closed
                # A timeout, so that a Ctrl-C reaches the main thread while it waits.
                self._cond.wait(poll_s)
            taken = self._schedule.take()
            self._changed()
        taken.wait_s = time.perf_counter() - started
        return taken

    def advance_clock(self, clock: int) -> None:
        """The trainer: the engine holds the weights of `clock` steps."""
        with self._cond:
            self._schedule.advance_clock(clock)
            self._changed()

    def running(self) -> list[GroupTicket]:
        """Groups being played now."""
        with self._cond:
            return self._schedule.running

    def snapshot(self) -> BufferSnapshot:
        """Where the buffer stands, read at once."""
        with self._cond:
            s = self._schedule
            return BufferSnapshot(s.next_index, s.pending_indices(), s.num_finished, s.num_dropped)
