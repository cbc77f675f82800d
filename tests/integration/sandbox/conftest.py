"""Shared fixtures: a real warm pool per backend (built image; never skipped: a missing
engine or image fails with the command that fixes it)."""

import pytest

from tir_rl.sandbox.bwrap import BwrapBackend
from tir_rl.sandbox.docker import DockerBackend
from tir_rl.sandbox.image import ImageBuilder


@pytest.fixture(scope="session")
def sandbox_image():
    """Build the image if needed (a content-hash check when up to date)."""
    return ImageBuilder().build()


@pytest.fixture(scope="module")
def docker_backend(sandbox_image):
    return DockerBackend(config=DockerBackend.Config(pool_size=4))


@pytest.fixture(scope="module")
def docker_pool(docker_backend):
    pool = docker_backend.make_pool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def bwrap_pool(sandbox_image):
    pool = BwrapBackend(config=BwrapBackend.Config(pool_size=4)).make_pool()
    yield pool
    pool.close()
