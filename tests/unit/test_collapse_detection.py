"""The detection study (`collapse_lab.detection`): firing steps, warnings, leads, false alarms."""

from collapse_lab.detection import K3_KEY, above, above_baseline, judge


def _rows(values: list[float]) -> list[dict]:
    return [{"step": i + 1, K3_KEY: v} for i, v in enumerate(values)]


def test_a_firing_inside_the_window_warns_with_its_lead_and_an_earlier_one_is_a_false_alarm():
    found = judge([10, 95, 97, 100], collapse_step=100, window=25)
    assert found.lead == 5
    assert found.false_alarm
    clean = judge([80, 99], collapse_step=100, window=25)
    assert clean.lead == 20
    assert not clean.false_alarm


def test_a_firing_after_the_collapse_does_not_warn():
    found = judge([101, 120], collapse_step=100, window=25)
    assert found.lead is None
    assert not found.false_alarm


def test_any_firing_in_a_run_that_never_collapsed_is_a_false_alarm():
    assert judge([3], collapse_step=None, window=25).false_alarm
    assert not judge([], collapse_step=None, window=25).false_alarm


def test_the_threshold_applies_to_the_trailing_mean():
    rows = _rows([0.0, 0.0, 0.0, 3.0, 0.0, 0.0])
    assert above(K3_KEY, 0.5, smooth=1)(rows) == [4]
    assert above(K3_KEY, 0.5, smooth=3)(rows) == [4, 5, 6]
    assert above(K3_KEY, 1.5, smooth=3)(rows) == []


def test_the_baseline_is_the_runs_own_early_median_and_never_fires_inside_it():
    rows = _rows([1.0, 2.0, 50.0, 1.0, 2.0, 25.0, 2.0])
    fire = above_baseline(K3_KEY, 10.0, smooth=1, baseline=3)  # median 2 -> threshold 20
    assert fire(rows) == [6]
    assert above_baseline(K3_KEY, 10.0, smooth=1, baseline=7)(rows) == []
