"""In-process queue, result store and notifier, including asyncio waiters woken from a worker thread."""

from __future__ import annotations

import asyncio
import threading
import time

from services.domain.training import WorkError
from services.jobqueue import (
    InMemoryNotifier,
    InMemoryResultStore,
    InMemoryWorkQueue,
    Notifier,
    ResultStatus,
    ResultStore,
    StoredResult,
    WorkQueue,
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


def test_in_memory_classes_satisfy_the_protocols() -> None:
    assert isinstance(InMemoryWorkQueue(), WorkQueue)
    assert isinstance(InMemoryResultStore(), ResultStore)
    assert isinstance(InMemoryNotifier(), Notifier)


def test_queue_claims_in_order_per_base_model_and_acks() -> None:
    queue = InMemoryWorkQueue()
    for i in range(5):
        queue.enqueue(BASE, request(i))
    queue.enqueue("other-base", request(99))
    claimed = queue.claim(BASE, max_items=3)
    assert [d.request.request_id for d in claimed] == ["r0", "r1", "r2"]
    assert (queue.depth(BASE), queue.unacked(BASE), queue.depth("other-base")) == (2, 3, 1)
    assert queue.ack(BASE, [d.delivery_id for d in claimed] + ["unknown"]) == 3
    assert queue.unacked(BASE) == 0
    assert queue.claim("nothing-here", max_items=3) == []


def test_recover_requeues_unacked_entries_in_front_in_original_order() -> None:
    queue = InMemoryWorkQueue()
    for i in range(4):
        queue.enqueue(BASE, request(i))
    claimed = queue.claim(BASE, max_items=3)
    queue.ack(BASE, [claimed[1].delivery_id])
    assert queue.recover(BASE) == 2
    assert [d.request.request_id for d in queue.claim(BASE, max_items=10)] == ["r0", "r2", "r3"]


def test_claim_blocks_until_another_thread_enqueues() -> None:
    queue = InMemoryWorkQueue()
    timer = threading.Timer(0.05, lambda: queue.enqueue(BASE, request(1)))
    timer.start()
    started = time.monotonic()
    claimed = queue.claim(BASE, max_items=8, timeout_s=5.0)
    assert [d.request.request_id for d in claimed] == ["r1"]
    assert time.monotonic() - started < 2.0
    assert queue.claim(BASE, max_items=8, timeout_s=0.01) == []
    timer.join()


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


def test_stored_result_from_completion_marks_work_errors() -> None:
    error = StoredResult.from_completion(Completion(request(1), WorkError("bad input")))
    ok = StoredResult.from_completion(Completion(request(2), {"metrics": {}}))
    assert (error.status, ok.status) == (ResultStatus.ERROR, ResultStatus.OK)


def test_long_poll_waiter_is_woken_by_a_worker_thread() -> None:
    store, notifier = InMemoryResultStore(), InMemoryNotifier()
    rid = RequestId("req-1")

    def worker() -> None:
        time.sleep(0.05)
        store.put(rid, StoredResult(ResultStatus.OK, b"done"))
        notifier.publish(rid)

    async def long_poll() -> tuple[bool, StoredResult | None, float]:
        assert await store.get(rid) is None
        started = time.monotonic()
        threading.Thread(target=worker).start()
        woke = await notifier.wait(rid, timeout_s=5.0)
        return woke, await store.get(rid), time.monotonic() - started

    woke, result, elapsed = asyncio.run(long_poll())
    assert woke and result == StoredResult(ResultStatus.OK, b"done")
    assert elapsed < 2.0
    assert notifier.waiting() == 0


def test_wait_times_out_with_false_and_leaves_no_waiter_behind() -> None:
    notifier = InMemoryNotifier()

    async def poll() -> bool:
        return await notifier.wait(RequestId("never"), timeout_s=0.05)

    assert asyncio.run(poll()) is False
    assert notifier.waiting() == 0


def test_publish_only_wakes_waiters_of_that_request() -> None:
    notifier = InMemoryNotifier()

    async def scenario() -> list[bool]:
        waits = [asyncio.create_task(notifier.wait(RequestId(f"r{i}"), timeout_s=0.3)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert notifier.waiting() == 3
        threading.Thread(target=notifier.publish, args=(RequestId("r1"),)).start()
        return list(await asyncio.gather(*waits))

    assert asyncio.run(scenario()) == [False, True, False]


def test_many_waiters_on_one_request_all_wake() -> None:
    notifier = InMemoryNotifier()

    async def scenario() -> list[bool]:
        waits = [asyncio.create_task(notifier.wait(RequestId("r"), timeout_s=5)) for _ in range(50)]
        await asyncio.sleep(0.01)
        threading.Thread(target=notifier.publish, args=(RequestId("r"),)).start()
        return list(await asyncio.gather(*waits))

    assert all(asyncio.run(scenario()))


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


def test_cancelled_waiter_is_discarded() -> None:
    notifier = InMemoryNotifier()

    async def scenario() -> None:
        task = asyncio.create_task(notifier.wait(RequestId("r"), timeout_s=5))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert notifier.waiting() == 0
    notifier.publish(RequestId("r"))  # nobody left to wake; must not raise
