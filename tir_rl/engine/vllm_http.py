"""A running vLLM OpenAI-compatible server behind the `Engine` contract, through httpx.

Requests go to `/v1/completions` with the prompt given as token ids, `return_token_ids`
and `logprobs=0`; the response's `token_ids` and `logprobs.token_logprobs` are the sampled
ids and their processed logprobs. Connection failures and 502/503/504 are retried with
exponential backoff; 4xx answers are not retried and become `EngineError` for that request.

On connect, the engine checks that the server serves the configured model and uses
`processed_logprobs`: from `/server_info` when the server runs with
`VLLM_SERVER_DEV_MODE=1`, otherwise by a probe (the gap between two tokens' logprobs at
temperature 0.5 must be twice the raw gap from prompt logprobs).

Multi-token stop sequences: the completions API only knows single stop token ids and
text stops, so the full completion comes back and is cut right after the first stop
sequence on ids (the tokens up to the cut are identical to a native stop; only the
compute after it is wasted).

Weight updates (`weight_transfer`, see `tir_rl.engine.weights.transfer`): with `nccl` or `gloo` the
weights go through vLLM's transfer engines and its `/update_weights` routes (the server is
started with the matching `--weight-transfer-config`). With `file` (the default) this
engine publishes the state dict
under `Config.weights_dir` (a folder the server sees at the same path; each version in a
folder of its own, marked ready before the server is told of it) and calls the dev-mode
endpoint `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path":
DIR}}`, then `POST /reset_prefix_cache`. Start the server with `VLLM_SERVER_DEV_MODE=1`.

An update lands between engine requests: it waits until the requests in flight have
returned and holds new ones back until the server has the new weights, so every request is
sampled by one version of the weights and labelled with it (`/v1/completions` does not
report vLLM's per-token version spans; the local engine keeps requests in flight instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tir_rl.engine._loop import LoopThread
from tir_rl.engine.base import (
    PROCESSED_LOGPROBS,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    SingleEngine,
    truncate_at_stop_sequence,
)
from tir_rl.engine.in_vllm.server_guard import SERVER_GUARD, WEIGHTS_DIGEST_HEADER
from tir_rl.engine.sampler_settings import SamplerSettings
from tir_rl.engine.server_connection import ServerConnection, authorization_headers, http_error
from tir_rl.engine.vllm_outputs import finish_reason
from tir_rl.engine.weights.clients import HttpTransferClient
from tir_rl.engine.weights.files import PublishedWeights, check_published, publish_state_dict
from tir_rl.engine.weights.transfer import (
    TransferRound,
    send_to_engine,
    transfer_group_for,
)
from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError

if TYPE_CHECKING:
    import httpx
    import torch

    from tir_rl.engine.vllm_local import VLLMLocalEngine

logger = logging.getLogger(__name__)

_RETRY_STATUS = (502, 503, 504)
NEUTRAL_SAMPLING = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
"""Under every request's own settings: a server fills what a request leaves out from the
model's `generation_config.json` (vLLM's `--generation-config auto`, its default), and a card
that asks for a repetition penalty (Qwen2.5: 1.05) or a top_k would change the processed
logprobs in a way the trainer does not replay. A request names what it wants on top."""
_PROBE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
_PROBE_TEMPERATURE = 0.5


class VLLMHttpEngine(SingleEngine):
    """Client of a vLLM OpenAI-compatible server (`vllm serve`)."""

    @dataclass(frozen=True, kw_only=True)
    class Config(SamplerSettings, ServerConnection):
        """One server's address and what it must serve (`SamplerSettings`)."""

        def validate(self) -> None:
            """Raise `ConfigError` for unusable values."""
            self.validate_connection()
            self.check_logprobs_mode()

    def __init__(self, config: Config) -> None:
        config.validate()
        self.config = config
        self._closed = False
        self._version = 0
        self._transfer_group = transfer_group_for(config.weight_transfer, config.transfer_address)
        self._loop = LoopThread("tir-rl-vllm-http")
        try:
            self._gate = self._loop.run_sync(_make_gate())
            self._client = self._loop.run_sync(_make_client(config))
            self._info = self._loop.run_sync(self._connect())
        except BaseException:
            self.close()
            raise

    @property
    def model_info(self) -> ModelInfo:
        """The served model and the settings that matter for parity."""
        return self._info

    @property
    def policy_version(self) -> int:
        """The version label of the weights the server samples with now (0 at start)."""
        return self._version

    # -- connection and checks ---------------------------------------------------------------

    async def _connect(self) -> ModelInfo:
        c = self.config
        models = (await self._request("GET", "/v1/models")).json()["data"]
        names = [m["id"] for m in models]
        name = c.served_model_name
        if name is None and len(models) != 1:
            raise EngineError(
                f"{c.base_url} serves {names}: set engine.http.served_model_name to one of them"
            )
        chosen = next((m for m in models if name in (None, m["id"])), None)
        if chosen is None:
            raise EngineError(
                f"{c.base_url} serves {names}, not the configured model {name!r}: start the "
                "server with --served-model-name, or fix engine.http.served_model_name"
            )
        self._model = chosen["id"]
        server = await self._server_config()
        if server is not None:
            mode = server["model_config"].get("logprobs_mode")
            dtype = str(server["model_config"].get("dtype", "unknown")).removeprefix("torch.")
            caching = server.get("cache_config", {}).get("enable_prefix_caching")
        else:
            mode = await self._probe_logprobs_mode()
            dtype, caching = "unknown", None
        if mode != c.logprobs_mode and not c.allow_other_logprobs_mode:
            raise EngineError(
                f"{c.base_url} returns {mode!r} logprobs, the config expects {c.logprobs_mode!r}: "
                f"restart the server with --logprobs-mode {c.logprobs_mode}"
            )
        if dtype not in ("unknown", c.dtype):
            raise EngineError(
                f"{c.base_url} computes in {dtype}, the config expects {c.dtype}: restart the "
                f"server with --dtype {c.dtype}, or fix engine.dtype"
            )
        return ModelInfo(
            model_path=chosen.get("root") or self._model,
            dtype=dtype,
            max_model_len=int(chosen.get("max_model_len") or 0),
            logprobs_mode=mode,
            enable_prefix_caching=caching,
        )

    async def _server_config(self) -> dict[str, Any] | None:
        """The server's vLLM config from the dev-mode `/server_info`, or None without it."""
        response = await self._request(
            "GET", "/server_info", params={"config_format": "json"}, ok_statuses=(404,)
        )
        if response.status_code == 404:
            return None
        return response.json()["vllm_config"]

    async def _probe_logprobs_mode(self) -> str:
        """Tell processed from raw logprobs without the server's config.

        Processed logprobs are `log_softmax(logits / T)`, so the gap between two tokens'
        logprobs at temperature T is the raw gap (prompt logprobs) divided by T.
        """
        sampled = await self._completion(
            _PROBE_PROMPT, max_tokens=1, temperature=_PROBE_TEMPERATURE, seed=0, logprobs=5
        )
        token = sampled["token_ids"][0]
        top_processed = {
            int(k.removeprefix("token_id:")): v
            for k, v in sampled["logprobs"]["top_logprobs"][0].items()
        }
        scored = await self._completion(
            [*_PROBE_PROMPT, token], max_tokens=1, temperature=1.0, seed=0, prompt_logprobs=5
        )
        top_raw = {int(k): v["logprob"] for k, v in scored["prompt_logprobs"][-1].items()}
        common = sorted(set(top_processed) & set(top_raw), key=top_raw.__getitem__)
        if len(common) < 2 or top_raw[common[-1]] - top_raw[common[0]] < 1e-3:
            raise EngineError(f"{self.config.base_url}: logprobs-mode probe was inconclusive")
        lo, hi = common[0], common[-1]
        ratio = (top_processed[hi] - top_processed[lo]) / (top_raw[hi] - top_raw[lo])
        normalized = sum(math.exp(v) for v in top_processed.values()) <= 1 + 1e-4
        if abs(ratio - 1 / _PROBE_TEMPERATURE) < 0.05 and normalized:
            return PROCESSED_LOGPROBS
        if abs(ratio - 1) < 0.05:
            return "raw_logprobs" if normalized else "raw_logits"
        return "processed_logits" if abs(ratio - 1 / _PROBE_TEMPERATURE) < 0.05 else "unknown"

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample a continuation of `request.prompt_token_ids` on the server.

        Raises:
            ConfigError: the request is invalid or uses refused sampling settings.
            EngineError: the server rejected or failed this request, or is unreachable.
        """
        request.validate()
        if not request.read_prefix_cache:
            raise ConfigError(
                "read_prefix_cache=False: a vllm serve server has no per-request switch for "
                "its prefix cache; compare the two paths on a local engine (engine.kind=local)"
            )
        self._check_open()
        return await self._loop.run(self._generate(request))

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        async with self._gate.request():
            version = self._version
            choice = await self._completion(
                request.prompt_token_ids,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k or 0,
                min_p=request.min_p,
                seed=request.seed,
                stop_token_ids=list(request.stop_token_ids),
                logprobs=0,
            )
        token_ids = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        token_ids, logprobs, stop = truncate_at_stop_sequence(
            token_ids, logprobs, request.stop_token_sequences
        )
        if stop is not None:
            finish = FinishReason.STOP
        else:
            finish = finish_reason(choice.get("finish_reason"))
            if finish == FinishReason.STOP and token_ids:
                stop = (token_ids[-1],)
        return GenerateResult(
            token_ids=token_ids,
            logprobs=logprobs,
            policy_versions=[version] * len(token_ids),
            finish_reason=finish,
            stop_sequence=stop,
            num_prompt_tokens=len(request.prompt_token_ids),
        )

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each of `token_ids[1:]` given its prefix, at temperature 1 (raw)."""
        if len(token_ids) < 2:
            raise ConfigError("prompt_logprobs needs at least 2 tokens")
        self._check_open()
        return await self._loop.run(self._prompt_logprobs(list(token_ids)))

    async def _prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        choice = await self._completion(
            token_ids, max_tokens=1, temperature=1.0, seed=0, prompt_logprobs=0
        )
        entries = choice["prompt_logprobs"][1:]
        return [
            float(entry[str(tok)]["logprob"])
            for entry, tok in zip(entries, token_ids[1:], strict=True)
        ]

    async def _completion(self, prompt: Sequence[int], **params: Any) -> dict[str, Any]:
        body = {
            "model": self._model,
            "prompt": list(prompt),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            **NEUTRAL_SAMPLING,
            **params,
        }
        response = await self._request("POST", "/v1/completions", json=body)
        return response.json()["choices"][0]

    # -- weights ------------------------------------------------------------------------------

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> None:
        """Send `state_dict` to the server: by transfer, or through the shared `weights_dir`.

        Lands between requests (see the module docstring); later requests carry `version`
        (None keeps the current label).

        Raises:
            ConfigError: no `weights_dir` configured for `weight_transfer: file`.
            EngineError: the server lacks the dev-mode endpoints or the update failed.
        """
        self._check_open()
        if self._transfer_group is not None:
            await send_to_engine(self._transfer_group, self, state_dict, version)
            return
        if self.config.weights_dir is None:
            raise ConfigError(
                "VLLMHttpEngine.update_weights needs engine.weights_dir: a folder the server "
                "reads at the same path (local disk, /dev/shm or a shared file system)"
            )
        folder = Path(self.config.weights_dir)
        await self._loop.run(self._update(state_dict, folder, version))

    async def _update(
        self, state_dict: Mapping[str, torch.Tensor], folder: Path, version: int | None
    ) -> None:
        published = await asyncio.to_thread(publish_state_dict, state_dict, folder, version=version)
        await self._load(published)

    async def responsive(self, timeout_s: float) -> bool:
        """Whether the server answers `/health` with 200 within `timeout_s`."""
        self._check_open()
        return await self._loop.run(self._responsive(timeout_s))

    async def _responsive(self, timeout_s: float) -> bool:
        import httpx

        url = f"{self.config.base_url.rstrip('/')}/health"
        try:
            response = await self._client.get(url, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def load_published(self, weights: PublishedWeights) -> None:
        """Make the server reload a version published by `publish_state_dict`.

        How a pool gives its servers one copy of the weights: the file is written once and
        every server reads it. Lands between requests, like `update_weights`.

        Raises:
            EngineError: the folder is not a complete published version, or the reload
                failed (`EngineUnavailableError` when the server is gone).
        """
        self._check_open()
        await self._loop.run(self._load(weights))

    async def _load(self, weights: PublishedWeights) -> None:
        check_published(weights)
        async with self._gate.update():
            await self._reload(str(weights.folder.resolve()), weights.sha256)
            if weights.version is not None:
                self._version = weights.version

    def transfer_client(self) -> HttpTransferClient:
        """The server's weight-sync routes, for a `TransferGroup`."""
        return HttpTransferClient(self.config, self.config.weight_transfer)

    async def receive_transfer(self, round_: TransferRound, version: int | None) -> None:
        """Hold requests as for an update while `round_` sends; then label `version`."""
        self._check_open()
        await self._loop.run(self._receive_transfer(round_, version))

    async def _receive_transfer(self, round_: TransferRound, version: int | None) -> None:
        async with self._gate.update():
            await asyncio.to_thread(round_.hold)
            await self._request("POST", "/reset_prefix_cache")
            if version is not None:
                self._version = version

    async def _reload(self, folder: str, sha256: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        response = await self._request(
            "POST",
            "/collective_rpc",
            json=body,
            headers={WEIGHTS_DIGEST_HEADER: sha256},
            ok_statuses=(404,),
        )
        if response.status_code == 404:
            raise EngineError(
                f"{self.config.base_url} has no /collective_rpc endpoint: start the server with "
                "VLLM_SERVER_DEV_MODE=1 to allow weight updates over HTTP"
            )
        await self._request("POST", "/reset_prefix_cache")

    # -- plumbing -----------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, *, ok_statuses: tuple[int, ...] = (), **kwargs: Any
    ) -> httpx.Response:
        """Send with retries on connection errors and 502/503/504; raise on other errors."""
        import httpx

        unreachable = (
            httpx.ConnectError,
            httpx.ConnectTimeout,
            httpx.RemoteProtocolError,  # the server closed the connection mid-answer
            httpx.ReadError,
            httpx.WriteError,
        )
        c = self.config
        url = f"{c.base_url.rstrip('/')}{path}"
        for attempt in range(c.max_retries + 1):
            last = attempt == c.max_retries
            try:
                response = await self._client.request(method, url, **kwargs)
            except unreachable as exc:  # sent again: sampling has no side effect
                if last:
                    raise EngineUnavailableError(
                        f"{method} {url}: server unreachable after {attempt + 1} attempts "
                        f"({type(exc).__name__}: {exc}); is `vllm serve` running there?"
                    ) from exc
            except httpx.TimeoutException as exc:
                raise EngineError(
                    f"{method} {url}: no answer within {c.timeout_s} s; raise "
                    "engine.http.timeout_s or lower the load"
                ) from exc
            except httpx.HTTPError as exc:
                raise EngineError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
            else:
                if response.is_success or response.status_code in ok_statuses:
                    return response
                if response.status_code not in _RETRY_STATUS or last:
                    raise http_error(method, url, response, c)
            await asyncio.sleep(c.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the engine is closed; build a new VLLMHttpEngine")

    def close(self) -> None:
        """Close the HTTP client (the server keeps running; idempotent)."""
        if self._closed:
            return
        self._closed = True
        group = getattr(self, "_transfer_group", None)
        if group is not None:
            with contextlib.suppress(Exception):
                group.close()
        client = getattr(self, "_client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                self._loop.run_sync(client.aclose(), timeout_s=10)
        self._loop.stop()

    def __enter__(self) -> VLLMHttpEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _UpdateGate:
    """Requests run together; a weight update waits for them to return and holds new ones."""

    def __init__(self) -> None:
        self._idle = asyncio.Condition()
        self._in_flight = 0
        self._updating = False

    @contextlib.asynccontextmanager
    async def request(self) -> Any:
        async with self._idle:
            await self._idle.wait_for(lambda: not self._updating)
            self._in_flight += 1
        try:
            yield
        finally:
            async with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    @contextlib.asynccontextmanager
    async def update(self) -> Any:
        async with self._idle:
            await self._idle.wait_for(lambda: not self._updating)
            self._updating = True  # holds new requests back while the in-flight ones drain
            await self._idle.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            async with self._idle:
                self._updating = False
                self._idle.notify_all()


async def _make_gate() -> _UpdateGate:
    return _UpdateGate()  # its Condition belongs to the engine's loop


async def _make_client(config: VLLMHttpEngine.Config) -> httpx.AsyncClient:
    import httpx

    headers = authorization_headers(config)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
        limits=httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
        ),
        headers=headers,
    )


def serve_command(
    config: VLLMLocalEngine.Config,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    python: str = "python",
) -> list[str]:
    """The `vllm serve` command line equivalent to a local engine config.

    Run it with `VLLM_SERVER_DEV_MODE=1` in the environment so that `update_weights` and
    the server-config check work, and with `TIR_RL_RUN_SECRET_FILE` naming the run's secret
    file: the server asks for that secret on every route (`tir_rl.engine.in_vllm.server_guard`) and
    does not start without it.
    """
    from tir_rl.models import resolve_model

    config.validate()
    cmd = [
        python, "-m", "tir_rl.engine.in_vllm.serve",
        "--model", str(resolve_model(config.model_path)),
        "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len),
        "--seed", str(config.seed or 0),
        "--logprobs-mode", config.logprobs_mode,
        "--max-num-seqs", str(config.max_num_seqs),
        "--gpu-memory-utilization", str(config.gpu_memory_utilization),
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip
    cmd.append("--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching")
    cmd.append("--async-scheduling" if config.async_scheduling else "--no-async-scheduling")
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if config.kv_cache_gib is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gib * (1 << 30)))]
    if config.block_size is not None:
        cmd += ["--block-size", str(config.block_size)]
    if config.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if served_model_name is not None:
        cmd += ["--served-model-name", served_model_name]
    cmd += config.weight_transfer.server_flag()
    cmd += ["--middleware", SERVER_GUARD]
    return cmd
