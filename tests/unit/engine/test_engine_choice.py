"""`engine.kind` in a run config: defaults, refusals, and what each kind's engine gets."""

import dataclasses

import pytest

from tir_rl import config
from tir_rl.engine.engine_config import HTTP_KEYS, EngineConfig, EngineKind, ServerSection
from tir_rl.engine.sampler_settings import SamplerSettings
from tir_rl.engine.server_connection import ServerConnection
from tir_rl.engine.vllm_http import VLLMHttpEngine
from tir_rl.engine.vllm_local import (
    LOCAL_SETTING_NAMES,
    EngineModel,
    LocalEngineSettings,
    VLLMLocalEngine,
)
from tir_rl.errors import ConfigError
from tir_rl.run_config import RunConfig

HTTP = [
    "model=tiny",
    "engine.kind=http",
    "engine.http.base_url=http://127.0.0.1:8000",
    "engine.weights_dir=/dev/shm/tir-rl-weights",
]


def test_the_default_engine_is_local_with_an_empty_server_section():
    cfg = config.load(RunConfig, None, ["model=tiny", "engine.local.max_model_len=512"])
    assert cfg.engine.kind is EngineKind.LOCAL
    assert cfg.engine.local.max_model_len == 512
    assert cfg.engine.http.base_url == ""


def test_http_settings_reach_the_http_engine_config():
    cfg = config.load(
        RunConfig,
        None,
        [*HTTP, "engine.http.served_model_name=tiny", "engine.http.max_retries=1"],
    )
    http = cfg.engine.http_config()
    assert http == VLLMHttpEngine.Config(
        base_url="http://127.0.0.1:8000",
        served_model_name="tiny",
        max_retries=1,
        dtype="float32",
        weights_dir="/dev/shm/tir-rl-weights",
    )


def test_injected_sampler_dtype_is_what_the_server_must_compute_in():
    cfg = config.load(RunConfig, None, [*HTTP, "inject.sampler_dtype=bfloat16"])
    assert cfg.engine.http_config().dtype == "bfloat16"


@pytest.mark.parametrize("key", ["max_model_len=512", "kv_cache_gib=2", "enforce_eager=false"])
def test_a_local_only_key_is_refused_with_kind_http(key):
    name = key.partition("=")[0]
    with pytest.raises(ConfigError, match=f"engine.local.{name} configures the local engine"):
        config.load(RunConfig, None, [*HTTP, f"engine.local.{key}"])


def test_every_local_only_key_is_refused_with_kind_http():
    default = LocalEngineSettings()
    assert "max_model_len" in LOCAL_SETTING_NAMES and "dtype" not in LOCAL_SETTING_NAMES
    assert set(LOCAL_SETTING_NAMES).isdisjoint(HTTP_KEYS)
    for name in LOCAL_SETTING_NAMES:
        other = _another_value(getattr(default, name)) if name != "cpu_cores" else "0"
        engine = EngineConfig(
            model_path="tiny",
            weights_dir="/w",
            kind=EngineKind.HTTP,
            local=dataclasses.replace(default, **{name: other}),
            http=ServerSection(base_url="http://h:1"),
        )
        with pytest.raises(ConfigError, match=f"engine.local.{name} configures the local"):
            engine.validate()


def test_a_local_key_at_the_top_of_engine_is_read_as_engine_local(caplog):
    """Where the local keys were before each kind had a section: saved configs still load."""
    cfg = config.load(RunConfig, None, ["model=tiny", "engine.max_model_len=512"])
    assert cfg.engine.local.max_model_len == 512
    assert "engine.max_model_len is now engine.local.max_model_len" in caplog.text
    both = ["model=tiny", "engine.max_model_len=512", "engine.local.max_model_len=1024"]
    with pytest.raises(ConfigError, match="old name of engine.local.max_model_len"):
        config.load(RunConfig, None, both)


def test_the_local_engine_gets_the_model_the_shared_and_the_local_settings():
    cfg = config.load(
        RunConfig, None, ["model=tiny", "engine.dtype=bfloat16", "engine.local.kv_cache_gib=2"]
    )
    local = cfg.engine.local_config()
    assert (local.model_path, local.dtype, local.kv_cache_gib) == ("tiny", "bfloat16", 2)
    assert local.seed == cfg.run.seed  # run.seed fills the engine's unset seed


def _another_value(value):
    """A valid value different from `value`, for every type a local engine field has."""
    if isinstance(value, bool):
        return not value
    if value is None:
        return 32
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2
    raise AssertionError(f"no other value for {value!r}")


def test_a_server_section_is_refused_with_kind_local():
    with pytest.raises(ConfigError, match="engine.http.base_url is set but engine.kind is local"):
        config.load(RunConfig, None, ["model=tiny", "engine.http.base_url=http://h:1"])


def test_kind_http_needs_the_server_url_and_a_weights_folder():
    with pytest.raises(ConfigError, match="engine.http.base_url is not set"):
        config.load(RunConfig, None, ["model=tiny", "engine.kind=http"])
    no_folder = [k for k in HTTP if not k.startswith("engine.weights_dir")]
    with pytest.raises(ConfigError, match="engine.weights_dir is not set"):
        config.load(RunConfig, None, no_folder)


def test_a_bad_url_or_kind_is_refused():
    with pytest.raises(ConfigError, match="must start with http"):
        config.load(RunConfig, None, [*HTTP, "engine.http.base_url=127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="'grpc' is not one of 'local', 'http'"):
        config.load(RunConfig, None, ["engine.kind=grpc"])


def test_an_http_run_config_survives_its_saved_copy(tmp_path):
    cfg = config.load(RunConfig, None, HTTP)
    path = tmp_path / "config.yaml"
    config.dump(cfg, path)
    again = config.load(RunConfig, path)
    assert again.engine == cfg.engine and again.engine.kind is EngineKind.HTTP


POOL = [
    "model=tiny",
    "engine.kind=http",
    "engine.http.base_urls=[http://127.0.0.1:8000,http://127.0.0.1:8001]",
    "engine.http.max_retries=1",
    "engine.weights_dir=/dev/shm/tir-rl-weights",
]


def test_a_pool_gives_each_server_its_own_engine_config_with_the_shared_settings():
    cfg = config.load(RunConfig, None, POOL)
    urls = cfg.engine.server_urls()
    assert urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    configs = [cfg.engine.http_config(url) for url in urls]
    assert [c.base_url for c in configs] == urls
    assert all(c.max_retries == 1 for c in configs)
    assert all(c.weights_dir == "/dev/shm/tir-rl-weights" for c in configs)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["engine.http.base_url=http://127.0.0.1:9000"], "both set"),
        (["engine.http.base_urls=[http://127.0.0.1:8000,http://127.0.0.1:8000]"], "twice"),
        (["engine.http.base_urls=[127.0.0.1:8000]"], "must start with http"),
    ],
)
def test_pool_settings_that_cannot_work_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        config.load(RunConfig, None, [*POOL, *extra])


def test_a_single_servers_config_has_no_pool_keys():
    pool_keys = {"base_urls", "routing", "hang_check_s", "health_timeout_s"}
    assert pool_keys <= set(ServerSection.__dataclass_fields__)
    assert pool_keys.isdisjoint(VLLMHttpEngine.Config.__dataclass_fields__)


def test_every_engine_key_is_defined_once():
    """Each key is declared in one class's body; the others inherit it (issue 50)."""
    sections = [
        EngineModel,
        SamplerSettings,
        LocalEngineSettings,
        VLLMLocalEngine.Config,
        ServerConnection,
        VLLMHttpEngine.Config,
        ServerSection,
        EngineConfig,
    ]
    declared = [name for cls in sections for name in cls.__dict__.get("__annotations__", {})]
    assert sorted(name for name in set(declared) if declared.count(name) > 1) == []
    assert set(SamplerSettings.__dataclass_fields__) <= set(
        VLLMHttpEngine.Config.__dataclass_fields__
    )
    assert set(SamplerSettings.__dataclass_fields__) <= set(EngineConfig.__dataclass_fields__)


def test_a_routing_control_needs_a_pool():
    single = [*HTTP, "engine.http.routing=random"]
    with pytest.raises(ConfigError, match="picks among the servers of a pool"):
        config.load(RunConfig, None, single)
    cfg = config.load(RunConfig, None, [*POOL, "engine.http.routing=least_loaded"])
    assert cfg.engine.http.routing.value == "least_loaded"
