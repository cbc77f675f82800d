import json
import math

import pytest
import torch

from tir_rl.mismatch.guard import CollapseGuard, GuardAction

RELATIVE = ("train/grad_norm", "mismatch/k3_kl", "mismatch/chi2_token")


def per_step_config(**settings) -> CollapseGuard.Config:
    """Relative rules on the metrics the guard watched before its default changed, absolute
    limits per step, nothing else: what these tests were written against."""
    return CollapseGuard.Config(
        **{"watch": RELATIVE, "failure_tilt_limit": None, "smooth": 1, **settings}
    )


def feed(guard: CollapseGuard, values: list[float], name: str = "mismatch/k3_kl"):
    return [guard.check(step, {name: v}) for step, v in enumerate(values)]


def test_steady_values_never_fire():
    guard = CollapseGuard(per_step_config(factor=10, window=5, min_history=3))
    decisions = feed(guard, [1e-3, 2e-3, 1.5e-3, 3e-3, 1e-3, 2.5e-3, 9e-3])
    assert not any(d.fired for d in decisions)
    assert all(d.apply_update for d in decisions)


def test_a_spike_over_factor_times_the_rolling_median_fires():
    guard = CollapseGuard(per_step_config(factor=10, window=5, min_history=3))
    feed(guard, [1e-3, 2e-3, 1e-3, 1e-3])
    decision = guard.check(4, {"mismatch/k3_kl": 5e-2, "train/grad_norm": 1.0})
    assert decision.fired and decision.action is GuardAction.CONTINUE and decision.apply_update
    (alert,) = decision.alerts
    assert alert.metric == "mismatch/k3_kl" and alert.reason == "relative"
    assert alert.median == pytest.approx(1e-3) and alert.threshold == pytest.approx(1e-2)
    assert alert.step == 4 and alert.value == 5e-2


def test_no_relative_check_before_min_history():
    guard = CollapseGuard(per_step_config(factor=2, min_history=3))
    assert not any(d.fired for d in feed(guard, [1.0, 100.0, 1e4]))
    assert guard.check(3, {"mismatch/k3_kl": 1e9}).fired


def test_the_window_forgets_old_values():
    guard = CollapseGuard(per_step_config(factor=10, window=3, min_history=3))
    feed(guard, [1.0, 1.0, 1.0, 50.0, 50.0, 50.0])  # the 50s flag once, then become the norm
    assert not guard.check(6, {"mismatch/k3_kl": 60.0}).fired
    assert guard.check(7, {"mismatch/k3_kl": 600.0}).fired


def test_absolute_threshold_fires_from_the_first_step_and_on_unwatched_metrics():
    guard = CollapseGuard(per_step_config(absolute={"mismatch/kl": 0.1}))
    decision = guard.check(0, {"mismatch/kl": 0.5})
    assert [a.reason for a in decision.alerts] == ["absolute"]
    assert not guard.check(1, {"mismatch/kl": 0.05}).fired


def test_nonfinite_values_fire_and_stay_out_of_the_history():
    guard = CollapseGuard(per_step_config(min_history=2))
    decision = guard.check(0, {"train/grad_norm": math.nan})
    assert decision.alerts[0].reason == "nonfinite"
    assert guard.state_dict()["history"]["train/grad_norm"] == []


def test_zero_history_uses_the_median_floor():
    guard = CollapseGuard(per_step_config(factor=10, min_history=2, min_median=1e-6))
    feed(guard, [0.0, 0.0, 0.0])
    assert not guard.check(3, {"mismatch/k3_kl": 5e-6}).fired
    assert guard.check(4, {"mismatch/k3_kl": 2e-5}).fired


@pytest.mark.parametrize(
    ("action", "apply"),
    [(GuardAction.CONTINUE, True), (GuardAction.SKIP_STEP, False), (GuardAction.STOP, False)],
)
def test_configured_action_is_returned_on_a_spike(action, apply):
    guard = CollapseGuard(per_step_config(absolute={"train/grad_norm": 5.0}, action=action))
    assert guard.check(0, {"train/grad_norm": 1.0}).action is GuardAction.CONTINUE
    decision = guard.check(1, {"train/grad_norm": 6.0})
    assert decision.action is action and decision.apply_update is apply


def test_offending_batch_and_metrics_are_saved(tmp_path):
    config = per_step_config(absolute={"train/grad_norm": 5.0}, save_dir=tmp_path, max_saved=1)
    guard = CollapseGuard(config)
    batch = {"completion_ids": torch.arange(6).view(2, 3), "advantages": torch.tensor([1.0, -1.0])}
    decision = guard.check(12, {"train/grad_norm": 7.0, "mismatch/kl": 0.3}, batch=batch)
    assert decision.saved_to == tmp_path / "step_000012"
    saved = torch.load(decision.saved_to / "batch_rank0.pt")
    assert torch.equal(saved["completion_ids"], batch["completion_ids"])
    record = json.loads((decision.saved_to / "alert.json").read_text())
    assert record["step"] == 12 and record["metrics"]["mismatch/kl"] == 0.3
    assert record["alerts"][0]["metric"] == "train/grad_norm"
    # max_saved caps the number of saved batches, not the alerts.
    again = guard.check(13, {"train/grad_norm": 9.0}, batch=batch)
    assert again.fired and again.saved_to is None


def test_disabled_guard_does_nothing(tmp_path):
    config = per_step_config(enabled=False, absolute={"train/grad_norm": 0.0}, save_dir=tmp_path)
    assert not CollapseGuard(config).check(0, {"train/grad_norm": 1e9}).fired
    assert list(tmp_path.iterdir()) == []


def test_state_dict_round_trip_keeps_the_decisions():
    config = per_step_config(factor=10, min_history=3)
    a = CollapseGuard(config)
    feed(a, [1.0, 1.0, 1.0])
    b = CollapseGuard(config)
    b.load_state_dict(a.state_dict())
    assert b.check(3, {"mismatch/k3_kl": 20.0}).fired == a.check(3, {"mismatch/k3_kl": 20.0}).fired
    assert b.num_alerts == a.num_alerts == 1


def test_two_alerts_at_the_same_step_keep_their_own_folders(tmp_path):
    # a scoring pass (no update) and the next update share the trainer's step
    guard = CollapseGuard(per_step_config(absolute={"mismatch/k3_kl": 0.01}, save_dir=tmp_path))
    batch = {"completion_ids": torch.arange(4)}
    first = guard.check(3, {"mismatch/k3_kl": 0.5}, batch=batch)
    second = guard.check(3, {"mismatch/k3_kl": 0.7}, batch=batch)
    assert (first.saved_to, second.saved_to) == (
        tmp_path / "step_000003",
        tmp_path / "step_000003_1",
    )
    values = [
        json.loads((d / "alert.json").read_text())["metrics"]["mismatch/k3_kl"]
        for d in (first.saved_to, second.saved_to)
    ]
    assert values == [0.5, 0.7]


def test_a_guard_in_a_run_saves_to_the_run_folder_without_changing_its_config(tmp_path):
    config = per_step_config(absolute={"train/grad_norm": 5.0})
    guard = CollapseGuard(config, run_dir=tmp_path)
    assert guard.save_dir == tmp_path / "alerts" and config.save_dir is None
    assert CollapseGuard(config).save_dir is None  # no run folder: nothing saved
    given = CollapseGuard(per_step_config(save_dir=tmp_path / "mine"), run_dir=tmp_path)
    assert given.save_dir == tmp_path / "mine"


def test_a_smoothed_limit_fires_on_the_trailing_mean_not_on_one_step():
    """A scripted run: the failure tilt sits at 2e-3 with one spike, then climbs."""
    tilt = "mismatch/failure_tilt"
    config = CollapseGuard.Config(watch=(), absolute={tilt: 0.01}, smooth=5)
    stream = [2e-3, 2e-3, 3e-2, 2e-3, 2e-3, 2e-3, 2e-3, 8e-3, 1.2e-2, 1.6e-2, 2e-2, 2.4e-2]
    fired = [d.fired for d in feed(CollapseGuard(config), stream, tilt)]
    # steps 7-11 average (8+12+16+20+24)/5 = 16e-3; steps 6-10 average 11.6e-3: first alert
    assert fired.index(True) == 10 and all(fired[10:])
    assert not any(fired[:10])  # the spike's window 0-4 averages 7.6e-3; windows before 4 unchecked
    per_step = CollapseGuard(CollapseGuard.Config(watch=(), absolute={tilt: 0.01}, smooth=1))
    assert [d.fired for d in feed(per_step, stream, tilt)].index(True) == 2
    (alert,) = feed(CollapseGuard(config), stream, tilt)[10].alerts
    assert alert.reason == "absolute" and alert.value == pytest.approx(11.6e-3)


def test_the_smoothed_window_survives_a_checkpoint_and_a_bad_smooth_is_refused():
    config = CollapseGuard.Config(watch=(), absolute={"mismatch/k3_kl": 1.0}, smooth=3)
    guard = CollapseGuard(config)
    feed(guard, [1.2, 1.2])
    resumed = CollapseGuard(config)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.check(2, {"mismatch/k3_kl": 0.9}).fired  # (1.2 + 1.2 + 0.9) / 3 > 1
    with pytest.raises(ValueError, match="guard.smooth"):
        CollapseGuard(CollapseGuard.Config(smooth=0))
