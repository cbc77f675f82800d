import pytest

from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig
from tir_rl.runtime import play_episodes


@pytest.mark.parametrize(("num", "group_size"), [(0, 1), (2, 0), (-1, 4)])
def test_play_episodes_refuses_empty_counts_before_starting_anything(num, group_size):
    with pytest.raises(ConfigError, match="must be >= 1"):
        play_episodes(RunConfig(), num=num, group_size=group_size)
