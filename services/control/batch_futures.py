"""Futures at RL scale: `retrieve_futures` (one long-poll for every sample of a sampling client) and
`join_sampling_session` (server-allocated clone ids for unpickled sampling clients).

`retrieve_futures` reports the requests of one (sampling session, clone) that finished after the client's
cursor, read from the request log in finishing order (services/db/sdk_surface.py explains why a finish-time
watermark never skips one); the cursor does not move when nothing new finished, as the SDK requires. With
nothing to report a poll is held, and each look at the database is one transaction that reads the target's
unfinished requests and then its completions. Between looks the poll waits on the notifier for any of those
unfinished requests to finish or for the session's `SubmissionBell` to ring (a sample queued through any
gateway process), counting only announcements made after its look began (`Notifier.mark`/`wait_any`): so a
held poll looks again only when the target's state may have changed, O(1) transactions per completion it
reports, however long the samples take. A request of the target is either unfinished at the look (waited
on), finished by then (reported), or queued after it (rung after it); the one exception is a target with
more than `WAKE_ON` unfinished requests, whose poll waits on the oldest `WAKE_ON` (batched sampling finishes
requests out of order) and looks again every `RECHECK_S` besides. The SDK still fetches each payload with
`retrieve_future`; `retrieved_request_ids` needs no action (results expire with their TTL).

Ack polls (`timeout: 0`; the SDK sends two after each completion it is told of, with the cursor it was just
given) are answered from `LookMemory` when they can be: the last look at a target, when it saw all of the
target's unfinished requests, promises that nothing finishes after its cursor unless one of those requests
or the session's bell is announced after its mark, which `Notifier.changed_since` tells without waiting.
Otherwise an ack poll is one transaction, which refreshes the memory. Held polls always look at the
database first: a finish that is never announced (a scheduler process that died between its commit and its
publish) is still reported by the next held poll, and by an ack poll once the memory is `MEMORY_S` old.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.auth.tenants import Tenant
from services.control.api import NotFound
from services.control.context import ControlContext, not_found
from services.control.ownership import OwnedIds
from services.control.surface_views import CompletionsPage, FutureCompletionView
from services.db.ids import RequestId as LoggedRequestId
from services.db.ids import SamplingSessionId, TenantId
from services.db.runs import get_sampling_session
from services.db.sdk_surface import Completion, join_sampling_session, unfinished_and_completions
from services.jobqueue.protocol import Notifier
from services.scheduler.requests import RequestId

MAX_COMPLETIONS = 1000
"""Completions per answer; the client asks again at once with the new cursor when there are more."""
WAKE_ON = 256
"""Unfinished requests a held poll waits on (the oldest: they tend to finish first). One wait parks under
all of them, so this bounds a look's read and the notifier's bookkeeping, not a number of tasks."""
RECHECK_S = 0.2
"""Longest a held poll waits between looks while its target has more than `WAKE_ON` unfinished requests:
one of those it does not wait on may finish first (batched sampling finishes them out of order)."""
MEMORY_TARGETS = 10_000
"""Targets whose last look `LookMemory` keeps; the least recently used goes first."""
MEMORY_WATCH = 32
"""Most unfinished requests a remembered look may stand on: with `MEMORY_TARGETS` it bounds the memory (at
most ~330,000 ids, some 30 MB, and far less in practice: after a completion a target mostly has none)."""
MEMORY_S = 5.0
"""How long a remembered look answers ack polls. The SDK sends them within milliseconds of the poll that
looked; the bound only limits how late a finish that was never announced is reported by an ack poll."""

Target = tuple[SamplingSessionId, int]
"""(sampling session, clone): what one SDK poller polls."""


@dataclass(frozen=True)
class Look:
    """One look at a target: the notifier's mark taken before it, and what it read. `pending` is None when
    it was not read (a look that read the completions first and found some)."""

    mark: int
    pending: list[LoggedRequestId] | None
    found: list[Completion]


@dataclass(frozen=True)
class Quiet:
    """A look's promise: no request of the target finishes after `cursor` unless one of `keys` (its
    unfinished requests at the look, and the session's bell) is published after `mark`. A request that
    finishes after the look either was unfinished at it, and so is among `keys` (the unfinished requests are
    read before the completions, and only those reported are left out), or was queued after it, and its
    submission rang the bell after committing, so after `mark`. Every finish is published after its commit."""

    cursor: int
    mark: int
    keys: tuple[RequestId, ...]
    learned_at: float


class LookMemory:
    """The last promise (`Quiet`) learned per target, bounded (LRU), thread-safe."""

    def __init__(self, capacity: int = MEMORY_TARGETS, clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity = capacity
        self._clock = clock
        self._entries: OrderedDict[Target, Quiet] = OrderedDict()
        self._lock = threading.Lock()

    def quiet(self, target: Target, cursor: int, notifier: Notifier) -> bool:
        """Whether nothing of `target` can have finished after `cursor` since a look at most `MEMORY_S` ago
        (then a look would find nothing either)."""
        with self._lock:
            entry = self._entries.get(target)
            if entry is None or entry.cursor != cursor or self._clock() - entry.learned_at >= MEMORY_S:
                return False
            self._entries.move_to_end(target)
        return not notifier.changed_since(entry.keys, entry.mark)

    def learn(self, target: Target, cursor: int, look: Look, bell: RequestId) -> None:
        """Remember what `look` (after `cursor`) promises, or forget `target` when it promises nothing."""
        with self._lock:
            entry = self._promise(target, cursor, look, bell)
            if entry is None:
                self._entries.pop(target, None)
                return
            self._entries[target] = entry
            self._entries.move_to_end(target)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _promise(self, target: Target, cursor: int, look: Look, bell: RequestId) -> Quiet | None:
        if len(look.found) >= MAX_COMPLETIONS:
            return None  # the answer was cut short: more finished after its last completion
        reported: set[str] = {c.request_id for c in look.found}  # finished at or before the new cursor
        new_cursor = look.found[-1].cursor if look.found else cursor
        if look.pending is not None:
            if len(look.pending) > min(WAKE_ON, MEMORY_WATCH):
                return None  # not all of them were read (or too many to keep)
            keys = (*(RequestId(r) for r in look.pending if r not in reported), bell)
            return Quiet(new_cursor, look.mark, keys, self._clock())
        # Completions only: the promise of an earlier look at this cursor still holds (it is about requests
        # finishing after its cursor, and these are all of them so far), less what this look reported.
        base = self._entries.get(target)
        if base is None or base.cursor != cursor:
            return None
        keys = tuple(k for k in base.keys if k not in reported)
        return Quiet(new_cursor, base.mark, keys, self._clock())


class BatchFutureOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx
        self._owned = OwnedIds()
        """Sampling sessions found to be their tenant's: the poller sends several polls per sample."""
        self._memory = LookMemory()

    async def retrieve_futures(self, tenant: Tenant, sampling_id: SamplingSessionId, clone: int,
                               prev_cursor: int, timeout_s: float | None) -> CompletionsPage:
        await self._require_sampler(tenant, sampling_id)
        hold = self._ctx.options.long_poll_max_s if timeout_s is None else min(timeout_s,
                                                                               self._ctx.options.long_poll_max_s)
        if hold > 0:
            found = await self._hold(sampling_id, clone, prev_cursor, time.monotonic() + hold)
        else:
            found = await self._ack(sampling_id, clone, prev_cursor)
        cursor = found[-1].cursor if found else prev_cursor
        return CompletionsPage([FutureCompletionView(c.request_id, c.failed) for c in found], cursor)

    async def _ack(self, sampling_id: SamplingSessionId, clone: int, cursor: int) -> list[Completion]:
        """An ack poll answers at once: nothing to wait on. Nothing new when the memory says so, else a look
        (completions first: the unfinished requests are read only for the memory, when nothing is found)."""
        if self._memory.quiet((sampling_id, clone), cursor, self._ctx.notifier):
            return []
        look = await self._look(sampling_id, clone, cursor, min(WAKE_ON, MEMORY_WATCH) + 1, completions_first=True)
        return look.found

    async def _hold(self, sampling_id: SamplingSessionId, clone: int, cursor: int,
                    deadline: float) -> list[Completion]:
        """Look until a request of the target finished after `cursor` or `deadline` passed; between looks,
        wait for an announcement that may change what a look finds (see the module docstring)."""
        bell = RequestId(self._ctx.sample_submissions.key(sampling_id))
        woken = False
        while True:
            # Woken, a look most likely finds the completion that woke it: it reads the completions first.
            look = await self._look(sampling_id, clone, cursor, WAKE_ON + 1, completions_first=woken)
            remaining = deadline - time.monotonic()
            if look.found or remaining <= 0:
                return look.found
            pending = look.pending or []  # read: nothing was found
            wait_s = min(remaining, RECHECK_S) if len(pending) > WAKE_ON else remaining
            woken = await self._ctx.notifier.wait_any([*map(RequestId, pending[:WAKE_ON]), bell], wait_s,
                                                      after=look.mark)

    async def _look(self, sampling_id: SamplingSessionId, clone: int, cursor: int, unfinished_limit: int, *,
                    completions_first: bool) -> Look:
        """One transaction: the target's unfinished requests (at most `unfinished_limit`) and its completions
        after `cursor`; what it promises goes to the memory."""
        mark = self._ctx.notifier.mark()  # before the look: whatever it misses is announced after the mark
        pending, found = await self._ctx.tx(lambda db: unfinished_and_completions(
            db, sampling_id, clone, cursor, unfinished_limit, MAX_COMPLETIONS, completions_first=completions_first))
        look = Look(mark, None if completions_first and found else pending, found)
        bell = RequestId(self._ctx.sample_submissions.key(sampling_id))
        self._memory.learn((sampling_id, clone), cursor, look, bell)
        return look

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
