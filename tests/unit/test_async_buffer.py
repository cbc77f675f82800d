"""The admission schedule keeps the staleness bound, and the buffer hands out whole steps."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tir_rl.errors import ConfigError
from tir_rl.rollout.buffer import AdmissionSchedule, GroupBuffer, LateGroups


def schedule(*, k: int, b: int = 2, steps: int = 10, late=LateGroups.WAIT, **kw):
    return AdmissionSchedule(
        groups_per_step=b, max_staleness=k, num_steps=steps, late_groups=late, **kw
    )


def admit_all(s: AdmissionSchedule) -> list:
    tickets = []
    while (t := s.admit()) is not None:
        tickets.append(t)
    return tickets


def test_max_staleness_0_admits_one_step_until_the_engine_holds_the_next_weights():
    s = schedule(k=0)
    first = admit_all(s)
    assert [(t.index, t.due_step) for t in first] == [(0, 0), (1, 0)]
    for t in first:
        s.finish(t, [])
    taken = s.take()
    assert [g.ticket.index for g in taken.groups] == [0, 1]
    assert admit_all(s) == []  # trained, not yet synced: the engine holds step 0's weights
    s.advance_clock(1)
    assert [(t.index, t.due_step, t.admitted_clock) for t in admit_all(s)] == [
        (2, 1, 1),
        (3, 1, 1),
    ]


def test_max_staleness_k_admits_k_plus_one_steps_ahead():
    s = schedule(k=2, b=3)
    tickets = admit_all(s)
    assert [t.due_step for t in tickets] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [t.index for t in tickets] == list(range(9))


def test_nothing_is_admitted_beyond_the_last_step():
    s = schedule(k=4, b=2, steps=2)
    assert [t.due_step for t in admit_all(s)] == [0, 0, 1, 1]


def test_wait_takes_no_step_while_a_group_due_at_it_runs():
    s = schedule(k=1)
    a, b, c, d = admit_all(s)  # a, b due 0; c, d due 1
    s.finish(b, [])
    s.finish(c, [])
    s.finish(d, [])
    assert not s.ready()  # `a` is due now and still running
    s.finish(a, [])
    taken = s.take()
    assert [g.ticket.index for g in taken.groups] == [0, 1]
    assert taken.dropped == []


def test_a_step_fills_up_with_later_groups_which_frees_their_slots():
    s = schedule(k=1)
    a, b, c, d = admit_all(s)
    s.finish(a, [])
    s.finish(c, [])
    s.finish(b, [])
    s.take()  # step 0 takes a and b
    s.advance_clock(1)
    new = admit_all(s)  # due 1 is full (c, d); due 2 opens
    assert [t.due_step for t in new] == [2, 2]
    s.finish(d, [])
    s.finish(new[0], [])
    taken = s.take()  # step 1: c, d
    assert [g.ticket.index for g in taken.groups] == [2, 3]


def test_drop_takes_the_first_finished_groups_and_drops_the_late_ones():
    s = schedule(k=1, late=LateGroups.DROP)
    a, b, c, d = admit_all(s)
    s.finish(b, [])
    s.finish(c, [])
    assert s.ready()
    taken = s.take()
    assert [g.ticket.index for g in taken.groups] == [1, 2]
    assert [t.index for t in taken.dropped] == [0]
    assert s.num_dropped == 1
    assert s.finish(a, []) is False  # a dropped group's result is discarded
    s.advance_clock(1)
    assert [t.due_step for t in admit_all(s)] == [1, 2, 2]  # c's slot at 1 was freed


def test_an_abandoned_group_is_replayed_first_and_listed_as_pending():
    s = schedule(k=0)
    a, b = admit_all(s)
    s.abandon(a)
    assert s.pending_indices() == [0, 1]
    again = s.admit()
    assert again.index == 0 and again.due_step == 0


def test_a_resumed_schedule_replays_its_pending_tasks_then_goes_on():
    s = schedule(k=0, b=2, first_step=3, next_index=8, replay=[5, 7])
    assert [(t.index, t.due_step) for t in admit_all(s)] == [(5, 3), (7, 3)]
    s.advance_clock(3)


def test_negative_staleness_is_refused():
    with pytest.raises(ConfigError, match="max_staleness"):
        schedule(k=-1)


def simulate(
    *,
    k: int,
    late: LateGroups,
    seed: int,
    groups_per_step: int,
    num_steps: int,
    concurrency: int,
    skip_probability: float,
):
    """Discrete-event run of producer and trainer over random, heavy-tailed durations.

    Each group samples tokens at random moments between its start and its end; a token
    carries the engine's policy version at that moment. Returns every trained token's lag
    and what happened to every admitted group.
    """
    rng = random.Random(seed)
    s = schedule(k=k, b=groups_per_step, steps=num_steps, late=late)
    now, version, trainer_version = 0.0, 0, 0
    events: list = []  # (time, order, kind, payload)
    order = 0
    running: dict[int, tuple] = {}  # index -> (ticket, token versions so far)
    queued: list = []  # admitted, waiting for a concurrency slot
    trained_lags: list[int] = []
    trained: list[int] = []
    dropped: list[int] = []
    trainer_busy = False

    def push(at, kind, payload):
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, payload))

    def start_groups():
        while (t := s.admit()) is not None:
            queued.append(t)
        while queued and len(running) < concurrency:
            t = queued.pop(0)
            running[t.index] = (t, [])
            duration = rng.lognormvariate(0.0, 1.2)  # heavy tail
            for _ in range(rng.randint(1, 4)):  # token samples within the episode
                push(now + rng.uniform(0, duration), "token", t.index)
            push(now + duration, "finish", t)

    def try_train():
        nonlocal trainer_busy
        if trainer_busy or s.step >= num_steps or not s.ready():
            return
        taken = s.take()
        for g in taken.groups:
            trained.append(g.ticket.index)
            trained_lags.extend(trainer_version - v for v in g.trajectories)
        for t in taken.dropped:
            dropped.append(t.index)
            running.pop(t.index, None)
        trainer_busy = True
        push(now + rng.uniform(0.1, 2.0), "trained", taken.step)

    start_groups()
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "token" and payload in running:
            running[payload][1].append(version)
        elif kind == "finish" and payload.index in running:
            _, versions = running.pop(payload.index)
            s.finish(payload, versions)
        elif kind == "trained":
            if rng.random() >= skip_probability:  # an update: the sync bumps the version
                trainer_version += 1
                version = trainer_version
            s.advance_clock(payload + 1)
            trainer_busy = False
        start_groups()
        try_train()
    return s, trained, trained_lags, dropped


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 4),
    late=st.sampled_from(list(LateGroups)),
    seed=st.integers(0, 10_000),
    groups_per_step=st.integers(1, 4),
    concurrency=st.integers(1, 12),
    skip_probability=st.sampled_from([0.0, 0.3]),
)
def test_no_token_ever_lags_more_than_k_under_random_delays(
    k, late, seed, groups_per_step, concurrency, skip_probability
):
    num_steps = 6
    s, trained, lags, dropped = simulate(
        k=k,
        late=late,
        seed=seed,
        groups_per_step=groups_per_step,
        num_steps=num_steps,
        concurrency=concurrency,
        skip_probability=skip_probability,
    )
    assert s.step == num_steps, "the run took every step"
    assert len(trained) == num_steps * groups_per_step, "each step took a full batch"
    assert lags and all(0 <= lag <= k for lag in lags)
    assert len(set(trained)) == len(trained), "no group trained twice"
    if late is LateGroups.WAIT:
        assert dropped == []
        assert sorted(trained) == list(range(len(trained))), "every admitted task trained on"
    assert not set(dropped) & set(trained)


def test_the_bound_is_what_limits_the_lag():
    """Red check for the property above: with the bound lifted, lags exceed it."""
    worst = 0
    for seed in range(20):
        s, _, lags, _ = simulate(
            k=6,
            late=LateGroups.WAIT,
            seed=seed,
            groups_per_step=2,
            num_steps=8,
            concurrency=12,
            skip_probability=0.0,
        )
        worst = max(worst, max(lags))
    assert worst > 1  # so a k=1 bound is doing work when the property test holds it


def test_buffer_take_raises_what_the_producer_closed_it_with():
    buffer = GroupBuffer(schedule(k=0))
    buffer.close(RuntimeError("producer bug"))
    with pytest.raises(RuntimeError, match="producer bug"):
        buffer.take(poll_s=0.01)
    assert buffer.admit() is None


def test_a_finished_run_resumed_admits_nothing():
    s = schedule(k=2, steps=3, first_step=3, next_index=6)
    assert s.admit() is None and s.pending_indices() == []


# ---------------------------------------------------------------- zero-variance refill


@dataclass(frozen=True)
class PlayedFake:
    """A played episode as the buffer reads it: its reward alone (a fake trajectory)."""

    reward: float


def played(*rewards: float) -> list:
    return [PlayedFake(r) for r in rewards]


TIED, SIGNAL = played(1.0, 1.0), played(0.0, 1.0)


def test_refill_draws_a_new_task_for_each_tied_group_of_the_step():
    s = schedule(k=0, b=2, max_draws_per_step=4)
    first = admit_all(s)
    assert [t.index for t in first] == [0, 1]
    s.finish(first[0], TIED)  # gives its place back: a new task is drawn for step 0
    assert not s.ready()
    (again,) = admit_all(s)
    assert (again.index, again.due_step) == (2, 0)
    s.finish(first[1], SIGNAL)
    assert not s.ready()
    s.finish(again, SIGNAL)
    taken = s.take()
    assert [g.ticket.index for g in taken.groups] == [1, 2, 0]  # with signal first, then tied
    assert [g.tied for g in taken.groups] == [False, False, True]
    assert taken.num_drawn == 3 and taken.num_tied == 1


def test_refill_stops_at_its_bound_and_the_step_trains_what_it_has():
    s = schedule(k=0, b=2, max_draws_per_step=3)
    tickets = admit_all(s)
    s.finish(tickets[0], TIED)
    tickets += admit_all(s)
    s.finish(tickets[1], TIED)
    assert admit_all(s) == []  # three drawn: the bound
    assert not s.ready()  # the third is still being played
    s.finish(tickets[2], SIGNAL)
    taken = s.take()
    assert [(g.ticket.index, g.tied) for g in taken.groups] == [(2, False), (0, True), (1, True)]
    assert taken.num_drawn == 3


def test_without_refill_a_tied_group_keeps_its_place():
    s = schedule(k=0, b=2)
    first = admit_all(s)
    s.finish(first[0], TIED)
    assert admit_all(s) == []
    s.finish(first[1], SIGNAL)
    taken = s.take()
    assert [g.ticket.index for g in taken.groups] == [0, 1] and taken.num_tied == 0


def test_refill_below_the_step_size_is_refused():
    with pytest.raises(ConfigError, match="max_tasks_per_step"):
        schedule(k=0, b=4, max_draws_per_step=3)


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(0, 2),
    b=st.integers(1, 3),
    extra=st.integers(0, 3),
    seed=st.integers(0, 10_000),
    late=st.sampled_from(list(LateGroups)),
)
def test_refill_keeps_the_staleness_bound_and_fills_every_step_it_can(k, b, extra, seed, late):
    """Groups finish in random order and tie at random; every step holds b groups with signal
    unless it drew its bound, and no group is trained later than its due step."""
    rng = random.Random(seed)
    bound = b + extra
    s = schedule(k=k, b=b, steps=6, late=late, max_draws_per_step=bound)
    running: list = []
    for step in range(6):
        while True:
            running += admit_all(s)
            if s.ready():
                break
            assert running, "a step that is not ready has a group in play"
            ticket = running.pop(rng.randrange(len(running)))
            s.finish(ticket, TIED if rng.random() < 0.5 else SIGNAL)
        taken = s.take()
        running = [t for t in running if t not in taken.dropped]
        assert taken.step == step
        with_signal = [g for g in taken.groups if not g.tied]
        assert all(g.ticket.due_step >= step for g in taken.groups)
        assert len(with_signal) == b or taken.num_drawn == bound
        assert len(with_signal) <= b and taken.num_drawn <= bound
        s.advance_clock(step + 1)
