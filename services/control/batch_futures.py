"""Futures at RL scale: `retrieve_futures` (one long-poll for every sample of a sampling client) and
`join_sampling_session` (server-allocated clone ids for unpickled sampling clients).

`retrieve_futures` reports the requests of one (sampling session, clone) that finished after the client's
cursor, read from the request log in finishing order (services/db/sdk_surface.py explains why a finish-time
watermark never skips one); the cursor does not move when nothing new finished, as the SDK requires. With
nothing to report it holds the poll, waking on the notifier of the oldest unfinished requests of the target
(or, with none in flight, on the session's `SubmissionBell`, rung by a sample submitted through this process)
and looking again, so one open request replaces the one-poll-per-future pattern of `retrieve_future`. The
SDK still fetches each payload with `retrieve_future`; `retrieved_request_ids` needs no action (results
expire with their TTL).
"""

from __future__ import annotations

import asyncio
import time

from services.auth.tenants import Tenant
from services.control.api import NotFound
from services.control.context import ControlContext, not_found
from services.control.ownership import OwnedIds
from services.control.surface_views import CompletionsPage, FutureCompletionView
from services.db.ids import RequestId, SamplingSessionId, TenantId
from services.db.runs import get_sampling_session
from services.db.sdk_surface import completions_after, join_sampling_session, unfinished_requests

MAX_COMPLETIONS = 1000
"""Completions per answer; the client asks again at once with the new cursor when there are more."""
WAKE_ON = 32
"""Unfinished requests whose completion wakes a held poll (the oldest: they tend to finish first)."""
RECHECK_S = 0.2
"""Longest a held poll sleeps between looks: a request of the target outside the `WAKE_ON` oldest finishes
without waking it (batched sampling finishes them out of order), and one indexed query costs far less than
leaving a finished sample unreported."""


class BatchFutureOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx
        self._owned = OwnedIds()
        """Sampling sessions found to be their tenant's: the poller sends several polls per sample."""

    async def retrieve_futures(self, tenant: Tenant, sampling_id: SamplingSessionId, clone: int,
                               prev_cursor: int, timeout_s: float | None) -> CompletionsPage:
        await self._require_sampler(tenant, sampling_id)
        hold = self._ctx.options.long_poll_max_s if timeout_s is None else min(timeout_s,
                                                                               self._ctx.options.long_poll_max_s)
        deadline = time.monotonic() + max(0.0, hold)
        while True:
            found = await self._ctx.tx(lambda db: completions_after(db, sampling_id, clone, prev_cursor,
                                                                    MAX_COMPLETIONS))
            remaining = deadline - time.monotonic()
            if found or remaining <= 0:
                break
            await self._wait_for_any(sampling_id, clone, min(remaining, RECHECK_S))
        cursor = found[-1].cursor if found else prev_cursor
        return CompletionsPage([FutureCompletionView(c.request_id, c.failed) for c in found], cursor)

    async def join_sampling_session(self, tenant: Tenant, sampling_id: SamplingSessionId) -> int:
        counter = await self._ctx.tx(lambda db: join_sampling_session(db, TenantId(tenant.id), sampling_id))
        if counter is None:
            raise NotFound(not_found("sampling session", sampling_id), field="sampling_session_id")
        return counter

    async def _require_sampler(self, tenant: Tenant, sampling_id: SamplingSessionId) -> None:
        if self._owned.known(tenant.id, sampling_id):
            return  # a session that expired since only reports nothing: it is the caller's own id
        row = await self._ctx.tx(lambda db: get_sampling_session(db, TenantId(tenant.id), sampling_id))
        if row is None:
            raise NotFound(not_found("sampling session", sampling_id), field="target.sampling_session_id")
        self._owned.remember(tenant.id, sampling_id)

    async def _wait_for_any(self, sampling_id: SamplingSessionId, clone: int, timeout_s: float) -> None:
        pending = await self._ctx.tx(lambda db: unfinished_requests(db, sampling_id, clone, WAKE_ON))
        if not pending:  # nothing in flight: wait for a submission (rung here; others seen on the recheck)
            await self._ctx.sample_submissions.wait(sampling_id, timeout_s)
            return
        waits = [asyncio.ensure_future(self._ctx.notifier.wait(RequestId(rid), timeout_s)) for rid in pending]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
