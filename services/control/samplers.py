"""Which adapter serves each sampling session, and loading checkpoints into shared frozen sampler adapters.

A sampling session samples from one of three things:
- a checkpoint (`model_path`): the checkpoint is loaded once into the frozen adapter
  `sampler:<tinker path>@<checkpoint row id>`, shared by every session of that checkpoint (the row id
  makes an overwritten checkpoint load afresh);
- an ephemeral snapshot of a training model (`save_weights_for_sampler` without a path): the adapter
  `sampler:<sampling session id>`, copied by the save itself;
- the bare base model: no adapter.

Loads go through the base model's scheduler loop like any request: the pseudo-model named after the
adapter gets seq 0 for its first load attempt, seq 1 after a failed one, and so on. The bindings live in
this process (adapters do not outlive it either, in the embedded deployment).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def ephemeral_adapter_id(sampling_id: SamplingSessionId) -> AdapterId:
    return AdapterId(f"{SAMPLER_PREFIX}{sampling_id}")


def checkpoint_adapter_id(tinker_path: str, checkpoint_row_id: int) -> AdapterId:
    return AdapterId(f"{SAMPLER_PREFIX}{tinker_path}@{checkpoint_row_id}")


@dataclass(frozen=True)
class SamplerBinding:
    base_model: str
    adapter_id: AdapterId | None
    """None: the bare base model."""


class SamplerDirectory:
    """Sampling session id → binding; thread-safe (written from transactions on worker threads)."""

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
    row_id: int
    local_path: Path


@dataclass
class _LoadState:
    request_id: RequestId
    attempt: int
    ok: bool = False
    started_at: float = field(default_factory=time.monotonic)


class CheckpointLoader:
    """Loads each checkpoint into its shared sampler adapter once; concurrent callers share the wait."""

    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx
        self._states: dict[AdapterId, _LoadState] = {}
        self._locks: dict[AdapterId, asyncio.Lock] = {}

    async def ensure(self, tenant: Tenant, served: ServedModel, checkpoint: CheckpointToLoad) -> AdapterId:
        """The checkpoint's adapter, loaded (waiting for the load if needed). Raises if it cannot load."""
        adapter_id = checkpoint_adapter_id(checkpoint.tinker_path, checkpoint.row_id)
        async with self._locks.setdefault(adapter_id, asyncio.Lock()):
            state = self._states.get(adapter_id)
            status = "failed" if state is None else await self._status(state)
            if status == "ok":
                return adapter_id
            if status == "failed":
                state = self._start(tenant, served, checkpoint, adapter_id, state)
            assert state is not None
            await self._wait(state, checkpoint.tinker_path)
        return adapter_id

    async def _status(self, state: _LoadState) -> str:
        """`ok`, `pending` (no result yet: wait for it) or `failed` (try again)."""
        if state.ok:
            return "ok"
        stored = await self._ctx.results.get(state.request_id)
        if stored is None:
            # A result nobody saw before it expired reads as missing for good: load again then.
            stale = time.monotonic() - state.started_at > 2 * self._ctx.options.sampler_load_timeout_s
            return "failed" if stale else "pending"
        state.ok = stored.status is ResultStatus.OK
        return "ok" if state.ok else "failed"

    def _start(self, tenant: Tenant, served: ServedModel, checkpoint: CheckpointToLoad, adapter_id: AdapterId,
               previous: _LoadState | None) -> _LoadState:
        attempt = 0 if previous is None else previous.attempt + 1
        state = _LoadState(new_request_id(), attempt)
        self._states[adapter_id] = state
        command = Load(adapter_id, checkpoint.local_path, False, ModelId(adapter_id), checkpoint.tinker_path)
        self._ctx.enqueue(served, tenant, state.request_id, adapter_id, RequestKind.LOAD, attempt,
                          payload=command)
        return state

    async def _wait(self, state: _LoadState, tinker_path: str) -> None:
        deadline = time.monotonic() + self._ctx.options.sampler_load_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            wait = min(left, self._ctx.options.long_poll_max_s)
            stored = await self._ctx.await_result(state.request_id, wait)
            if stored is None:
                continue
            if stored.status is ResultStatus.OK:
                state.ok = True
                return
            error = stored.value
            if not isinstance(error, WorkError):
                error = WorkError(str(error), "server")
            if error.category == "user":
                raise Invalid(f"checkpoint {tinker_path} cannot be loaded for sampling: {error.message}",
                              field="model_path")
            raise Unavailable(f"loading checkpoint {tinker_path} failed: {error.message}")
        raise Unavailable(f"loading checkpoint {tinker_path} for sampling is taking long; try again")
