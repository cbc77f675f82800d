"""The asynchronous-RL projection (`bench/async_sim.py`) on workloads worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "async_sim.py"
_SPEC = importlib.util.spec_from_file_location("bench_async_sim", _PATH)
sim = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = sim  # dataclasses look their module up while the file runs
_SPEC.loader.exec_module(sim)


def fixed(*, episode_s, train_s=0.0, sync_s=0.0, b=2, g=2):
    return sim.Workload(
        episode_s=sim.Dist(values=(episode_s,)),
        train_s=sim.Dist(values=(train_s,)),
        sync_s=sim.Dist(values=(sync_s,)),
        tasks_per_step=b,
        group_size=g,
        source="test",
    )


def test_k0_with_instant_updates_takes_the_pure_rollout_time_of_heavy_tailed_episodes():
    instant = sim.Dist(median=0.0)
    work = replace(sim.synthetic_workload(), train_s=instant, sync_s=instant)
    setup = sim.Setup(concurrency=64, num_steps=12)
    episode_s, _, _ = sim.draw_durations(work, setup, seed=3)
    b = work.tasks_per_step
    rollout_s = sum(
        max(max(episode_s[i]) for i in range(step * b, (step + 1) * b)) for step in range(12)
    )
    result = sim.simulate(work, setup, k=0, seed=3)
    assert result.makespan_s == pytest.approx(rollout_s)
    assert result.lags and set(result.lags) == {0}


def test_a_record_is_replayed_and_matches_the_schedule_worked_out_by_hand(tmp_path):
    record = {"episode_s": [3.0], "train_s": [2.0], "sync_s": [0.5]}
    path = tmp_path / "record.json"
    path.write_text(json.dumps({**record, "tasks_per_step": 2, "group_size": 2}))
    work = sim.load_record(path)
    setup = sim.Setup(concurrency=4, num_steps=4)
    assert sim.simulate(work, setup, k=0, seed=0).makespan_s == pytest.approx(4 * (3 + 2 + 0.5))
    # k=1: four slots play one step's groups every 3 s; the last step trains and syncs after
    assert sim.simulate(work, setup, k=1, seed=0).makespan_s == pytest.approx(4 * 3 + 2.5)


def test_queued_episodes_wait_for_a_slot_and_more_engines_give_more_slots():
    work = fixed(episode_s=3.0, b=2, g=4)  # 8 episodes a step
    one = sim.simulate(work, sim.Setup(concurrency=4, num_steps=5), k=0, seed=0)
    two = sim.simulate(work, sim.Setup(num_inference=2, concurrency=4, num_steps=5), k=0, seed=0)
    assert one.makespan_s == pytest.approx(5 * 2 * 3.0)  # two waves a step
    assert two.makespan_s == pytest.approx(5 * 3.0)
    assert one.engine_busy == pytest.approx(1.0) and two.engine_busy == pytest.approx(1.0)


def test_without_a_tail_or_an_update_cost_asynchrony_gains_nothing():
    work = fixed(episode_s=2.0, b=3, g=4)
    rows = sim.table(work, sim.Setup(concurrency=12, num_steps=6), [0, 1, 2], [0])
    assert [row["ratio"] for row in rows] == pytest.approx([1.0, 1.0, 1.0])


def test_asynchrony_gains_with_heavy_tailed_episodes_and_lag_stays_within_k():
    work = sim.synthetic_workload()
    setup = sim.Setup(concurrency=64, num_steps=20)
    rows = sim.table(work, setup, [0, 1, 2, 4], [0, 1, 2])
    for row in rows[1:]:
        assert row["ratio_min"] >= 1.0
        assert 0 < row["lag_mean"] <= row["lag_max"] <= row["k"]
    assert rows[1]["ratio"] > 1.2
    assert rows[0]["lag_max"] == 0
    result = sim.simulate(work, setup, k=2, seed=0)
    assert max(result.lags) <= 2
    steps, b, g = 20, work.tasks_per_step, work.group_size
    assert len(result.lags) == steps * b * g * sim.TOKENS_PER_EPISODE  # every token trained


def test_a_seed_reproduces_the_table_and_another_changes_it():
    work = sim.synthetic_workload()
    setup = sim.Setup(num_inference=8, concurrency=64, train_speedup=8.0, num_steps=10)
    first = sim.table(work, setup, [0, 1], [0, 1])
    assert sim.table(work, setup, [0, 1], [0, 1]) == first
    assert sim.table(work, setup, [0, 1], [2, 3]) != first


def saturated_curve():
    """An engine whose total rate is the same at 1 and 2 sequences: alone, one runs 2x."""
    return sim.ThroughputCurve(points=((1, 10.0), (2, 10.0)), source="test")


def test_a_curve_interpolates_between_measured_loads_and_is_flat_beyond_them():
    curve = sim.ThroughputCurve(points=((1, 10.0), (4, 40.0), (8, 48.0)), source="test")
    assert curve.total(2) == pytest.approx(20.0)
    assert curve.total(6) == pytest.approx(44.0)
    assert curve.total(100) == pytest.approx(48.0)
    assert curve.speed(1, reference=8) == pytest.approx(10.0 / 6.0)


def test_the_tail_of_a_step_runs_faster_on_an_engine_that_shares_its_speed():
    work = fixed(episode_s=2.0, b=1, g=3)  # two at a time: two waves, the second alone
    flat = sim.Setup(concurrency=2, num_steps=1)
    shared = replace(flat, curve=saturated_curve(), reference_load=2)
    assert sim.simulate(work, flat, k=0, seed=0).makespan_s == pytest.approx(4.0)
    # both first episodes end at 2 s; the third then runs alone at twice the speed
    assert sim.simulate(work, shared, k=0, seed=0).makespan_s == pytest.approx(3.0)


def test_the_colocated_loop_samples_on_every_device_then_trains_on_every_device():
    work = fixed(episode_s=2.0, train_s=2.0, b=2, g=2)
    setup = sim.Setup(concurrency=4, num_steps=3)
    rows = sim.table(work, setup, [0, 1], [0], trainer_devices=1)
    colocated, separate_k0, separate_k1 = rows
    assert colocated["loop"] == "colocated" and colocated["lag_max"] == 0
    # colocated: 2 s of sampling on two devices, the update on two devices in 1 s
    assert 3 / colocated["groups_per_s"] == pytest.approx(3 * (2.0 + 1.0) / 2)
    assert separate_k0["vs_colocated"] == pytest.approx(3.0 / 4.0)
    # k = 1 overlaps 2 s of sampling with 2 s of training: 2 s a step after the first
    assert separate_k1["vs_colocated"] == pytest.approx((3 * 3.0) / (3 * 2.0 + 2.0))
