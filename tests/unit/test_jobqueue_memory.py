"""What only the in-process queue, result store and notifier have: TTLs on a fake clock, bounded retention,
a blocking claim. The behaviour they share with the Redis backends (order, acks, recovery, long-poll wake-ups
from a worker thread) is tests/integration/test_jobqueue_contract.py, run for both backends."""

from __future__ import annotations

import asyncio
import threading

from services.domain.training import WorkError
from services.jobqueue import (
    InMemoryNotifier,
    InMemoryResultStore,
    InMemoryWorkQueue,
    ResultStatus,
    StoredResult,
)
from services.scheduler import Completion, ModelId, QueuedRequest, RequestId, RequestKind, TenantId

BASE = "Qwen/Qwen3-0.6B"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(i: int) -> QueuedRequest:
    return QueuedRequest(
        RequestId(f"r{i}"), TenantId("t"), ModelId("m"), RequestKind.FORWARD_BACKWARD, i, num_tokens=4
    )


def test_claim_blocks_until_another_thread_enqueues() -> None:
    queue = InMemoryWorkQueue()
    claimed: list[list[str]] = []
    blocked = threading.Thread(
        target=lambda: claimed.append([d.request.request_id for d in queue.claim(BASE, max_items=8, timeout_s=60)]))
    blocked.start()
    blocked.join(timeout=0.05)
    assert blocked.is_alive() and claimed == []  # nothing queued: the claim waits (a 60 s timeout)
    queue.enqueue(BASE, request(1))
    blocked.join()
    assert claimed == [["r1"]]  # woken by the enqueue; how fast: bench/jobqueue.py
    assert queue.claim(BASE, max_items=8, timeout_s=0.01) == []


def test_result_store_keeps_results_until_their_ttl() -> None:
    clock = FakeClock()
    store = InMemoryResultStore(clock=clock)
    ok = StoredResult(ResultStatus.OK, b"proto-bytes")
    store.put(RequestId("a"), ok, ttl_s=10)
    store.put(RequestId("b"), ok, ttl_s=100)
    assert asyncio.run(store.get(RequestId("a"))) == ok
    clock.now = 10
    assert store.get_nowait(RequestId("a")) is None
    store.put(RequestId("c"), ok, ttl_s=10)  # writes purge what expired
    assert len(store) == 2
    store.delete(RequestId("b"))
    assert store.get_nowait(RequestId("b")) is None


def test_replacing_a_result_extends_its_life() -> None:
    clock = FakeClock()
    store = InMemoryResultStore(clock=clock)
    store.put(RequestId("a"), StoredResult(ResultStatus.OK, 1), ttl_s=10)
    store.put(RequestId("a"), StoredResult(ResultStatus.OK, 2), ttl_s=50)
    clock.now = 20
    store.put(RequestId("z"), StoredResult(ResultStatus.OK, 0), ttl_s=5)
    assert store.get_nowait(RequestId("a")) == StoredResult(ResultStatus.OK, 2)


def test_an_answered_result_is_kept_only_for_its_grace_and_then_purged() -> None:
    clock = FakeClock()
    store = InMemoryResultStore(clock=clock)
    ok = StoredResult(ResultStatus.OK, b"proto-bytes")
    for name in ("answered", "unanswered", "short"):
        store.put(RequestId(name), ok, ttl_s=3600 if name != "short" else 10)
    store.answered(RequestId("answered"), 120)
    store.answered(RequestId("short"), 120)  # never lengthens: it still goes at 10 s
    store.answered(RequestId("never-stored"), 120)  # nothing to shorten, and nothing is created
    clock.now = 10
    assert store.get_nowait(RequestId("short")) is None and store.get_nowait(RequestId("never-stored")) is None
    clock.now = 119.5
    assert store.get_nowait(RequestId("answered")) == ok
    store.answered(RequestId("answered"), 120)  # answered again (a retried poll): its grace does not restart
    clock.now = 120
    assert store.get_nowait(RequestId("answered")) is None
    assert store.get_nowait(RequestId("unanswered")) == ok
    store.put(RequestId("next"), ok, ttl_s=3600)  # writes purge what expired: the answered one is gone for good
    assert len(store) == 2


def test_a_grace_of_zero_drops_at_once_and_a_later_put_stores_afresh() -> None:
    clock = FakeClock()
    store = InMemoryResultStore(clock=clock)
    store.put(RequestId("a"), StoredResult(ResultStatus.OK, 1), ttl_s=3600)
    store.answered(RequestId("a"), 0)
    assert store.get_nowait(RequestId("a")) is None and len(store) == 0
    store.put(RequestId("a"), StoredResult(ResultStatus.OK, 2), ttl_s=3600)  # a retried store: the full TTL
    clock.now = 3599
    assert store.get_nowait(RequestId("a")) == StoredResult(ResultStatus.OK, 2)


def test_expiry_bookkeeping_stays_bounded_by_the_live_results() -> None:
    """Answering leaves each result's first expiry in the heap; it is compacted, or an hour of answered
    results would leave an hour of (time, id) entries behind although the results themselves are gone."""
    clock = FakeClock()
    store = InMemoryResultStore(clock=clock)
    for i in range(20_000):
        store.put(RequestId(f"r{i}"), StoredResult(ResultStatus.OK, i), ttl_s=3600)
        store.answered(RequestId(f"r{i}"), 1)
        clock.now += 0.01  # 100 results/s: some 100 are within their 1 s grace at any time
    assert len(store) <= 101
    assert len(store._expiries) <= 2 * len(store) + 1024 + 1


def test_stored_result_from_completion_marks_work_errors() -> None:
    error = StoredResult.from_completion(Completion(request(1), WorkError("bad input")))
    ok = StoredResult.from_completion(Completion(request(2), {"metrics": {}}))
    assert (error.status, ok.status) == (ResultStatus.ERROR, ResultStatus.OK)


def test_a_wait_that_starts_after_the_publish_returns_at_once_within_retention() -> None:
    clock = FakeClock()
    notifier = InMemoryNotifier(retention_s=30, clock=clock)
    notifier.publish(RequestId("early"))

    async def poll() -> bool:
        return await notifier.wait(RequestId("early"), timeout_s=0)

    assert asyncio.run(poll()) is True
    clock.now = 31
    assert asyncio.run(poll()) is False


def test_retention_is_bounded_in_size() -> None:
    notifier = InMemoryNotifier(max_retained=2)
    for i in range(3):
        notifier.publish(RequestId(f"r{i}"))

    async def poll(rid: str) -> bool:
        return await notifier.wait(RequestId(rid), timeout_s=0)

    assert [asyncio.run(poll(f"r{i}")) for i in range(3)] == [False, True, True]


def test_a_mark_older_than_a_publish_retention_forgot_counts_as_published() -> None:
    """`wait_any` cannot tell whether an id pushed out of the bounded retention was one of its own: it looks
    again rather than risk missing it."""
    notifier = InMemoryNotifier(max_retained=2)
    mark = notifier.mark()
    for i in range(2):
        notifier.publish(RequestId(f"r{i}"))

    async def poll(rid: str, after: int) -> bool:
        return await notifier.wait_any([RequestId(rid)], 0, after=after)

    assert asyncio.run(poll("unrelated", mark)) is False  # both still known by id: not this one
    notifier.publish(RequestId("r2"))  # r0 is forgotten now
    assert asyncio.run(poll("unrelated", mark)) is True
    assert asyncio.run(poll("unrelated", notifier.mark())) is False
