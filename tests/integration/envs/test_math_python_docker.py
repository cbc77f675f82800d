"""A MathPython episode with the real Docker sandbox behind the python tool."""

import pytest

import tir_rl.sandbox
from tir_rl.envs.math_python import MathPythonEnv
from tir_rl.sandbox.image import ImageBuilder
from tir_rl.types import Message, ToolCall

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def docker_sandboxes():
    """The default backend (Docker) with its image built; pools shut down afterwards."""
    ImageBuilder().build()
    yield
    tir_rl.sandbox.shutdown()


def _python(code: str) -> Message:
    return Message.assistant("", [ToolCall("python", {"code": code})])


def test_episode_solves_with_the_sandboxed_python_tool(docker_sandboxes):
    env = MathPythonEnv(families=("power_mod",), split="test")
    _, info = env.reset(seed=0)
    p = info["task"].data["params"]
    replies, _, terminated, _, step_info = env.step(
        _python(f"r = pow({p['a']}, {p['b']}, {p['m']})")
    )
    assert not terminated and step_info["tool_results"][0].ok, replies[0].content
    replies, *_ = env.step(_python("print(r)"))  # state persists within the episode
    assert replies[0].content.strip() == info["task"].answer
    _, reward, terminated, _, _ = env.step(
        Message.assistant(f"<answer>{replies[0].content}</answer>")
    )
    assert terminated and reward == 1.0

    env.reset(seed=1)  # a new episode gets a fresh interpreter
    replies, *_ = env.step(_python("'r' in globals()"))
    assert replies[0].content.strip() == "False"
    env.close()
    env.close()
