import os

from tir_rl.engine.start_environment import variable_for_start

VAR = "TIR_RL_TEST_ENGINE_VAR"


def test_each_engine_start_gets_its_own_value_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    with variable_for_start(VAR, "0"):
        assert os.environ[VAR] == "0"
    assert VAR not in os.environ
    with variable_for_start(VAR, "1"):  # a second engine in the same process
        assert os.environ[VAR] == "1"
    assert VAR not in os.environ


def test_a_value_the_user_exported_wins_and_stays(monkeypatch):
    monkeypatch.setenv(VAR, "2")
    with variable_for_start(VAR, "0"):
        assert os.environ[VAR] == "2"
    assert os.environ[VAR] == "2"


def test_none_sets_nothing(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    with variable_for_start(VAR, None):
        assert VAR not in os.environ
