"""Futures: `retrieve` long-polls a request's stored result and maps it onto the API's outcome types.

Ownership is checked through the request log (another tenant's request id is "not found", like an unknown
one), or through `ControlContext.accepted` for a request this process accepted and has not answered yet (its
owner and kind cannot change; see `services.control.pending`). Then the long-poll pattern of
`services.jobqueue`: result store → if nothing, wait on the notifier → result store again. A request that
ended but whose result is gone (expired after its TTL, or lost with a restarted process) is answered from
its request-log row, so a client never polls forever.
A result answered to its owner (Done or Failed) is then kept only `ControlOptions.answered_result_s` (a retry
of a lost response), not the rest of its TTL (`ResultStore.answered`); a sample recorded for
`stable_reinforce` keeps it, as `services.control.stability` reads it later.
A pending answer carries a `queue_state`: `paused_capacity` while the request still waits to run on a
saturated base model (`quotas.QuotaGate.capacity_state`), else `active`; the SDK logs the change.
"""

from __future__ import annotations

import asyncio
from typing import cast, get_args

from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Done, Failed, FutureState, NotFound, Outcome, Pending, RequestKindName
from services.control.context import ControlContext, not_found
from services.control.quotas import QueueStateName, queued_seconds
from services.db.ids import ModelId, RequestId, SamplingSessionId, TenantId
from services.db.models import RequestRow
from services.db.request_log import UNFINISHED, get_request
from services.db.runs import get_sampling_session, get_training_run
from services.domain.training import WorkError
from services.jobqueue.protocol import ResultStatus, StoredResult

_KIND_NAMES = frozenset(get_args(RequestKindName))


class FutureOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    async def retrieve(self, tenant: Tenant, request_id: RequestId, timeout_s: float) -> FutureState:
        wait_s = min(max(0.0, timeout_s), self._ctx.options.long_poll_max_s)
        state, keeps_result = await self._retrieve(tenant, request_id, wait_s)
        if not isinstance(state, Pending):
            self._ctx.accepted.discard(request_id)  # answered: a later poll reads the request log
            if not keeps_result:  # the SDK fetches a result once: keep it only for a retry of a lost response
                self._ctx.results.answered(request_id, self._ctx.options.answered_result_s)
        return state

    async def _retrieve(self, tenant: Tenant, request_id: RequestId, wait_s: float) -> tuple[FutureState, bool]:
        """The future's state, and whether its stored result must outlive the answer (`keeps_result`)."""
        accepted = self._ctx.accepted.get(request_id)
        if accepted is not None and accepted.tenant_id == tenant.id:
            # Accepted here and not answered yet: owner and kind are known, the result is still to come.
            stored = await self._ctx.await_result(request_id, wait_s)
            if stored is not None:
                return outcome_of(accepted.kind, stored), accepted.keeps_result
            return await self._pending_or_final(tenant, request_id)
        row = await self._owned(tenant, request_id)
        stored = await self._ctx.results.get(request_id)
        if stored is None and row.status in UNFINISHED:  # its re-polls skip this read
            self._ctx.accepted.add(request_id, row.tenant_id, row.kind, keeps_result=bool(row.record_stability))
            stored = await self._ctx.await_result(request_id, wait_s)
        if stored is not None:
            return outcome_of(row.kind, stored), bool(row.record_stability)
        if row.status in UNFINISHED:
            return await self._pending_or_final(tenant, request_id)
        return self._from_row(row), bool(row.record_stability)

    async def cancel(self, tenant: Tenant, request_id: RequestId) -> None:
        """Best effort and currently a no-op: queued work runs anyway; only ownership is checked."""
        await self._owned(tenant, request_id)

    async def _owned(self, tenant: Tenant, request_id: RequestId) -> RequestRow:
        row = await self._ctx.tx(lambda db: get_request(db, TenantId(tenant.id), request_id))
        if row is None:
            raise NotFound(not_found("request", request_id), field="request_id")
        return row

    async def _pending_or_final(self, tenant: Tenant, request_id: RequestId) -> tuple[FutureState, bool]:
        """Still unfinished when the wait began: look at the row again (another process may have ended it)."""
        row = await self._owned(tenant, request_id)
        if row.status in UNFINISHED:
            return Pending(await self._queue_state(tenant, row)), True
        stored = await self._ctx.results.get(request_id)
        state = outcome_of(row.kind, stored) if stored is not None else self._from_row(row)
        return state, bool(row.record_stability)

    def _from_row(self, row: RequestRow) -> FutureState:
        """A finished request whose result is gone (expired, or lost with a restarted process)."""
        if row.status == "failed":
            category = "user" if row.category == "user" else "server"
            return Failed(row.error or "the request failed", category)
        keep_s = self._ctx.options.answered_result_s
        return Failed(f"the result of request {row.id} is no longer available (a result is kept for an hour "
                      f"until it is first retrieved, then for {keep_s:g} s)", "user")

    async def _queue_state(self, tenant: Tenant, row: RequestRow) -> QueueStateName:
        quotas = self._ctx.quotas
        queued_for = queued_seconds(row.status, row.created_at, self._ctx.clock())
        state = quotas.capacity_state(queued_for_s=queued_for, backlog=None)
        if queued_for is None or state != "active":
            return state  # running, or waiting long enough to say so without looking at the backlog
        return quotas.capacity_state(queued_for_s=queued_for, backlog=await self._backlog(tenant, row))

    async def _backlog(self, tenant: Tenant, row: RequestRow) -> int | None:
        """Requests queued for the request's base model: the loop's own count when it runs here."""
        base_model = await self._ctx.tx(lambda db: _base_model_of(db, TenantId(tenant.id), row))
        served = self._ctx.registry.get(base_model) if base_model else None
        if served is None:
            return None
        if served.stats is not None:
            return served.stats().queued
        return await asyncio.to_thread(self._ctx.queue.depth, served.queue)


def outcome_of(kind: str, stored: StoredResult) -> FutureState:
    """A stored result as the API's future state (`Done` with the request's kind, or `Failed`)."""
    value = stored.value
    if stored.status is ResultStatus.ERROR or isinstance(value, WorkError):
        if isinstance(value, WorkError):
            return Failed(value.message, value.category)
        if isinstance(value, dict) and "error" in value:
            category = "user" if value.get("category") == "user" else "server"
            return Failed(str(value["error"]), category)
        return Failed(str(value), "server")
    if kind not in _KIND_NAMES:
        return Failed(f"request of kind {kind!r} has no result to show", "server")
    return Done(cast(RequestKindName, kind), cast(Outcome, value))


def _base_model_of(db: Session, tenant_id: TenantId, row: RequestRow) -> str | None:
    if row.model_id is not None:
        run = get_training_run(db, tenant_id, ModelId(row.model_id))
        return run.base_model if run is not None else None
    if row.sampling_session_id is not None:
        sampler = get_sampling_session(db, tenant_id, SamplingSessionId(row.sampling_session_id))
        return sampler.base_model if sampler is not None else None
    return None

