import pytest

from tir_rl.config import from_dict, parse_overrides
from tir_rl.errors import ConfigError
from tir_rl.sandbox import Backend, SandboxConfig


def test_overrides_reach_nested_backend_settings():
    config = from_dict(
        SandboxConfig,
        parse_overrides(
            [
                "backend=bwrap",
                "docker.pids_limit=32",
                "docker.preload=[numpy]",
                "bwrap.memory_mb=256",
            ]
        ),
    )
    assert config.backend is Backend.BWRAP
    assert config.docker.pids_limit == 32 and config.docker.preload == ("numpy",)
    assert config.bwrap.memory_mb == 256


def test_unknown_key_names_the_nearest_valid_one():
    with pytest.raises(ConfigError, match="pids_limit"):
        from_dict(SandboxConfig, parse_overrides(["docker.pid_limit=3"]))


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="unsafe-local"):
        from_dict(SandboxConfig, {"backend": "podman"})


def test_negative_pool_size_is_refused():
    with pytest.raises(ConfigError, match="pool_size"):
        from_dict(SandboxConfig, parse_overrides(["docker.pool_size=-1"]))
