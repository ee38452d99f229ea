"""The seams between gateway and scheduler, decoupled from Redis: `WorkQueue`, `ResultStore`, `Notifier`.

    gateway ──enqueue──▶ WorkQueue (per base model) ──claim──▶ scheduler loop ──ack (after results stored)
    scheduler loop ──put──▶ ResultStore ◀──get── gateway long-poll
    scheduler loop ──publish──▶ Notifier ──wakes──▶ the one gateway waiter of that request id

Embedded mode wires the in-process implementations (`memory.py`); production wires Redis streams,
keys with TTL, and pub/sub. Producers of work and results run in a worker thread (sync calls); the
gateway runs in asyncio, so the calls it makes while holding a long-poll (`ResultStore.get`,
`Notifier.wait`) are coroutines. One gateway process keeps ONE notifier for all its long-polls.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from services.scheduler.requests import Completion, QueuedRequest, RequestId

DEFAULT_RESULT_TTL_S = 3600.0
"""How long a result nobody has retrieved yet stays retrievable (its owner may be slow to poll); once
answered it is kept only for `DEFAULT_ANSWERED_KEEP_S` (`ResultStore.answered`)."""
DEFAULT_ANSWERED_KEEP_S = 120.0
"""How long a result stays after it was answered to its owner: the SDK re-polls the same id after a network
error lost the response, within seconds."""


@dataclass(frozen=True)
class Delivery:
    """One claimed queue entry. Ack its `delivery_id` once the request's result is stored."""

    delivery_id: str
    request: QueuedRequest


class ResultStatus(StrEnum):
    OK = "ok"
    ERROR = "error"
    """`value` describes a failure (e.g. a `WorkError` or `{"error", "category"}`)."""


@dataclass(frozen=True)
class StoredResult:
    """A terminal result: opaque to the queue layer (domain object in-process, bytes over Redis)."""

    status: ResultStatus
    value: object

    @classmethod
    def from_completion(cls, completion: Completion) -> StoredResult:
        """The scheduler's outcome as stored: a `WorkError` result is an ERROR, anything else OK."""
        status = ResultStatus.ERROR if completion.is_error else ResultStatus.OK
        return cls(status=status, value=completion.result)


@runtime_checkable
class WorkQueue(Protocol):
    """At-least-once queue of requests, one stream per base model.

    A claimed entry stays pending until acked; `recover` makes pending entries claimable again (after
    the consumer that claimed them died), so duplicates reach the scheduler, whose sequencer dedupes them.
    """

    def enqueue(self, base_model: str, request: QueuedRequest) -> str:
        """Append a request; returns its delivery id. Thread-safe, non-blocking."""
        ...

    def claim(self, base_model: str, max_items: int, timeout_s: float = 0.0) -> list[Delivery]:
        """Take up to `max_items` entries in enqueue order, waiting up to `timeout_s` for the first one."""
        ...

    def ack(self, base_model: str, delivery_ids: Iterable[str]) -> int:
        """Forget claimed entries for good; returns how many were pending."""
        ...

    def recover(self, base_model: str) -> int:
        """Re-queue every claimed-but-unacked entry (at the front, in enqueue order); returns how many."""
        ...

    def depth(self, base_model: str) -> int:
        """Entries waiting to be claimed (for metrics and back-pressure)."""
        ...


@runtime_checkable
class ResultStore(Protocol):
    """Terminal results by request id, kept for `ttl_s` after they are written, or less once `answered`."""

    def put(self, request_id: RequestId, result: StoredResult, ttl_s: float = DEFAULT_RESULT_TTL_S) -> None:
        """Store (or replace) a result. Thread-safe; called from the scheduler's worker thread."""
        ...

    async def get(self, request_id: RequestId) -> StoredResult | None:
        """The result, or None while pending (or after it expired)."""
        ...

    def get_nowait(self, request_id: RequestId) -> StoredResult | None:
        """`get` for a thread that may block (the scheduler's): the result, or None."""
        ...

    def delete(self, request_id: RequestId) -> None:
        """Drop a result early (e.g. once the client acknowledged it)."""
        ...

    def answered(self, request_id: RequestId, keep_s: float) -> None:
        """The result was answered to its owner: keep it at most `keep_s` more (for a retry of a lost
        response; 0 drops it), never longer than it would have stayed anyway; a missing id is ignored.

        Why: the SDK retrieves each result once, so a full TTL held every result for an hour after it was
        delivered: memory grew with throughput x 1 h (some 790k results at 220 results/s). Shortened on
        answer, it is bounded by throughput x `keep_s` (plus the results not retrieved yet). Non-blocking
        and callable from an event loop: an implementation over the network defers and batches the I/O.
        A `put` after it (a retried store) writes the result afresh, with its full TTL."""
        ...


@runtime_checkable
class Notifier(Protocol):
    """Wakes long-polls when a request's result is stored. Publish AFTER `ResultStore.put`.

    To close the race between a poll's "not stored yet" and its `wait`, a notifier remembers recent
    publishes for a retention window: a `wait` that starts just after the publish returns True at once.
    Long-poll: `get` → if None, `wait(timeout)` → `get` again (True only means "look again").
    Several ids at once (`retrieve_futures`): `mark` → look → `wait_any(ids, timeout, after=mark)` → repeat.
    Whether a look is still current, without waiting: `changed_since(ids, mark)` (False: nothing it stands
    on was announced since, so looking again would find the same).
    Ids need not be request ids: any string a publisher and its waiters agree on works as well.
    """

    def publish(self, request_id: RequestId) -> None:
        """Announce that `request_id` has a result. Thread-safe, non-blocking, callable from any thread."""
        ...

    def publish_many(self, request_ids: Sequence[RequestId]) -> None:
        """`publish` for every id, at once (a packed pass ends many requests: one wake-up per waiting event
        loop, or one round trip, instead of one per request)."""
        ...

    async def wait(self, request_id: RequestId, timeout_s: float) -> bool:
        """True once `request_id` is (or recently was) published; False after `timeout_s` without it."""
        ...

    def mark(self) -> int:
        """Where this process's notifier stands in the publishes it has seen: take it BEFORE looking at the
        state the ids stand for, then `wait_any(..., after=mark)`."""
        ...

    async def wait_any(self, request_ids: Collection[RequestId], timeout_s: float, *, after: int) -> bool:
        """True once any of `request_ids` is published after `mark()` returned `after` (at once if one already
        was, or if this notifier may have missed publishes since); False after `timeout_s` without one.
        Unlike `wait`, a publish the caller has already seen (before its mark) does not count: a poll that
        waits again for ids it looked at is not woken at once by the publish it has just handled."""
        ...

    def changed_since(self, request_ids: Collection[RequestId], mark: int) -> bool:
        """Whether any of `request_ids` was published after `mark()` returned `mark`, or this notifier may
        have missed publishes since (a lost or re-established subscription): True means "look again".
        Non-blocking. True whenever `wait_any(request_ids, ..., after=mark)` would return True at once, so
        a caller that trusts a False answer and then waits is never woken at once by the same state."""
        ...
