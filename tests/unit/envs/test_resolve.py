"""`env.id` resolution: registered ids, Gymnasium's `module:Name-v0`, and `module:Class`."""

import sys
import textwrap
from pathlib import Path

import gymnasium
import pytest

from tir_rl.envs import ToolEnv, check_env
from tir_rl.envs.resolve import env_maker
from tir_rl.errors import ConfigError
from tir_rl.run_config import EnvSection
from tir_rl.runtime import env_factory

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Write modules into a folder on sys.path; forget them and their gym ids afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before_ids = set(gymnasium.registry)
    before_modules = set(sys.modules)

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))

    yield write
    for env_id in set(gymnasium.registry) - before_ids:
        del gymnasium.registry[env_id]
    for module in set(sys.modules) - before_modules:
        del sys.modules[module]


def test_a_registered_id_makes_its_env():
    env = env_maker("tir_rl/MultiHop-v0")(split="test", horizon=2)
    assert isinstance(env.unwrapped, ToolEnv) and env.unwrapped.split == "test"


def test_module_colon_id_imports_the_module_that_registers_it(user_modules):
    user_modules(
        "byo_product",
        (EXAMPLES / "product_env.py").read_text().replace("Product-v0", "ByoProduct-v0"),
    )
    assert "ByoProduct-v0" not in gymnasium.registry
    make = env_factory(EnvSection(id="byo_product:ByoProduct-v0", kwargs={"digits": 3}), "test")
    env = make()
    assert type(env).__name__ == "ProductEnv" and env.split == "test" and env.config.digits == 3
    check_env(env)


def test_module_colon_class_builds_the_class_without_registering(user_modules):
    user_modules(
        "byo_classes",
        (EXAMPLES / "product_env.py").read_text().replace('"Product-v0"', '"ByoUnused-v0"'),
    )
    env = env_factory(EnvSection(id="byo_classes:ProductEnv"), "train")()
    assert type(env).__name__ == "ProductEnv" and env.split == "train"


def test_the_shipped_example_module_resolves_and_passes_check_env(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    check_env(env_factory(EnvSection(id="product_env:Product-v0"), "train")())


def test_a_module_in_the_current_folder_resolves_as_from_the_console_script(
    user_modules, tmp_path, monkeypatch
):
    """`tir-rl` (a console script) has its own folder on sys.path, not the current one."""
    user_modules(
        "byo_here",
        (EXAMPLES / "product_env.py").read_text().replace('"Product-v0"', '"ByoHere-v0"'),
    )
    here = tmp_path / "elsewhere"
    here.mkdir()
    (tmp_path / "byo_here.py").rename(here / "byo_here.py")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(here))])
    env = env_factory(EnvSection(id="byo_here:ProductEnv"), "train")()
    assert type(env).__name__ == "ProductEnv"
    assert sys.path[-1] == str(here)  # looked in after everything installed


def test_a_missing_module_is_refused_with_how_to_make_it_importable():
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_mod_xyz'.*PYTHONPATH"):
        env_maker("no_such_mod_xyz:My-v0")


def test_a_module_whose_dependency_is_missing_names_the_dependency(user_modules):
    user_modules("byo_needs_dep", "import not_installed_dep_xyz\n")
    with pytest.raises(ConfigError, match=r"imports 'not_installed_dep_xyz', which is not"):
        env_maker("byo_needs_dep:My-v0")


def test_a_module_that_raises_on_import_is_reported(user_modules):
    user_modules("byo_broken", "raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match=r"importing module 'byo_broken' raised RuntimeError"):
        env_maker("byo_broken:My-v0")


def test_a_name_the_module_does_not_provide_gets_the_nearest_one(user_modules):
    user_modules(
        "byo_typo",
        (EXAMPLES / "product_env.py").read_text().replace("Product-v0", "ByoTypo-v0"),
    )
    with pytest.raises(ConfigError, match=r"registers no gymnasium id 'ByoTypo-v1'.*'ByoTypo-v0'"):
        env_maker("byo_typo:ByoTypo-v1")


def test_an_unregistered_id_suggests_the_nearest_and_the_module_form():
    with pytest.raises(ConfigError, match=r"'tir_rl/MultiHop-v0'.*module:Name-v0"):
        env_maker("tir_rl/MultiHp-v0")


@pytest.mark.parametrize("env_id", [":My-v0", "mod:"])
def test_an_empty_part_is_refused(env_id):
    with pytest.raises(ConfigError, match="both parts non-empty"):
        env_maker(env_id)


def test_the_example_run_config_names_the_user_env_and_builds_it(monkeypatch):
    from tir_rl.config import load
    from tir_rl.run_config import RunConfig

    monkeypatch.syspath_prepend(str(EXAMPLES))
    config = load(RunConfig, EXAMPLES / "product.yaml")
    assert config.env.id == "product_env:Product-v0"
    assert config.trainer.schedule_steps == config.run.steps  # cosine over the run
    env = env_factory(config.env, config.env.train_split)()
    assert env.config.digits == 3
    check_env(env)
