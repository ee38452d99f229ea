"""Which adapter serves each sampling session, and loading checkpoints into shared frozen sampler adapters.

A sampling session samples from one of three things:
- a checkpoint (`model_path`): the checkpoint is loaded once into the frozen adapter
  `sampler:<tinker path>@<checkpoint version>`, shared by every session of that checkpoint (the version,
  row id and creation time, makes an overwritten checkpoint load afresh);
- an ephemeral snapshot of a training model (`save_weights_for_sampler` without a path): the adapter
  `sampler:<sampling session id>`, copied by the save itself;
- the bare base model: no adapter.

Loads go through the base model's scheduler loop like any request: the pseudo-model named after the
adapter gets seq 0 for its first load attempt, seq 1 after a failed one, and so on.

A binding to a checkpoint is not forever: the checkpoint may be deleted, unpublished or replaced (a new
row under the same path) after the session was created. `BindingCheck` re-reads readability for the
session's tenant before a sample (cached `ControlOptions.sampler_recheck_s` per session, 5 s), so
revocation takes effect within seconds for every tenant sampling it.

Where the bindings and load attempts live is pluggable: `SamplerDirectory` / `MemoryLoadLedger` keep them
in this process (the embedded deployment, where adapters do not outlive the process either); a cluster
with several gateway processes plugs in shared ones (`services.control.redis_state`), so any gateway can
serve any sampling session and two gateways never start competing loads of one checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Protocol

from services.auth.tenants import Tenant
from services.control.api import Invalid, Unavailable
from services.control.context import ControlContext
from services.control.registry import ServedModel
from services.db.ids import ModelId, RequestId, SamplingSessionId, new_request_id
from services.domain.training import AdapterId, WorkError
from services.jobqueue.protocol import ResultStatus
from services.runtime.commands import Load
from services.scheduler.requests import RequestKind

SAMPLER_PREFIX = "sampler:"
RECHECK_S = 5.0
"""How long a sampling session's checkpoint binding counts as re-checked (bounds revocation delay)."""


def ephemeral_adapter_id(sampling_id: SamplingSessionId) -> AdapterId:
    return AdapterId(f"{SAMPLER_PREFIX}{sampling_id}")


def checkpoint_adapter_id(tinker_path: str, version: str) -> AdapterId:
    return AdapterId(f"{SAMPLER_PREFIX}{tinker_path}@{version}")


def checkpoint_version(row_id: int, created_at: datetime) -> str:
    """What identifies one saved state of a checkpoint path: its row id *and* creation time (SQLite reuses
    the id of a deleted row, so a delete and a new save under the same name may get the same id)."""
    return f"{row_id}.{int(created_at.timestamp() * 1_000_000)}"


def bound_checkpoint_version(adapter_id: AdapterId | None) -> str | None:
    """The checkpoint version a sampler adapter was loaded from (None: ephemeral or base model)."""
    if adapter_id is None or not adapter_id.startswith(SAMPLER_PREFIX + "tinker://"):
        return None
    _, sep, version = adapter_id.rpartition("@")
    return version if sep else None


class BindingCheck:
    """Per-process memory of when each sampling session's checkpoint was last found still readable."""

    def __init__(self, recheck_s: float = RECHECK_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._recheck_s = recheck_s
        self._clock = clock
        self._checked: dict[SamplingSessionId, float] = {}

    def due(self, sampling_id: SamplingSessionId) -> bool:
        checked = self._checked.get(sampling_id)
        return checked is None or self._clock() - checked >= self._recheck_s

    def passed(self, sampling_id: SamplingSessionId) -> None:
        now = self._clock()
        if len(self._checked) > 100_000:  # bounded: drop entries that are due anyway
            self._checked = {k: t for k, t in self._checked.items() if now - t < self._recheck_s}
        self._checked[sampling_id] = now

    def forget(self, sampling_id: SamplingSessionId) -> None:
        self._checked.pop(sampling_id, None)


@dataclass(frozen=True)
class SamplerBinding:
    base_model: str
    adapter_id: AdapterId | None
    """None: the bare base model."""


class SamplerBindings(Protocol):
    """Sampling session id → binding. `bind` is called from transactions on worker threads."""

    def bind(self, sampling_id: SamplingSessionId, binding: SamplerBinding) -> None: ...

    def get(self, sampling_id: SamplingSessionId) -> SamplerBinding | None: ...


class SamplerDirectory:
    """`SamplerBindings` in this process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bindings: dict[SamplingSessionId, SamplerBinding] = {}

    def bind(self, sampling_id: SamplingSessionId, binding: SamplerBinding) -> None:
        with self._lock:
            self._bindings[sampling_id] = binding

    def get(self, sampling_id: SamplingSessionId) -> SamplerBinding | None:
        with self._lock:
            return self._bindings.get(sampling_id)


@dataclass(frozen=True)
class CheckpointToLoad:
    tinker_path: str
    version: str
    """`checkpoint_version` of the row."""
    local_path: Path


@dataclass(frozen=True)
class LoadAttempt:
    """One attempt at loading a checkpoint's sampler adapter (attempt n is seq n of its pseudo-model)."""

    request_id: RequestId
    attempt: int
    ok: bool = False
    started_at: float = field(default_factory=time.time)
    """Wall clock, so that every process of a cluster reads it alike."""


class LoadLedger(Protocol):
    """The latest load attempt per sampler adapter. Calls are quick (memory, or one Redis round trip)."""

    def current(self, adapter_id: AdapterId) -> LoadAttempt | None: ...

    def begin(self, adapter_id: AdapterId, attempt: LoadAttempt) -> LoadAttempt:
        """Record `attempt` unless one with its number (or a later one) is recorded; return the one that
        stands. Only the process whose attempt stands enqueues the load; the others wait for it."""
        ...

    def mark_ok(self, adapter_id: AdapterId, attempt: int) -> None: ...


class MemoryLoadLedger:
    """`LoadLedger` in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attempts: dict[AdapterId, LoadAttempt] = {}

    def current(self, adapter_id: AdapterId) -> LoadAttempt | None:
        with self._lock:
            return self._attempts.get(adapter_id)

    def begin(self, adapter_id: AdapterId, attempt: LoadAttempt) -> LoadAttempt:
        with self._lock:
            known = self._attempts.get(adapter_id)
            if known is not None and known.attempt >= attempt.attempt:
                return known
            self._attempts[adapter_id] = attempt
            return attempt

    def mark_ok(self, adapter_id: AdapterId, attempt: int) -> None:
        with self._lock:
            known = self._attempts.get(adapter_id)
            if known is not None and known.attempt == attempt:
                self._attempts[adapter_id] = replace(known, ok=True)


class CheckpointLoader:
    """Loads each checkpoint into its shared sampler adapter once; concurrent callers share the wait."""

    def __init__(self, ctx: ControlContext, ledger: LoadLedger | None = None) -> None:
        self._ctx = ctx
        self._ledger = ledger or MemoryLoadLedger()
        self._locks: dict[AdapterId, asyncio.Lock] = {}

    async def ensure(self, tenant: Tenant, served: ServedModel, checkpoint: CheckpointToLoad) -> AdapterId:
        """The checkpoint's adapter, loaded (waiting for the load if needed). Raises if it cannot load."""
        adapter_id = checkpoint_adapter_id(checkpoint.tinker_path, checkpoint.version)
        async with self._locks.setdefault(adapter_id, asyncio.Lock()):
            state = await asyncio.to_thread(self._ledger.current, adapter_id)
            status = "failed" if state is None else await self._status(adapter_id, state)
            if status == "ok":
                return adapter_id
            if status == "failed":
                state = await self._start(tenant, served, checkpoint, adapter_id, state)
            assert state is not None
            await self._wait(adapter_id, state, checkpoint.tinker_path)
        return adapter_id

    async def _status(self, adapter_id: AdapterId, state: LoadAttempt) -> str:
        """`ok`, `pending` (no result yet: wait for it) or `failed` (try again)."""
        if state.ok:
            return "ok"
        stored = await self._ctx.results.get(state.request_id)
        if stored is None:
            # A result nobody saw before it expired reads as missing for good: load again then.
            stale = time.time() - state.started_at > 2 * self._ctx.options.sampler_load_timeout_s
            return "failed" if stale else "pending"
        if stored.status is not ResultStatus.OK:
            return "failed"
        await asyncio.to_thread(self._ledger.mark_ok, adapter_id, state.attempt)
        return "ok"

    async def _start(self, tenant: Tenant, served: ServedModel, checkpoint: CheckpointToLoad,
                     adapter_id: AdapterId, previous: LoadAttempt | None) -> LoadAttempt:
        attempt = LoadAttempt(new_request_id(), 0 if previous is None else previous.attempt + 1)
        standing = await asyncio.to_thread(self._ledger.begin, adapter_id, attempt)
        if standing.request_id == attempt.request_id:
            command = Load(adapter_id, checkpoint.local_path, False, ModelId(adapter_id), checkpoint.tinker_path,
                           self._ctx.store.remote)
            self._ctx.enqueue(served, tenant, attempt.request_id, adapter_id, RequestKind.LOAD, attempt.attempt,
                              payload=command)
        return standing

    async def _wait(self, adapter_id: AdapterId, state: LoadAttempt, tinker_path: str) -> None:
        deadline = time.monotonic() + self._ctx.options.sampler_load_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            wait = min(left, self._ctx.options.long_poll_max_s)
            stored = await self._ctx.await_result(state.request_id, wait)
            if stored is None:
                continue
            if stored.status is ResultStatus.OK:
                await asyncio.to_thread(self._ledger.mark_ok, adapter_id, state.attempt)
                return
            error = stored.value
            if not isinstance(error, WorkError):
                error = WorkError(str(error), "server")
            if error.category == "user":
                raise Invalid(f"checkpoint {tinker_path} cannot be loaded for sampling: {error.message}",
                              field="model_path")
            raise Unavailable(f"loading checkpoint {tinker_path} failed: {error.message}")
        raise Unavailable(f"loading checkpoint {tinker_path} for sampling is taking long; try again")
