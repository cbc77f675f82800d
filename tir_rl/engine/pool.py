"""A pool of engines behind the `Engine` contract: several `vllm serve` servers, one policy.

Routing. Requests that carry the same `GenerateRequest.affinity` (the rollout uses one key
per episode) go to the same member while it is up, so every turn's prompt, which extends
the previous one, is found in that server's prefix cache. A key seen for the first time
goes to the member with the fewest requests in flight (ties: the fewest keys placed, then
the first listed). Requests without a key go to the least-loaded member.

Failures. A member that raises `EngineUnavailableError` (connection refused, server or
engine process gone) is marked down; the request is sent again to another member (sampling
has no side effect, and the prompt carries the whole context, so the episode goes on), and
its key moves there. Every other `EngineError` belongs to the request and is raised as is.
When no member is left, the request raises `EngineUnavailableError`. `stats()` counts the
members up and the failovers, for the run's metrics.

Hangs. A member that is hung rather than gone (its process stopped, swapped out, wedged)
refuses nothing: its requests just wait, up to the client's whole timeout (10 minutes by
default), and so does the step. So a request or a weight load that has waited
`HangCheck.after_s` makes the pool ask its member whether it is alive
(`PoolMember.responsive`, `/health` for a server); a member that fails two such checks in a
row (no answer within `HangCheck.answer_within_s` each) is marked down like an unreachable
one, and the request goes to another member. A member that answers keeps the request,
however long it takes. A member marked down does not come back during the run.

Weights. With `transfer` `file`, `update_weights` publishes the state dict once
(`weights_io.publish_state_dict`, a folder every member reads) and has every member that is
up load it, concurrently. With a transfer by vLLM's engines (`nccl`, `gloo`;
`tir_rl.engine.weights.transfer`), one group spans the trainer and every member's workers and one
send reaches them all. A member that cannot be reached while loading is marked down (with a
transfer, the send is then made again to the members left, in a group formed anew); any
other load failure is raised, since the members would then hold different weights. After an
update returns, every member up holds `version`. `join` adds a member and first loads the
last published version into it, so a server that joins late samples with the pool's weights
(file transfer only). Updates and joins must not overlap (the run's weight sync makes one at
a time); requests may run during both, as each member's own update semantics allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from tir_rl.engine.base import (
    Engine,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    R,
    ServersHealth,
)
from tir_rl.engine.weights.files import PublishedWeights, publish_state_dict
from tir_rl.engine.weights.transfer import (
    TransferError,
    TransferGroup,
    TransferReceiver,
    WeightTransfer,
    send_by_transfer,
    transfer_group_for,
)
from tir_rl.errors import ConfigError, EngineError, EngineUnavailableError, ParityError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_AFFINITY_KEYS = 65_536
"""Keys remembered at most (least recently used forgotten first): far more episodes than
are ever in flight, so a forgotten key belongs to an episode that has ended."""


class Routing(enum.StrEnum):
    """How the pool picks a server for a request."""

    STICKY = "sticky"
    """A key stays on its server; a new key goes to the least-loaded one (the default)."""
    LEAST_LOADED = "least_loaded"
    """Every request to the least-loaded server, keys ignored (a control for measurements)."""
    RANDOM = "random"
    """Every request to a server drawn at random, keys ignored (a control for measurements)."""


@runtime_checkable
class PoolMember(Engine, Protocol):
    """An engine that loads weights another process published (both vLLM engines do)."""

    async def load_published(self, weights: PublishedWeights) -> None:
        """Load a complete published version; raises `EngineError`."""
        ...

    async def responsive(self, timeout_s: float) -> bool:
        """Whether the engine answers a liveness check within `timeout_s` (a hung one does not)."""
        ...


@dataclass(frozen=True)
class HangCheck:
    """When the pool asks a member whether it is hung (module docstring, "Hangs")."""

    after_s: float = 30.0
    """A request or load that has waited this long asks its member; 0: never ask."""
    answer_within_s: float = 10.0
    """A member that does not answer the check within this is hung and leaves the pool."""

    def validate(self) -> None:
        """Raise `ConfigError` for a negative wait or a check with no time to answer."""
        if self.after_s < 0 or self.answer_within_s <= 0:
            raise ConfigError(
                "engine.http.hang_check_s must be >= 0 (0: off) and "
                f"engine.http.health_timeout_s > 0; got {self.after_s}, {self.answer_within_s}"
            )


@dataclass(frozen=True)
class PoolStats:
    """The pool's health, as the run's metrics report it."""

    members: int
    """Members ever added (the configured servers plus those that joined)."""
    members_up: int
    """Members not marked down."""
    failovers: int
    """Requests sent again to another member after theirs became unreachable."""
    requests: tuple[int, ...]
    """Requests each member has answered, in member order."""


@dataclass
class _Member:
    name: str
    engine: PoolMember
    up: bool = True
    in_flight: int = 0
    keys: int = 0
    answered: int = 0


class EnginePool:
    """Several engines that serve one model; see the module docstring."""

    def __init__(
        self,
        members: Sequence[tuple[str, PoolMember]],
        *,
        weights_dir: Path | str | None,
        routing: Routing = Routing.STICKY,
        seed: int = 0,
        transfer: WeightTransfer = WeightTransfer.FILE,
        transfer_address: str = "127.0.0.1",
        hang_check: HangCheck = HangCheck(),
    ) -> None:
        """Pool `members` (name, engine), which must serve the same model the same way.

        Args:
            members: at least one (name, engine); the name appears in messages and logs.
            weights_dir: the folder updates are published to with `transfer` `file`; every
                member must read it at the same path.
            routing: how a request picks its member (`Routing`).
            seed: seeds `Routing.RANDOM`'s draws.
            transfer: how the weights reach the members (`tir_rl.engine.weights.transfer`).
            transfer_address: this machine's address as the members reach it (`nccl`, `gloo`).
            hang_check: when a waiting request asks its member whether it is hung.

        Raises:
            ConfigError: no member, members that disagree on the model or the dtype, or no
                `weights_dir` for the file transfer.
        """
        if not members:
            raise ConfigError("an engine pool needs at least one engine")
        hang_check.validate()
        self._hang_check = hang_check
        transfer = WeightTransfer(transfer)
        if weights_dir is None and not transfer.by_vllm_engine:
            raise ConfigError(
                "an engine pool with weight_transfer=file needs a weights_dir every member reads"
            )
        self._members: list[_Member] = []
        self._keys: OrderedDict[str, _Member] = OrderedDict()
        self._weights_dir = None if weights_dir is None else Path(weights_dir)
        self._transfer = transfer_group_for(transfer, transfer_address)
        self._published: PublishedWeights | None = None
        self._version = 0
        self._failovers = 0
        self._lock = threading.Lock()  # requests and weight syncs come from different threads
        self._routing = routing
        self._rng = random.Random(seed)
        for name, engine in members:
            self._add(name, engine)

    def _check(self, name: str, engine: PoolMember) -> None:
        if not isinstance(engine, PoolMember):
            raise ConfigError(
                f"{name}: {type(engine).__name__} is not a PoolMember (it cannot load published "
                "weights, or answer a liveness check), so it cannot join an engine pool"
            )
        if any(m.name == name for m in self._members):
            raise ConfigError(f"an engine named {name!r} is already in the pool")
        if self._members:
            _check_same_model(self._members[0], name, engine.model_info)

    def _add(self, name: str, engine: PoolMember) -> _Member:
        self._check(name, engine)
        member = _Member(name, engine)
        self._members.append(member)
        return member

    # -- Engine -------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        """The first member's (every member serves the same model; checked on adding)."""
        return self._members[0].engine.model_info

    @property
    def policy_version(self) -> int:
        """The version every member that is up holds."""
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample on the key's member; on an unreachable member, on another one.

        Raises:
            EngineUnavailableError: no member is up.
            EngineError: the member failed this request for another reason.
        """
        while True:
            with self._lock:
                member = self._route(request.affinity)
                member.in_flight += 1
            try:
                result = await self._unless_hung(member, member.engine.generate(request))
            except EngineUnavailableError as exc:
                with self._lock:
                    self._mark_down(member, exc)
                    self._failovers += 1
                continue
            finally:
                with self._lock:
                    member.in_flight -= 1
            with self._lock:
                member.answered += 1
            return result

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Prompt logprobs from the least-loaded member (all hold the same weights)."""
        while True:
            with self._lock:
                member = self._route(None)
            try:
                return await self._unless_hung(member, member.engine.prompt_logprobs(token_ids))
            except EngineUnavailableError as exc:
                with self._lock:
                    self._mark_down(member, exc)

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> None:
        """Publish `state_dict` once and load it into every member that is up.

        Raises:
            EngineUnavailableError: no member was left to load it.
            EngineError: a member that is up failed to load it.
        """
        if self._transfer is not None:
            await self._send_everywhere(self._transfer, state_dict, version)
            if version is not None:
                self._version = version
            return
        assert self._weights_dir is not None  # checked in __init__
        published = await asyncio.to_thread(
            publish_state_dict, state_dict, self._weights_dir, version=version
        )
        await self._load_everywhere(published)
        self._published = published
        if version is not None:
            self._version = version

    async def _load_everywhere(self, published: PublishedWeights) -> None:
        live = self.members_up()
        outcomes = await asyncio.gather(
            *(self._unless_hung(m, m.engine.load_published(published)) for m in live),
            return_exceptions=True,
        )
        failed: list[tuple[_Member, BaseException]] = []
        for member, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, EngineUnavailableError):
                with self._lock:
                    self._mark_down(member, outcome)
            elif isinstance(outcome, BaseException):
                failed.append((member, outcome))
        if failed:
            member, exc = failed[0]
            raise EngineError(f"{member.name} failed to load {published.folder}: {exc}") from exc
        if not self.members_up():
            raise self._none_left()

    async def _send_everywhere(
        self, group: TransferGroup, state_dict: Mapping[str, torch.Tensor], version: int | None
    ) -> None:
        """One transfer to every member up; once more to those left if some became unreachable."""
        for attempt in range(2):
            live = self.members_up()
            if not live:
                raise self._none_left()
            receivers = [_receiver(m) for m in live]
            by_client = {r.transfer_client().name: m for r, m in zip(receivers, live, strict=True)}
            failures = await send_by_transfer(group, receivers, state_dict, version)
            if not failures:
                return
            lost = [
                (by_client[n], exc)
                for n, exc in failures.items()
                if _unreachable(by_client[n], exc)
            ]
            with self._lock:
                for member, exc in lost:
                    self._mark_down(member, exc)
            if not lost or attempt == 1:
                name, exc = next(iter(failures.items()))
                raise EngineError(f"{name} failed to receive the weights: {exc}") from exc
            logger.warning(
                "weight transfer: %d member(s) unreachable; sending again to the %d left",
                len(lost), len(self.members_up()),
            )  # fmt: skip

    async def _unless_hung(self, member: _Member, call: Coroutine[Any, Any, T]) -> T:
        """Await `member`'s `call`; raise `EngineUnavailableError` if the member is hung.

        Every `HangCheck.after_s` the call has not returned, the member is asked whether it
        is alive; if it does not answer in time, the call is cancelled.
        """
        task = asyncio.ensure_future(call)
        check = self._hang_check
        if not check.after_s:
            return await task
        waited = 0.0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=check.after_s)
                if done:
                    return task.result()
                waited += check.after_s
                if not await self._answers(member) and not await self._answers(member):
                    raise EngineUnavailableError(
                        f"{member.name} is hung: a call had waited {waited:.0f} s and two "
                        f"liveness checks in a row got no answer within "
                        f"{check.answer_within_s:.0f} s"
                    )
        finally:
            if not task.done():
                task.cancel()

    async def _answers(self, member: _Member) -> bool:
        return await member.engine.responsive(self._hang_check.answer_within_s)

    def close(self) -> None:
        """Close every member (idempotent)."""
        if self._transfer is not None:
            with contextlib.suppress(Exception):
                self._transfer.close()
        for member in self._members:
            member.engine.close()

    # -- the pool -----------------------------------------------------------------------------

    async def join(self, name: str, engine: PoolMember) -> None:
        """Add a member; it first loads the pool's last published weights, if any.

        Raises:
            ConfigError: the engine serves another model, or cannot load published weights.
            EngineError: it failed to load the pool's weights (it is not added).
        """
        self._check(name, engine)
        if self._transfer is not None:
            raise ConfigError(
                f"{name} cannot join: a pool whose weights travel by "
                f"{self._transfer.transfer.value} cannot bring a new member up to date yet "
                "(weight_transfer=file can)"
            )
        if self._published is not None:
            await engine.load_published(self._published)
        with self._lock:
            self._add(name, engine)
        logger.info("%s joined the engine pool (%d up)", name, len(self.members_up()))

    def members_up(self) -> list[_Member]:
        """The members not marked down, in the order they were added."""
        return [m for m in self._members if m.up]

    def engines_up(self) -> list[tuple[str, Engine]]:
        """(name, engine) of each member that is up (the parity probe checks each)."""
        return [(m.name, m.engine) for m in self.members_up()]

    async def check_each_copy(
        self, check: Callable[[Engine], Awaitable[R]], *, version: int
    ) -> list[R]:
        """`check` on every server up, each holding its own copy of the weights of `version`.

        Raises:
            EngineError: a server's weights are not `version` (the servers disagree).
            EngineUnavailableError: every server went away during the checks (one that
                cannot be reached leaves the pool; the others are still checked).
            ParityError: a server's check found a gap (the message names the server).
        """
        results = []
        for name, member in self.engines_up():
            if member.policy_version != version:  # all sample with one version, or none runs
                raise EngineError(
                    f"{name} labels its tokens with policy version {member.policy_version} "
                    f"after the sync to version {version}: the pool's servers disagree"
                )
            try:
                results.append(await check(member))
            except EngineUnavailableError as exc:
                self.mark_down(name, f"its check after the weight sync failed: {exc}")
            except ParityError as exc:
                raise ParityError(f"{name}: {exc}") from exc
        if not results:
            raise EngineUnavailableError(
                "every engine of the pool went away during the checks after the weight sync"
            )
        return results

    def servers_health(self) -> ServersHealth:
        """Servers up and failovers so far."""
        stats = self.stats()
        return ServersHealth(servers_up=stats.members_up, failovers=stats.failovers)

    def stats(self) -> PoolStats:
        """Members up, failovers and requests per member so far."""
        with self._lock:
            return self._stats()

    def _stats(self) -> PoolStats:
        return PoolStats(
            members=len(self._members),
            members_up=len(self.members_up()),
            failovers=self._failovers,
            requests=tuple(m.answered for m in self._members),
        )

    def mark_down(self, name: str, reason: str) -> None:
        """Stop routing to member `name` (e.g. its parity probe could not reach it)."""
        with self._lock:
            for member in self._members:
                if member.name == name and member.up:
                    self._mark_down(member, EngineUnavailableError(reason))

    def _route(self, key: str | None) -> _Member:
        if self._routing is not Routing.STICKY:
            key = None
        if key is not None:
            member = self._keys.get(key)
            if member is not None and member.up:
                self._keys.move_to_end(key)
                return member
        live = self.members_up()
        if not live:
            raise self._none_left()
        if self._routing is Routing.RANDOM:
            return self._rng.choice(live)
        member = min(live, key=lambda m: (m.in_flight, m.keys))
        if key is not None:
            old = self._keys.pop(key, None)
            if old is not None:
                old.keys -= 1
            self._keys[key] = member
            member.keys += 1
            while len(self._keys) > MAX_AFFINITY_KEYS:
                _, forgotten = self._keys.popitem(last=False)
                forgotten.keys -= 1
        return member

    def _mark_down(self, member: _Member, exc: BaseException) -> None:
        if not member.up:
            return
        member.up = False
        left = len(self.members_up())
        logger.warning(
            "engine pool: %s is unreachable and leaves the pool (%d of %d left): %s",
            member.name,
            left,
            len(self._members),
            exc,
        )

    def _none_left(self) -> EngineUnavailableError:
        names = ", ".join(m.name for m in self._members)
        return EngineUnavailableError(
            f"every engine of the pool is down ({names}); see the warnings above for why each "
            "left, restart the servers and resume the run"
        )

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _receiver(member: _Member) -> TransferReceiver:
    if not isinstance(member.engine, TransferReceiver):
        raise ConfigError(
            f"{member.name}: {type(member.engine).__name__} cannot receive a weight transfer"
        )
    return member.engine


def _unreachable(member: _Member, failure: BaseException) -> bool:
    """Whether `member` is gone: its failure says so, or it no longer answers."""
    cause = failure.cause if isinstance(failure, TransferError) else failure
    if isinstance(cause, EngineUnavailableError):
        return True
    try:
        _receiver(member).transfer_client().world_size()
    except EngineUnavailableError:
        return True
    except Exception:
        return False
    return False


def _check_same_model(first: _Member, name: str, info: ModelInfo) -> None:
    ref = first.engine.model_info
    for field_name in ("model_path", "dtype", "logprobs_mode", "max_model_len"):
        a, b = getattr(ref, field_name), getattr(info, field_name)
        if a != b:
            raise ConfigError(
                f"the engines of a pool must serve the same model the same way: {first.name} "
                f"has {field_name}={a!r}, {name} has {b!r}. Start every server with the same "
                "flags (tir_rl.engine.vllm_http.serve_command prints them)."
            )
