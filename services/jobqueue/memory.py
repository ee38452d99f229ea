"""In-process `WorkQueue`, `ResultStore` and `Notifier` for the embedded deployment and for tests.

Thread-safe by design: in embedded mode the scheduler loop runs in a worker thread while the gateway runs
in an asyncio event loop. Locks guard every structure; waiters are asyncio futures resolved on their own
loop through `loop.call_soon_threadsafe`, so a publish from the worker thread never touches a loop it
does not own. Nothing here survives the process (that is the Redis implementation's job).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence

from services.jobqueue.protocol import DEFAULT_RESULT_TTL_S, Delivery, StoredResult
from services.scheduler.requests import QueuedRequest, RequestId

Clock = Callable[[], float]


class InMemoryWorkQueue:
    """`WorkQueue` over per-base-model deques; a condition variable lets `claim` block with a timeout."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queued: dict[str, deque[Delivery]] = {}
        self._pending: dict[str, dict[str, Delivery]] = {}
        self._ids = itertools.count(1)

    def enqueue(self, base_model: str, request: QueuedRequest) -> str:
        with self._cond:
            delivery = Delivery(delivery_id=str(next(self._ids)), request=request)
            self._queued.setdefault(base_model, deque()).append(delivery)
            self._cond.notify_all()
        return delivery.delivery_id

    def claim(self, base_model: str, max_items: int, timeout_s: float = 0.0) -> list[Delivery]:
        with self._cond:
            if timeout_s > 0:
                self._cond.wait_for(lambda: bool(self._queued.get(base_model)), timeout_s)
            queue = self._queued.get(base_model)
            claimed: list[Delivery] = []
            while queue and len(claimed) < max_items:
                claimed.append(queue.popleft())
            pending = self._pending.setdefault(base_model, {})
            pending.update((d.delivery_id, d) for d in claimed)
            return claimed

    def ack(self, base_model: str, delivery_ids: Iterable[str]) -> int:
        with self._cond:
            pending = self._pending.get(base_model, {})
            return sum(pending.pop(delivery_id, None) is not None for delivery_id in delivery_ids)

    def recover(self, base_model: str) -> int:
        with self._cond:
            pending = self._pending.pop(base_model, {})
            # Ids grow with enqueue order, so sorting numerically restores the original order.
            redeliver = sorted(pending.values(), key=lambda d: int(d.delivery_id))
            self._queued.setdefault(base_model, deque()).extendleft(reversed(redeliver))
            if redeliver:
                self._cond.notify_all()
            return len(redeliver)

    def depth(self, base_model: str) -> int:
        with self._cond:
            return len(self._queued.get(base_model, ()))

    def unacked(self, base_model: str) -> int:
        """Claimed entries still pending an ack."""
        with self._cond:
            return len(self._pending.get(base_model, {}))


class InMemoryResultStore:
    """`ResultStore` in a dict with per-entry expiry; expired entries are purged lazily on write.

    A heap orders the expiries. Replacing, deleting or answering a result leaves its earlier heap entry
    behind (skipped when popped: its time no longer matches); the heap is rebuilt from the live results
    once such leftovers outnumber them, or an hour of answered results would leave an hour of entries."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._results: dict[RequestId, tuple[float, StoredResult]] = {}
        self._expiries: list[tuple[float, RequestId]] = []

    def put(self, request_id: RequestId, result: StoredResult, ttl_s: float = DEFAULT_RESULT_TTL_S) -> None:
        with self._lock:
            now = self._clock()
            self._purge(now)
            expires_at = now + ttl_s
            self._results[request_id] = (expires_at, result)
            heapq.heappush(self._expiries, (expires_at, request_id))

    def get_nowait(self, request_id: RequestId) -> StoredResult | None:
        """Synchronous `get`, for callers outside an event loop."""
        with self._lock:
            entry = self._results.get(request_id)
            if entry is None or entry[0] <= self._clock():
                return None
            return entry[1]

    async def get(self, request_id: RequestId) -> StoredResult | None:
        return self.get_nowait(request_id)

    def delete(self, request_id: RequestId) -> None:
        with self._lock:
            self._results.pop(request_id, None)

    def answered(self, request_id: RequestId, keep_s: float) -> None:
        with self._lock:
            now = self._clock()
            expires_at = now + max(0.0, keep_s)
            entry = self._results.get(request_id)
            if entry is not None and expires_at < entry[0]:  # shorten only, never lengthen
                self._results[request_id] = (expires_at, entry[1])
                heapq.heappush(self._expiries, (expires_at, request_id))  # the purge must see the new time
            self._purge(now)

    def __len__(self) -> int:
        with self._lock:
            return len(self._results)

    def _purge(self, now: float) -> None:
        """Drop expired results; heap entries of replaced, deleted or answered results are skipped."""
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, request_id = heapq.heappop(self._expiries)
            entry = self._results.get(request_id)
            if entry is not None and entry[0] == expires_at:
                del self._results[request_id]
        if len(self._expiries) > 2 * len(self._results) + 1024:
            self._expiries = [(expires_at, request_id) for request_id, (expires_at, _) in self._results.items()]
            heapq.heapify(self._expiries)


class KeyedWaiters:
    """Futures parked per key, thread-safe: what a notifier (or any per-key wake-up) keeps for its waiters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, list[asyncio.Future[bool]]] = {}

    def park_all(self, keys: Iterable[str], future: asyncio.Future[bool]) -> None:
        """Park one future under every key: whichever is taken first resolves it (one wait for many keys)."""
        with self._lock:
            for key in keys:
                self._futures.setdefault(key, []).append(future)

    async def await_parked(self, keys: Iterable[str], future: asyncio.Future[bool], timeout_s: float) -> bool:
        """Await a future parked under `keys`: True once resolved, False after `timeout_s`; unparked either way."""
        try:
            return await asyncio.wait_for(future, max(0.0, timeout_s))
        except TimeoutError:
            return False
        finally:
            for key in keys:
                self.discard(key, future)

    def take(self, keys: Iterable[str]) -> list[asyncio.Future[bool]]:
        """Remove and return every future parked on `keys`."""
        with self._lock:
            return [f for key in keys for f in self._futures.pop(key, [])]

    def take_all(self) -> list[asyncio.Future[bool]]:
        """Remove and return every parked future (e.g. after a lost subscription: all must re-check)."""
        with self._lock:
            futures = [f for parked in self._futures.values() for f in parked]
            self._futures.clear()
            return futures

    def discard(self, key: str, future: asyncio.Future[bool]) -> None:
        with self._lock:
            futures = self._futures.get(key)
            if futures is None:
                return
            if future in futures:
                futures.remove(future)
            if not futures:
                del self._futures[key]

    def count(self) -> int:
        with self._lock:
            return sum(len(futures) for futures in self._futures.values())


class Announcements:
    """What a notifier keeps of this process's view: recent publishes (`RecentIds`) and the waits parked on
    them (`KeyedWaiters`), under one lock that a wait checks and parks under, so no publish can fall between
    a wait's check and its parking. Both notifiers are made of one; `lock` also guards what a notifier adds
    to the check (the Redis one: its subscription state)."""

    def __init__(self, retention_s: float, max_retained: int, clock: Clock = time.monotonic) -> None:
        self.lock = threading.Lock()
        self.published = RecentIds(retention_s, max_retained, clock)
        self.waiters = KeyedWaiters()

    def add(self, request_ids: Sequence[RequestId]) -> None:
        """Record publishes and wake their waiters."""
        with self.lock:
            for request_id in request_ids:
                self.published.add(request_id)
            waiters = self.waiters.take(request_ids)
        resolve_all_threadsafe(waiters)

    def mark(self) -> int:
        with self.lock:
            return self.published.mark()

    def seen(self, check: Callable[[RecentIds], bool]) -> bool:
        with self.lock:
            return check(self.published)

    async def wait(self, request_ids: Collection[RequestId], timeout_s: float,
                   check: Callable[[RecentIds], bool]) -> bool:
        """True at once if `check` holds (under the lock), else once any of `request_ids` is published;
        False after `timeout_s`."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        with self.lock:
            if check(self.published):
                return True
            if timeout_s <= 0:
                return False
            self.waiters.park_all(request_ids, future)
        return await self.waiters.await_parked(request_ids, future, timeout_s)


class InMemoryNotifier:
    """`Notifier` with per-waiter asyncio futures; one instance serves every long-poll of a process."""

    def __init__(self, retention_s: float = 60.0, max_retained: int = 100_000, clock: Clock = time.monotonic):
        self._announced = Announcements(retention_s, max_retained, clock)

    def publish(self, request_id: RequestId) -> None:
        self.publish_many([request_id])

    def publish_many(self, request_ids: Sequence[RequestId]) -> None:
        self._announced.add(request_ids)

    async def wait(self, request_id: RequestId, timeout_s: float) -> bool:
        return await self._announced.wait([request_id], timeout_s, lambda seen: seen.contains(request_id))

    def mark(self) -> int:
        return self._announced.mark()

    async def wait_any(self, request_ids: Collection[RequestId], timeout_s: float, *, after: int) -> bool:
        return await self._announced.wait(request_ids, timeout_s, lambda seen: seen.any_since(request_ids, after))

    def changed_since(self, request_ids: Collection[RequestId], mark: int) -> bool:
        # In process no publish is missed; one no longer remembered counts as made (RecentIds).
        return self._announced.seen(lambda seen: seen.any_since(request_ids, mark))

    def waiting(self) -> int:
        """Waiters currently parked (for metrics)."""
        return self._announced.waiters.count()


def resolve_all_threadsafe(futures: Sequence[asyncio.Future[bool]]) -> None:
    """Set every future on its own loop, with one wake-up per loop: each `call_soon_threadsafe` writes to
    the loop's self-pipe, which with a pass's worth of waiters was most of what publishing cost."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[bool]]] = {}
    for future in futures:
        by_loop.setdefault(future.get_loop(), []).append(future)
    for loop, group in by_loop.items():

        def resolve(group: list[asyncio.Future[bool]] = group) -> None:
            for future in group:
                if not future.done():
                    future.set_result(True)

        with contextlib.suppress(RuntimeError):  # a closed loop: its waiters are gone, which is fine
            loop.call_soon_threadsafe(resolve)


def resolve_threadsafe(future: asyncio.Future[bool]) -> None:
    """Set `future` on its own loop; a closed loop means its waiter is gone, which is fine."""

    def resolve() -> None:
        if not future.done():
            future.set_result(True)

    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(resolve)


class RecentIds:
    """Ids published in the last `retention_s` (at most `max_retained`): lets a waiter that arrives just
    after its publish return at once. Shared by the in-process and the Redis notifier.

    Each publish also takes the next number of a sequence, so a caller can ask "published after my `mark`?"
    (`any_since`) instead of "published lately?" (`contains`): a poll that waits again for ids it already
    looked at is then not woken at once by the publish it has just handled. The caller serializes calls."""

    def __init__(self, retention_s: float, max_retained: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._retention_s = retention_s
        self._max_retained = max_retained
        self._clock = clock
        self._ids: OrderedDict[RequestId, tuple[float, int]] = OrderedDict()
        self._seq = 0
        self._forgotten = 0
        """The newest sequence number no longer known by id: a mark before it must assume it was its id."""

    def add(self, request_id: RequestId) -> None:
        now = self._clock()
        self._seq += 1
        self._ids[request_id] = (now, self._seq)
        self._ids.move_to_end(request_id)
        cutoff = now - self._retention_s
        while self._ids and (len(self._ids) > self._max_retained or next(iter(self._ids.values()))[0] < cutoff):
            self._forgotten = max(self._forgotten, self._ids.popitem(last=False)[1][1])

    def contains(self, request_id: RequestId) -> bool:
        entry = self._ids.get(request_id)
        return entry is not None and entry[0] >= self._clock() - self._retention_s

    def mark(self) -> int:
        """The sequence number of the latest publish: what `any_since` compares with."""
        return self._seq

    def any_since(self, request_ids: Iterable[RequestId], mark: int) -> bool:
        """Whether any of `request_ids` was published after `mark` (True too when that can no longer be told)."""
        if self._forgotten > mark:
            return True
        return any(self._ids.get(request_id, (0.0, 0))[1] > mark for request_id in request_ids)

    def forget_all(self) -> None:
        """Publishes may have been missed (a lost subscription): every earlier mark counts as published."""
        self._seq += 1
        self._forgotten = self._seq
