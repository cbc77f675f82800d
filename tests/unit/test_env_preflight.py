"""An environment that cannot be built or reset from the config is refused before any engine.

Every episode would hit the same error; a run that starts anyway trains on nothing.
"""

import sys
import textwrap

import pytest

from tir_rl import runtime
from tir_rl.config import load
from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig
from tir_rl.runtime import check_env_starts

ENVS = '''
import gymnasium

from tir_rl.envs import AgentEnv, Task


class Picky(gymnasium.Env):
    """Takes `split` and `width` only (as a plain gymnasium env: a TypeError otherwise)."""

    def __init__(self, split="train", width=3):
        self.split, self.width = split, width

    def reset(self, *, seed=None, options=None):
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        return [], {}

    def step(self, action):
        return [], 0.0, True, False, {}


class FewTasks(AgentEnv):
    """An agent env with only three tasks: index 3 and on raise."""

    def generate_task(self, index):
        if index >= 3:
            raise IndexError(f"no task {index}: there are 3")
        return Task(str(index), "q", "a", self.split, 1, {})
'''


@pytest.fixture
def picky(tmp_path, monkeypatch):
    (tmp_path / "preflight_envs.py").write_text(textwrap.dedent(ENVS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "preflight_envs:Picky"
    sys.modules.pop("preflight_envs", None)


def config(env_id, tmp_path, *sets):
    return load(
        RunConfig, None, ["model=tiny", f"env.id={env_id}", f"run.out_dir={tmp_path}", *sets]
    )


def test_an_option_the_env_does_not_take_is_refused_naming_it_and_the_fix(picky, tmp_path):
    bad = config(picky, tmp_path, "env.kwargs={difficulty: 1}")
    with pytest.raises(ConfigError, match=r"building the environment raised TypeError.*difficulty"):
        check_env_starts(bad.env, "train")
    with pytest.raises(ConfigError, match=r"env.kwargs=\{\}"):
        check_env_starts(bad.env, "train")
    check_env_starts(config(picky, tmp_path, "env.kwargs={width: 2}").env, "test")


def test_a_reset_that_fails_from_the_config_is_refused(picky, tmp_path):
    with pytest.raises(ConfigError, match=r"reset\(seed=0\) raised ValueError: width must be"):
        check_env_starts(config(picky, tmp_path, "env.kwargs={width: 0}").env, "train")


def test_training_and_evaluation_refuse_it_before_any_engine_starts(picky, tmp_path, monkeypatch):
    from tir_rl.evaluate import run_eval
    from tir_rl.rl_loop.loop import run_train

    def no_engine(config):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(runtime, "open_runtime", no_engine)
    bad = config(picky, tmp_path, "env.kwargs={difficulty: 1}")
    with pytest.raises(ConfigError, match="does not start"):
        run_train(bad)
    with pytest.raises(ConfigError, match="does not start"):
        run_eval(bad, num_tasks=2, k=1)


def test_an_agent_env_is_built_and_asked_for_its_first_task_before_any_engine(picky, tmp_path):
    agent_env = picky.replace("Picky", "FewTasks")
    check_env_starts(config(agent_env, tmp_path, "env.kwargs={num_tasks: 3}").env, "train")
    with pytest.raises(ConfigError, match=r"FewTasks has no option\(s\) \['width'\]"):
        check_env_starts(config(agent_env, tmp_path, "env.kwargs={width: 2}").env, "train")
    with pytest.raises(ConfigError, match=r"task_for\(seed=0\) raised IndexError: no task"):
        check_env_starts(config(agent_env, tmp_path, "env.kwargs={num_tasks: 1000}").env, "train")
