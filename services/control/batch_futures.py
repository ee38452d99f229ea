"""Futures at RL scale: `retrieve_futures` (one long-poll for every sample of a sampling client) and
`join_sampling_session` (server-allocated clone ids for unpickled sampling clients).

`retrieve_futures` reports the requests of one (sampling session, clone) that finished after the client's
cursor, read from the request log in finishing order (services/db/sdk_surface.py explains why a finish-time
watermark never skips one); the cursor does not move when nothing new finished, as the SDK requires. An ack
poll (`timeout: 0`) is one transaction. With nothing to report a poll is held, and each look at the database
is one transaction that reads the target's unfinished requests and then its completions. Between looks the
poll waits on the notifier for any of those unfinished requests to finish or for the session's
`SubmissionBell` to ring (a sample queued through any gateway process), counting only announcements made
after its look began (`Notifier.mark`/`wait_any`): so a held poll looks again only when the target's state
may have changed, O(1) transactions per completion it reports, however long the samples take. A request
of the target is either unfinished at the look (waited on), finished by then (reported), or queued after it
(rung after it); the one exception is a target with more than `WAKE_ON` unfinished requests, whose poll
waits on the oldest `WAKE_ON` (batched sampling finishes requests out of order) and looks again every
`RECHECK_S` besides. The SDK still fetches each payload with `retrieve_future`; `retrieved_request_ids`
needs no action (results expire with their TTL).
"""

from __future__ import annotations

import time

from services.auth.tenants import Tenant
from services.control.api import NotFound
from services.control.context import ControlContext, not_found
from services.control.ownership import OwnedIds
from services.control.surface_views import CompletionsPage, FutureCompletionView
from services.db.ids import SamplingSessionId, TenantId
from services.db.runs import get_sampling_session
from services.db.sdk_surface import Completion, completions_after, join_sampling_session, unfinished_and_completions
from services.scheduler.requests import RequestId

MAX_COMPLETIONS = 1000
"""Completions per answer; the client asks again at once with the new cursor when there are more."""
WAKE_ON = 256
"""Unfinished requests a held poll waits on (the oldest: they tend to finish first). One wait parks under
all of them, so this bounds a look's read and the notifier's bookkeeping, not a number of tasks."""
RECHECK_S = 0.2
"""Longest a held poll waits between looks while its target has more than `WAKE_ON` unfinished requests:
one of those it does not wait on may finish first (batched sampling finishes them out of order)."""


class BatchFutureOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx
        # The sampling ops ring the context's bell on every submission; held polls here wait on its key, so
        # it must ring through the notifier they wait on (which also reaches the other gateway processes).
        ctx.sample_submissions.connect(ctx.notifier)
        self._owned = OwnedIds()
        """Sampling sessions found to be their tenant's: the poller sends several polls per sample."""

    async def retrieve_futures(self, tenant: Tenant, sampling_id: SamplingSessionId, clone: int,
                               prev_cursor: int, timeout_s: float | None) -> CompletionsPage:
        await self._require_sampler(tenant, sampling_id)
        hold = self._ctx.options.long_poll_max_s if timeout_s is None else min(timeout_s,
                                                                               self._ctx.options.long_poll_max_s)
        if hold > 0:
            found = await self._hold(sampling_id, clone, prev_cursor, time.monotonic() + hold)
        else:  # an ack poll: answers at once, so there is nothing to wait on
            found = await self._ctx.tx(lambda db: completions_after(db, sampling_id, clone, prev_cursor,
                                                                    MAX_COMPLETIONS))
        cursor = found[-1].cursor if found else prev_cursor
        return CompletionsPage([FutureCompletionView(c.request_id, c.failed) for c in found], cursor)

    async def _hold(self, sampling_id: SamplingSessionId, clone: int, cursor: int,
                    deadline: float) -> list[Completion]:
        """Look until a request of the target finished after `cursor` or `deadline` passed; between looks,
        wait for an announcement that may change what a look finds (see the module docstring)."""
        notifier, bell = self._ctx.notifier, RequestId(self._ctx.sample_submissions.key(sampling_id))
        woken = False
        while True:
            mark = notifier.mark()  # before the look: whatever it misses is announced after the mark
            # Woken, a look most likely finds the completion that woke it: it reads the completions first.
            pending, found = await self._ctx.tx(lambda db, first=woken: unfinished_and_completions(
                db, sampling_id, clone, cursor, WAKE_ON + 1, MAX_COMPLETIONS, completions_first=first))
            remaining = deadline - time.monotonic()
            if found or remaining <= 0:
                return found
            wait_s = min(remaining, RECHECK_S) if len(pending) > WAKE_ON else remaining
            woken = await notifier.wait_any([*map(RequestId, pending[:WAKE_ON]), bell], wait_s, after=mark)

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
