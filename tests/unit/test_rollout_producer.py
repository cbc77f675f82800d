"""The rollout producer with a scripted FakeEngine: groups flow into the buffer, a weight
update never cuts a tool call, holds and stops leave nothing running."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_fakes import ANSWER, EventLog, FakeEngine, FakeToolEnv, call, max_active
from transformers import AutoTokenizer

from tir_rl.models import prepare_bundled_model
from tir_rl.rollout import Rollout, group_specs
from tir_rl.rollout.buffer import AdmissionSchedule, GroupBuffer, LateGroups
from tir_rl.rollout.producer import RolloutProducer
from tir_rl.types import RolloutStatus


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_bundled_model())


def producer_for(engine, tokenizer, *, k, groups_per_step=1, steps=3, group_size=1,
                 late=LateGroups.WAIT, max_draws_per_step=None, **env_kwargs):  # fmt: skip
    buffer = GroupBuffer(
        AdmissionSchedule(
            groups_per_step=groups_per_step,
            max_staleness=k,
            num_steps=steps,
            late_groups=late,
            max_draws_per_step=max_draws_per_step,
        )
    )
    rollout = Rollout(engine, tokenizer, Rollout.Config(max_turns=3))

    def specs(index: int):
        return group_specs(
            lambda: FakeToolEnv(**env_kwargs),
            None,
            group_size=group_size,
            group_id=index,
            options={"task_index": index},
        )

    producer = RolloutProducer(rollout, buffer, specs, max_concurrent_episodes=8)
    return producer, buffer


def wait_until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def turn_versions(trajectory) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for turn, version, mask in zip(
        trajectory.turn_ids, trajectory.policy_versions, trajectory.loss_mask, strict=True
    ):
        if mask:
            out.setdefault(turn, set()).add(version)
    return out


def test_groups_flow_into_the_buffer_step_by_step(tokenizer):
    engine = FakeEngine(tokenizer, lambda ep, turn: ANSWER)
    producer, buffer = producer_for(engine, tokenizer, k=0, groups_per_step=2, group_size=2)
    producer.start()
    try:
        taken = buffer.take()
        assert taken.step == 0 and [g.ticket.index for g in taken.groups] == [0, 1]
        assert all(len(g.trajectories) == 2 for g in taken.groups)
        assert all(t.status is RolloutStatus.FINISHED for g in taken.groups for t in g.trajectories)
        buffer.advance_clock(1)
        assert [g.ticket.index for g in buffer.take().groups] == [2, 3]
    finally:
        producer.stop()


def test_a_weight_update_during_a_tool_call_leaves_the_call_whole(tokenizer):
    log, release = EventLog(), threading.Event()
    engine = FakeEngine(
        tokenizer,
        lambda ep, turn: call("wait_for_release") if turn == 0 else ANSWER,
        log=log,
    )
    producer, buffer = producer_for(engine, tokenizer, k=1, log=log, release=release)
    producer.start()
    try:
        wait_until(lambda: ("tool_start",) in log.events)
        asyncio.run(engine.update_weights({}, version=1))  # the trainer's step lands now
        release.set()
        (group,) = buffer.take().groups
    finally:
        release.set()
        producer.stop()
    (trajectory,) = group.trajectories
    assert trajectory.status is RolloutStatus.FINISHED
    assert trajectory.messages[3].content == "released"  # the tool's own result, not an error
    assert turn_versions(trajectory) == {0: {0}, 1: {1}}  # the next turn carries the new version
    order = [log.index("tool_start"), log.index("update_weights", 1), log.index("tool_end")]
    assert order == sorted(order)
    assert log.index("tool_end") < log.index("generate", 0, 1)


def test_held_admits_nothing_and_waits_for_the_groups_in_flight(tokenizer):
    log, release = EventLog(), threading.Event()
    engine = FakeEngine(
        tokenizer, lambda ep, turn: call("wait_for_release") if turn == 0 else ANSWER, log=log
    )
    producer, buffer = producer_for(engine, tokenizer, k=2, log=log, release=release)
    producer.start()
    try:
        wait_until(lambda: len(buffer.running()) == 3)  # k = 2: steps 0, 1, 2 admitted

        def hold() -> None:
            with producer.held():
                log.add("held")
                assert buffer.running() == []
            log.add("released hold")

        holder = threading.Thread(target=hold)
        holder.start()
        time.sleep(0.2)
        assert ("held",) not in log.events  # the groups in flight are still in their tools
        release.set()
        holder.join(20)
        assert ("released hold",) in log.events
        assert buffer.snapshot().num_finished == 3  # all three played into the buffer
    finally:
        release.set()
        producer.stop()


def test_stop_cancels_the_groups_in_flight_and_closes_their_envs(tokenizer):
    active: list[int] = []
    release = threading.Event()
    engine = FakeEngine(tokenizer, lambda ep, turn: call("wait_for_release"))
    producer, buffer = producer_for(engine, tokenizer, k=1, release=release, active=active)
    producer.start()
    wait_until(lambda: sum(active) == 2)
    producer.stop()
    release.set()
    wait_until(lambda: sum(active) == 0)  # every env was closed
    assert max_active(active) == 2
    snap = buffer.snapshot()
    next_index, pending, finished = snap.next_index, snap.pending, snap.num_finished
    assert finished == 0 and pending == [0, 1]  # replayed by a resumed run
    assert next_index == 2


def test_drop_cancels_a_late_group_and_admits_a_new_task(tokenizer):
    release = threading.Event()
    engine = FakeEngine(
        tokenizer, lambda ep, turn: call("wait_for_release") if ep == 0 and turn == 0 else ANSWER
    )
    producer, buffer = producer_for(
        engine, tokenizer, k=1, groups_per_step=1, late=LateGroups.DROP, release=release
    )
    producer.start()
    try:
        taken = buffer.take()  # group 0 hangs in its tool; group 1 (due 1) finishes
        assert [g.ticket.index for g in taken.groups] == [1]
        assert [t.index for t in taken.dropped] == [0]
        # Task 2 replaces the dropped group, due at step 1. Let it finish before the clock
        # admits task 3 (due 2), which would otherwise race it to be step 1's first group.
        wait_until(lambda: buffer.snapshot().num_finished == 1)
        buffer.advance_clock(1)
        assert [g.ticket.index for g in buffer.take().groups] == [2]
    finally:
        release.set()
        producer.stop()


class DelayedEngine(FakeEngine):
    """The scripted engine, answering each request after a random delay."""

    def __init__(self, *args, rng, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = rng

    async def generate(self, request):
        await asyncio.sleep(self.rng.expovariate(1 / 0.004))
        return await super().generate(request)


class SlowToolEnv(FakeToolEnv):
    """A FakeToolEnv whose tool turns take a random, heavy-tailed time."""

    rng: random.Random

    def step(self, action):
        time.sleep(min(self.rng.lognormvariate(-6.0, 1.2), 0.2))
        return super().step(action)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(k=st.integers(0, 3), seed=st.integers(0, 1000), group_size=st.integers(1, 3))
def test_threads_keep_the_bound_under_random_engine_and_tool_delays(tokenizer, k, seed,
                                                                    group_size):  # fmt: skip
    rng = random.Random(seed)
    SlowToolEnv.rng = random.Random(seed + 1)
    engine = DelayedEngine(
        tokenizer, lambda ep, turn: call("echo", text="hi") if turn == 0 else ANSWER, rng=rng
    )
    buffer = GroupBuffer(AdmissionSchedule(groups_per_step=2, max_staleness=k, num_steps=5))
    rollout = Rollout(engine, tokenizer, Rollout.Config(max_turns=3))

    def specs(index: int):
        return group_specs(SlowToolEnv, None, group_size=group_size, group_id=index,
                           options={"task_index": index})  # fmt: skip

    producer = RolloutProducer(rollout, buffer, specs, max_concurrent_episodes=4)
    producer.start()
    lags = []
    try:
        for step in range(5):  # the trainer: take, "train", update in flight, advance
            taken = buffer.take(poll_s=0.01)
            assert taken.step == step and len(taken.groups) == 2
            for group in taken.groups:
                for t in group.trajectories:
                    assert t.status is RolloutStatus.FINISHED
                    lags += [step - v for v, m in zip(t.policy_versions, t.loss_mask,
                                                       strict=True) if m]  # fmt: skip
            time.sleep(rng.uniform(0, 0.02))
            asyncio.run(engine.update_weights({}, version=step + 1))
            buffer.advance_clock(step + 1)
    finally:
        producer.stop()
    assert lags and 0 <= min(lags) and max(lags) <= k


@pytest.mark.parametrize("k", [0, 2])
def test_refill_replaces_tied_groups_with_new_tasks_until_each_step_has_signal(tokenizer, k):
    """Every third task's two samples both answer right (a tie); the others split. Each step
    still trains two groups with signal, and takes its tied groups along for the metrics."""
    answered: dict[int, int] = {}
    lock = threading.Lock()

    def script(ep: int, turn: int) -> str:
        with lock:
            answered[ep] = answered.get(ep, 0) + 1
            first = answered[ep] == 1
        return ANSWER if ep % 3 == 0 or first else "<answer>7</answer>"

    engine = FakeEngine(tokenizer, script)
    producer, buffer = producer_for(
        engine, tokenizer, k=k, groups_per_step=2, group_size=2, steps=3, max_draws_per_step=6
    )
    producer.start()
    try:
        seen: list[int] = []
        for step in range(3):
            taken = buffer.take()
            buffer.advance_clock(step + 1)
            signal = [g for g in taken.groups if not g.tied]
            tied = [g for g in taken.groups if g.tied]
            assert len(signal) == 2, taken
            assert all(g.ticket.index % 3 != 0 for g in signal)
            assert all(g.ticket.index % 3 == 0 for g in tied)
            assert taken.num_tied == len(tied)
            if k == 0:  # asynchronous steps may take groups drawn for later steps
                assert taken.num_drawn == len(taken.groups)
            seen += [g.ticket.index for g in taken.groups]
        assert sorted(seen) == sorted(set(seen))  # no task is trained twice
        assert 0 in seen  # task 0 tied, and went with step 0's metrics
    finally:
        producer.stop()
