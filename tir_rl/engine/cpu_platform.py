"""vLLM-CPU's own settings: KV block sizes it accepts, and its threads' cores.

vLLM-CPU reads how many cores to keep for its frontend and where to bind its compute threads
from environment variables its engine core process inherits; `thread_environment` sets them
from the engine's config for the start only (a user's own setting wins).
`check_platform_settings` refuses what cannot apply on the platform vLLM found.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from tir_rl.engine.start_environment import variable_for_start
from tir_rl.errors import ConfigError
from tir_rl.process.cpu_cores import format_cpu_list, parse_cpu_list

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class CpuSettings(Protocol):
    """The settings of a local engine's config (`VLLMLocalEngine.Config`) read here."""

    cpu_cores: str | int | None
    cpu_reserved_cores: int | None
    block_size: int | None
    cpu_attention_split_kv: bool | None
    async_scheduling: bool
    kv_cache_gib: float | None


CPU_PREFIX_CACHE_BLOCK_SIZE = 32
"""KV block size on a CPU with the prefix cache on: vLLM-CPU's attention takes multiples of 32
(16 fails at start-up), and smaller blocks let short turns hit the cache."""

_RESERVED_CORES_VAR = "VLLM_CPU_NUM_OF_RESERVED_CPU"
_BOUND_CORES_VAR = "VLLM_CPU_OMP_THREADS_BIND"
_SPLIT_KV_VAR = "VLLM_CPU_ATTN_SPLIT_KV"
_MULTIPROCESSING_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def thread_environment(config: CpuSettings) -> Iterator[None]:
    """The reserved-core, thread-binding and KV-split variables of `config`, for a start."""
    reserved = None if config.cpu_reserved_cores is None else str(config.cpu_reserved_cores)
    bound = None
    if config.cpu_cores is not None:
        bound = format_cpu_list(parse_cpu_list(config.cpu_cores, setting="engine.local.cpu_cores"))
    split = config.cpu_attention_split_kv
    with (
        variable_for_start(_RESERVED_CORES_VAR, reserved),
        variable_for_start(_BOUND_CORES_VAR, bound),
        variable_for_start(_SPLIT_KV_VAR, None if split is None else str(int(split))),
    ):
        yield


@contextlib.contextmanager
def worker_in_engine_core() -> Iterator[None]:
    """On a CPU, run the engine's one model worker inside its engine-core process.

    That is vLLM's layout on one GPU. vLLM-CPU otherwise starts the worker as a process of
    its own (it sets the worker's OpenMP threads through that process's environment), and
    every start spawns and imports vLLM twice (`python bench/engine_start.py` measures what
    that costs). `omp_environment` gives the engine-core process the threads the worker
    would have had. vLLM reads the choice while it builds the config (the CPU platform turns
    a one-process executor into its own-process one unless `VLLM_ENABLE_V1_MULTIPROCESSING`
    is 0); `AsyncLLM` runs its engine core in a child process either way. A user's own
    `VLLM_ENABLE_V1_MULTIPROCESSING=1` keeps vLLM's layout.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    with variable_for_start(_MULTIPROCESSING_VAR, "0"):
        yield


@contextlib.contextmanager
def omp_environment(vllm_config: VllmConfig) -> Iterator[None]:
    """The OpenMP variables vLLM-CPU gives its model worker, for the engine core's start.

    Thread count, places and binding, set while the engine-core process starts when that
    process runs the worker itself (`worker_in_engine_core`); nothing otherwise.
    """
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    backend = vllm_config.parallel_config.distributed_executor_backend
    if not current_platform.is_cpu() or backend != "uni":
        yield
        return
    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield


def one_worker_omp_environment() -> contextlib.AbstractContextManager[None]:
    """`omp_environment` for a process that starts one engine core running one worker.

    For tir-rl's `vllm serve` (`tir_rl.engine.in_vllm.serve`), which runs one worker per
    server: the threads do not depend on anything else its config holds. Call it inside
    `worker_in_engine_core`.
    """
    from vllm.config import ParallelConfig, VllmConfig

    one_worker = ParallelConfig(distributed_executor_backend="uni")
    return omp_environment(VllmConfig(parallel_config=one_worker))


def check_platform_settings(config: CpuSettings) -> None:
    """Refuse CPU-only settings elsewhere and block sizes vLLM-CPU rejects; warn of overrides."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if config.cpu_cores is not None:
            raise ConfigError(
                f"engine.local.cpu_cores={config.cpu_cores!r} binds vLLM-CPU's threads; this "
                f"engine runs on {current_platform.device_type}. Leave it unset."
            )
        return
    block_size = config.block_size
    if block_size is not None and block_size % CPU_PREFIX_CACHE_BLOCK_SIZE:
        raise ConfigError(
            f"engine.local.block_size={block_size}: vLLM-CPU's attention takes multiples of "
            f"{CPU_PREFIX_CACHE_BLOCK_SIZE} tokens (16 fails at start-up); use "
            f"{CPU_PREFIX_CACHE_BLOCK_SIZE}, or leave it unset"
        )
    if config.async_scheduling:
        logger.warning("async_scheduling=True is ignored: vLLM's CPU backend turns it off")
    reserved = os.environ.get(_RESERVED_CORES_VAR)
    wanted = config.cpu_reserved_cores
    if reserved is not None and wanted is not None and reserved != str(wanted):
        logger.warning(
            "%s=%s overrides cpu_reserved_cores=%s", _RESERVED_CORES_VAR, reserved, wanted
        )
    bound = os.environ.get(_BOUND_CORES_VAR)
    if bound is not None and config.cpu_cores is not None and str(config.cpu_cores) != bound:
        logger.warning("%s=%s overrides cpu_cores=%s", _BOUND_CORES_VAR, bound, config.cpu_cores)
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if env and config.kv_cache_gib is not None and float(env) != config.kv_cache_gib:
        logger.warning(
            "VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_gib=%s", env, config.kv_cache_gib
        )
