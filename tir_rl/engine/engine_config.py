"""The run's engine: `engine.kind` picks the in-process vLLM or a `vllm serve` server.

`EngineConfig` is the `engine` section of a run config. Each key is defined once: the keys
every engine shares (`SamplerSettings`: the dtype and logprobs mode the sampler must use,
what the run accepts from it, how weights reach it) sit at the top of the section; each kind
has a section of its own, the local engine's under `engine.local` (`LocalEngineSettings`:
context length, KV cache, cores, prefix cache) and the servers' under `engine.http`
(`ServerSection`: one server's connection, `ServerConnection`, plus a pool's servers,
routing and hang check). A key of the kind not chosen that differs from its default is
refused at load time, never ignored; a local key at the top of the section, where it was
before each kind had a section, is read as `engine.local`'s with a warning.

`build_engine` starts or connects to the engine named by the config: the local engine, one
server, or a pool of servers (`tir_rl.engine.pool`). A server must have been started on the
run's `model` (same checkpoint path), and it is reset to that checkpoint's weights on
connect, since a server keeps whatever weights its last run sent it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tir_rl.engine.base import Engine
from tir_rl.engine.pool import EnginePool, HangCheck, Routing
from tir_rl.engine.sampler_settings import SAMPLER_SETTING_NAMES, SamplerSettings
from tir_rl.engine.server_connection import ServerConnection
from tir_rl.engine.vllm_http import VLLMHttpEngine
from tir_rl.engine.vllm_local import (
    LOCAL_SETTING_NAMES,
    EngineModel,
    LocalEngineSettings,
    VLLMLocalEngine,
)
from tir_rl.engine.weights.files import read_checkpoint_weights
from tir_rl.errors import ConfigError, EngineError

logger = logging.getLogger(__name__)


class EngineKind(enum.StrEnum):
    """Which engine samples the rollouts."""

    LOCAL = "local"
    """vLLM in this process (`VLLMLocalEngine`), started and stopped by the run."""
    HTTP = "http"
    """A running `vllm serve` server (`VLLMHttpEngine`); the run never starts or stops it."""


HTTP_KEYS = ("model_path", *SAMPLER_SETTING_NAMES)
"""Keys at the top of `engine` (every one but the sections and `kind`): the shared
`SamplerSettings` (checked against the server, or where the weights go) and the model."""


@dataclass(frozen=True, kw_only=True)
class ServerSection(ServerConnection):
    """One server's connection, or a pool's servers and how the pool uses them."""

    base_urls: list[str] = field(default_factory=list)
    """Several servers of the same model, used as one pool (`tir_rl.engine.pool`): an
    episode stays on one server, a new episode goes to the least-loaded one, and a server
    that goes away is left while the run goes on. Give this or `base_url`, not both."""
    routing: Routing = Routing.STICKY
    """How a pool picks a server: `sticky` (an episode stays on its server, for its prefix
    cache; a new one goes to the least-loaded server), or, as controls for measuring what
    that buys, `least_loaded` or `random` (episodes ignored). Only with `base_urls`."""
    hang_check_s: float = 30.0
    """A pool's request or weight load that has waited this long asks its server's `/health`;
    a server that does not answer within `health_timeout_s` is hung (stopped, swapped out,
    wedged): it leaves the pool and its requests go to another server. 0: never ask (a hung
    server then holds its requests for `timeout_s`). Only with `base_urls`."""
    health_timeout_s: float = 10.0
    """How long a pool waits for a server's `/health` when it asks whether it is hung."""

    def validate(self) -> None:
        """Raise `ConfigError` for a pool setting that cannot work."""
        HangCheck(self.hang_check_s, self.health_timeout_s).validate()


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineModel, SamplerSettings):
    """The sampling engine: the shared settings, and each kind's section (`local`, `http`)."""

    MOVED_KEYS: ClassVar[dict[str, tuple[str, str]]] = {
        name: ("local", name) for name in LOCAL_SETTING_NAMES
    }
    """The local engine's keys, at the top of `engine` before each kind had a section: a
    saved config of an older run still loads (`tir_rl.config.loading`)."""
    RETIRED_KEYS: ClassVar[dict[str, tuple[object, str]]] = {
        "allow_truncated_sampling": (
            False,
            "top-p, top-k and min-p are set in the rollout section (rollout.top_p, "
            "rollout.top_k, rollout.min_p) and the trainer replays the kept set, so there is "
            "nothing to allow. Drop the key.",
        ),
    }
    """Keys a saved config of an older version may hold (`tir_rl.config.loading`)."""

    kind: EngineKind = EngineKind.LOCAL
    """`local`: start vLLM in this process, as `engine.local` says. `http`: use the
    `vllm serve` server at `engine.http.base_url` (or the pool of servers
    `engine.http.base_urls`), started on the run's `model` with `VLLM_SERVER_DEV_MODE=1` (see
    docs/scale.md); `weights_dir` is required with the `file` transfer: a folder the server
    reads at the same path."""
    local: LocalEngineSettings = field(default_factory=LocalEngineSettings)
    """The local engine (only with `kind: local`)."""
    http: ServerSection = field(default_factory=ServerSection)
    """The server (only with `kind: http`)."""

    @property
    def prefix_caching(self) -> bool:
        """Whether the sampler caches prefixes (`VLLMLocalEngine.Config.prefix_caching`)."""
        return self.local_config().prefix_caching

    def validate(self) -> None:
        """Refuse settings of the kind not chosen, then check the chosen kind's."""
        self.check_logprobs_mode()
        if self.kind is EngineKind.LOCAL:
            given = _changed(self.http, ServerSection())
            if given:
                raise ConfigError(
                    f"engine.http.{given[0]} is set but engine.kind is local: set "
                    "engine.kind=http to sample from that server, or remove engine.http."
                )
            self.local.validate()
            return
        given = _changed(self.local, LocalEngineSettings())
        if given:
            raise ConfigError(
                f"engine.local.{given[0]} configures the local engine, but engine.kind is "
                f"http: the server's own flags decide it. Remove engine.local.{given[0]} (start "
                "the server with the matching flag), or set engine.kind=local."
            )
        if not self.http.base_url and not self.http.base_urls:
            raise ConfigError(
                "engine.kind is http but engine.http.base_url is not set: give the server's "
                "root, e.g. engine.http.base_url=http://127.0.0.1:8000 (or several servers as "
                "engine.http.base_urls)"
            )
        if self.http.base_url and self.http.base_urls:
            raise ConfigError(
                "engine.http.base_url and engine.http.base_urls are both set: give one server "
                "as base_url, or every server of the pool as base_urls"
            )
        if self.http.routing is not Routing.STICKY and not self.http.base_urls:
            raise ConfigError(
                f"engine.http.routing={self.http.routing.value!r} picks among the servers of a "
                "pool, but engine.http.base_urls is not set: give the servers, or drop the setting"
            )
        self.http.validate()
        if len(set(self.http.base_urls)) != len(self.http.base_urls):
            raise ConfigError(f"engine.http.base_urls lists a server twice: {self.http.base_urls}")
        if self.weights_dir is None and not self.weight_transfer.by_vllm_engine:
            raise ConfigError(
                "engine.kind is http but engine.weights_dir is not set: the trainer's weights "
                "reach the server through this folder, which the server must read at the same "
                "path (e.g. /dev/shm/tir-rl-weights for a server on this machine, or a shared "
                "file system). Or send them over the network: engine.weight_transfer=nccl "
                "(GPUs) or gloo (CPUs), with the servers started for it (docs/scale.md)."
            )
        for url in self.server_urls():
            self.http_config(url).validate()

    def local_config(self) -> VLLMLocalEngine.Config:
        """The local engine's config: the model, the shared settings and `engine.local`."""
        return VLLMLocalEngine.Config(
            model_path=self.model_path, **self.sampler_settings(), **self.local.local_settings()
        )  # type: ignore[arg-type]

    def with_local(self, **changes: object) -> EngineConfig:
        """This config with `engine.local`'s settings `changes` replaced."""
        return dataclasses.replace(self, local=dataclasses.replace(self.local, **changes))

    def server_urls(self) -> list[str]:
        """The server, or every server of the pool (`kind: http`)."""
        return list(self.http.base_urls) or [self.http.base_url]

    def http_config(self, base_url: str | None = None) -> VLLMHttpEngine.Config:
        """One server's engine config: its connection and the shared settings.

        Args:
            base_url: which server (default: `http.base_url`, the only one).
        """
        connection = self.http.connection()
        connection["base_url"] = base_url if base_url is not None else self.http.base_url
        return VLLMHttpEngine.Config(**connection, **self.sampler_settings())  # type: ignore[arg-type]


def _changed(config: object, default: object) -> list[str]:
    """Names of the fields of `default`'s class whose value in `config` differs from it."""
    return [
        f.name
        for f in dataclasses.fields(default)  # type: ignore[arg-type]
        if getattr(config, f.name) != getattr(default, f.name)
    ]


def build_engine(config: EngineConfig, model_path: Path) -> Engine:
    """Start (local) or connect to (http) the engine of `config`, serving `model_path`.

    Raises:
        EngineError: the engine failed to start, or the server serves another model.
    """
    if config.kind is EngineKind.LOCAL:
        return VLLMLocalEngine(
            dataclasses.replace(config.local_config(), model_path=str(model_path))
        )
    if not config.http.base_urls:
        engine = VLLMHttpEngine(config.http_config())
        try:
            _check_served_model(engine, model_path)
            logger.info("resetting %s to the weights of %s", config.http.base_url, model_path)
            asyncio.run(engine.update_weights(read_checkpoint_weights(model_path), version=0))
        except BaseException:
            engine.close()
            raise
        return engine
    return _build_pool(config, model_path)


def _build_pool(config: EngineConfig, model_path: Path) -> EnginePool:
    """Connect to every server of `engine.http.base_urls`; all must be up at the start."""
    members: list[tuple[str, VLLMHttpEngine]] = []
    try:
        for url in config.server_urls():
            engine = VLLMHttpEngine(config.http_config(url))
            members.append((url, engine))
            _check_served_model(engine, model_path)
        pool = EnginePool(
            members,
            weights_dir=config.weights_dir,
            routing=config.http.routing,
            seed=config.local.seed or 0,
            transfer=config.weight_transfer,
            transfer_address=config.transfer_address,
            hang_check=HangCheck(config.http.hang_check_s, config.http.health_timeout_s),
        )
        logger.info("resetting %d servers to the weights of %s", len(members), model_path)
        asyncio.run(pool.update_weights(read_checkpoint_weights(model_path), version=0))
    except BaseException:
        for _, engine in members:
            engine.close()
        raise
    return pool


def _check_served_model(engine: VLLMHttpEngine, model_path: Path) -> None:
    served = engine.model_info.model_path
    if Path(served).resolve() != model_path.resolve():
        raise EngineError(
            f"{engine.config.base_url} serves {served}, but the run's model is {model_path}: "
            "the sampler and the trainer must be the same network. Start the server with "
            f"--model {model_path} (tir_rl.engine.vllm_http.serve_command prints the whole "
            "command), or set the run's model to the checkpoint the server serves."
        )
