"""The `WorkQueue` / `ResultStore` / `Notifier` contract, run on the in-process and the Redis versions alike.

Redis runs at `$CARPOOL_TEST_REDIS_URL` (default the local CI server); each test gets its own random key
prefix and channel and deletes its keys afterwards, so tests can share the server with other suites.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import redis

from services.domain.training import Datum, ForwardBackwardWork
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
from services.jobqueue.redis_queue import RedisWorkQueue
from services.jobqueue.redis_results import RedisNotifier, RedisResultStore
from services.scheduler import ModelId, QueuedRequest, RequestId, RequestKind, TenantId
from tests.required import require_redis

REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BASE = "Qwen/Qwen3-0.6B"


@dataclass
class Backend:
    """One implementation of the three seams, plus what the tests need to inspect it."""

    name: str
    queue: InMemoryWorkQueue | RedisWorkQueue
    store: ResultStore
    notifier: InMemoryNotifier | RedisNotifier


def redis_client() -> redis.Redis:
    require_redis(REDIS_URL)
    return redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)


def delete_prefixed(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
    if keys:
        client.delete(*keys)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield Backend("memory", InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier())
        return
    client = redis_client()
    prefix = f"carpool-test-{uuid.uuid4().hex[:12]}"
    store = RedisResultStore(client, prefix=prefix)
    notifier = RedisNotifier(client, prefix=prefix)
    assert notifier.start(timeout_s=5)
    yield Backend("redis", RedisWorkQueue(client, prefix=prefix), store, notifier)
    notifier.close()
    store.close()
    delete_prefixed(client, prefix)
    client.close()


def request(i: int, payload: object = None) -> QueuedRequest:
    return QueuedRequest(
        RequestId(f"r{i}"), TenantId("t"), ModelId("m"), RequestKind.FORWARD_BACKWARD, i, 4, payload=payload
    )


def ids(deliveries: list) -> list[str]:
    return [d.request.request_id for d in deliveries]


async def wait_for(probe: Callable[[], object], expected: object, timeout_s: float = 30.0) -> object:
    """Poll `probe` (a plain or async callable) on this loop until it returns `expected`; fails after
    `timeout_s` (a bound for a hang, never a measurement)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value == expected:
            return value
        assert time.monotonic() < deadline, f"{probe} never returned {expected!r} (last: {value!r})"
        await asyncio.sleep(0.005)


def test_implementations_satisfy_the_protocols(backend: Backend) -> None:
    assert isinstance(backend.queue, WorkQueue)
    assert isinstance(backend.store, ResultStore)
    assert isinstance(backend.notifier, Notifier)


def test_queue_is_fifo_per_base_model_and_acks_count_pending_entries(backend: Backend) -> None:
    queue = backend.queue
    for i in range(5):
        queue.enqueue(BASE, request(i))
    queue.enqueue("other-base", request(99))
    claimed = queue.claim(BASE, max_items=3)
    assert ids(claimed) == ["r0", "r1", "r2"]
    assert (queue.depth(BASE), queue.unacked(BASE), queue.depth("other-base")) == (2, 3, 1)
    assert queue.ack(BASE, [d.delivery_id for d in claimed] + ["unknown"]) == 3
    assert queue.ack(BASE, [claimed[0].delivery_id]) == 0  # acking twice counts once
    assert ids(queue.claim(BASE, max_items=10)) == ["r3", "r4"]
    assert ids(queue.claim("other-base", max_items=10)) == ["r99"]
    assert queue.claim("nothing-here", max_items=3) == []
    assert queue.depth("nothing-here") == 0


def test_claim_without_timeout_returns_at_once_and_with_one_waits_for_work(backend: Backend) -> None:
    queue = backend.queue
    assert queue.claim(BASE, max_items=4) == []
    assert queue.claim(BASE, max_items=4, timeout_s=0.1) == []
    claimed: list[list[str]] = []
    waiting = threading.Thread(target=lambda: claimed.append(ids(queue.claim(BASE, max_items=8, timeout_s=60))))
    waiting.start()
    queue.enqueue(BASE, request(1))  # whether the claim is blocked yet or not, it must get this entry
    waiting.join()
    assert claimed == [["r1"]]  # timings (how soon the claim wakes up): bench/jobqueue.py


def test_recover_puts_unacked_entries_back_in_front_in_enqueue_order(backend: Backend) -> None:
    queue = backend.queue
    for i in range(4):
        queue.enqueue(BASE, request(i))
    claimed = queue.claim(BASE, max_items=3)
    queue.ack(BASE, [claimed[1].delivery_id])
    assert queue.recover(BASE) == 2
    assert queue.recover(BASE) == 0  # already waiting to be claimed again
    assert (queue.depth(BASE), queue.unacked(BASE)) == (3, 0)
    queue.enqueue(BASE, request(4))
    assert ids(queue.claim(BASE, max_items=2)) == ["r0", "r2"]
    assert ids(queue.claim(BASE, max_items=10)) == ["r3", "r4"]
    assert queue.recover("nothing-here") == 0


def test_payload_with_numpy_arrays_survives_the_queue(backend: Backend) -> None:
    datum = Datum(np.arange(6, dtype=np.int64), {"weights": np.linspace(0, 1, 6, dtype=np.float32)})
    work = ForwardBackwardWork(adapter_id=None, data=[datum], loss_fn="cross_entropy")
    backend.queue.enqueue(BASE, request(7, payload=work))
    (delivery,) = backend.queue.claim(BASE, max_items=1)
    got = delivery.request.payload
    assert isinstance(got, ForwardBackwardWork) and delivery.request.kind is RequestKind.FORWARD_BACKWARD
    np.testing.assert_array_equal(got.data[0].tokens, datum.tokens)
    np.testing.assert_array_equal(got.data[0].loss_inputs["weights"], datum.loss_inputs["weights"])


def test_results_live_for_their_ttl_and_can_be_replaced_or_deleted(backend: Backend) -> None:
    store = backend.store
    ok = StoredResult(ResultStatus.OK, b"proto-bytes")

    async def scenario() -> None:
        store.put(RequestId("a"), ok, ttl_s=0.3)
        store.put(RequestId("b"), ok, ttl_s=60)
        store.put(RequestId("c"), StoredResult(ResultStatus.OK, 1), ttl_s=0.3)
        store.put(RequestId("c"), StoredResult(ResultStatus.ERROR, 2), ttl_s=60)  # replacing extends life
        assert await store.get(RequestId("a")) == ok
        await wait_for(lambda: store.get(RequestId("a")), None)  # it expires (the TTL itself: a fake
        # clock in tests/unit/test_jobqueue_memory.py; Redis keeps its own)
        assert await store.get(RequestId("c")) == StoredResult(ResultStatus.ERROR, 2)
        store.delete(RequestId("b"))
        assert await store.get(RequestId("b")) is None
        assert await store.get(RequestId("never")) is None

    asyncio.run(scenario())


def test_an_answered_result_goes_after_its_grace_and_an_unanswered_one_stays(backend: Backend) -> None:
    store = backend.store
    ok = StoredResult(ResultStatus.OK, b"proto-bytes")

    async def scenario() -> None:
        for name in ("answered", "unanswered", "dropped"):
            store.put(RequestId(name), ok, ttl_s=60)
        store.answered(RequestId("answered"), 0.3)
        store.answered(RequestId("dropped"), 0)
        store.answered(RequestId("never-stored"), 60)
        await wait_for(lambda: store.get(RequestId("dropped")), None)
        await wait_for(lambda: store.get(RequestId("answered")), None)  # within its 60 s TTL: the grace cut it
        assert await store.get(RequestId("unanswered")) == ok
        assert await store.get(RequestId("never-stored")) is None

    asyncio.run(scenario())


def test_long_poll_waiter_is_woken_by_a_worker_thread(backend: Backend) -> None:
    store, notifier = backend.store, backend.notifier
    rid = RequestId("req-1")

    def worker() -> None:
        store.put(rid, StoredResult(ResultStatus.OK, b"done"))
        notifier.publish(rid)

    async def long_poll() -> tuple[bool, StoredResult | None]:
        assert await store.get(rid) is None
        parked = asyncio.create_task(notifier.wait(rid, timeout_s=60))
        await wait_for(notifier.waiting, 1)  # parked before the worker publishes: the publish must wake it
        threading.Thread(target=worker).start()
        return await parked, await store.get(rid)

    woke, result = asyncio.run(long_poll())
    assert woke and result == StoredResult(ResultStatus.OK, b"done")  # woken, not timed out
    assert notifier.waiting() == 0


def test_wait_times_out_with_false_and_leaves_no_waiter_behind(backend: Backend) -> None:
    async def poll() -> tuple[int, bool]:
        parked = asyncio.create_task(backend.notifier.wait(RequestId("never"), timeout_s=0.1))
        await asyncio.sleep(0)  # let it park
        return backend.notifier.waiting(), await parked

    assert asyncio.run(poll()) == (1, False)  # it did wait, then gave up with False
    assert backend.notifier.waiting() == 0


def test_publish_only_wakes_waiters_of_that_request(backend: Backend) -> None:
    notifier = backend.notifier

    async def scenario() -> list[bool]:
        waits = [asyncio.create_task(notifier.wait(RequestId(f"r{i}"), timeout_s=0.5)) for i in range(3)]
        await wait_for(notifier.waiting, 3)
        threading.Thread(target=notifier.publish, args=(RequestId("r1"),)).start()
        return list(await asyncio.gather(*waits))

    assert asyncio.run(scenario()) == [False, True, False]


def test_a_wait_that_starts_after_the_publish_returns_at_once(backend: Backend) -> None:
    backend.notifier.publish(RequestId("early"))

    async def poll(rid: str) -> bool:
        return await backend.notifier.wait(RequestId(rid), timeout_s=0)

    # Over Redis the listener thread receives the publish a moment later: wait until it has, then a wait
    # with no timeout at all must see it (and one for an id nobody published must not).
    assert asyncio.run(wait_for(lambda: poll("early"), True))
    assert asyncio.run(poll("not-published")) is False


def test_many_waiters_are_each_woken_by_their_own_publish(backend: Backend) -> None:
    notifier, count = backend.notifier, 500
    woken: list[int] = []

    async def waiter(i: int) -> bool:
        woke = await notifier.wait(RequestId(f"many-{i}"), timeout_s=60)
        woken.append(i)
        return woke

    async def scenario() -> list[bool]:
        waits = [asyncio.create_task(waiter(i)) for i in range(count)]
        await wait_for(notifier.waiting, count)
        silent = asyncio.create_task(notifier.wait(RequestId("never-published"), timeout_s=60))
        thread = threading.Thread(target=lambda: [notifier.publish(RequestId(f"many-{i}")) for i in range(count)])
        thread.start()
        results = list(await asyncio.gather(*waits))
        thread.join()
        assert notifier.waiting() == 1 and not silent.done()  # the one nobody published for still waits
        silent.cancel()
        return results

    assert asyncio.run(scenario()) == [True] * count  # all woken by a publish (none timed out)
    assert sorted(woken) == list(range(count))
    assert notifier.waiting() == 0  # the latency of the wake-ups: bench/jobqueue.py


def test_cancelled_waiter_is_discarded(backend: Backend) -> None:
    notifier = backend.notifier

    async def scenario() -> None:
        task = asyncio.create_task(notifier.wait(RequestId("r"), timeout_s=5))
        await wait_for(notifier.waiting, 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert notifier.waiting() == 0
    notifier.publish(RequestId("r"))  # nobody left to wake; must not raise


def test_publish_many_wakes_exactly_the_published_waiters(backend: Backend) -> None:
    """A packed pass announces all its requests at once: each of them wakes, nobody else does, an empty
    announcement is fine, and a wait that starts afterwards returns at once as after `publish`."""
    notifier = backend.notifier

    async def scenario() -> list[bool]:
        waits = [asyncio.create_task(notifier.wait(RequestId(f"batch-{i}"), timeout_s=2.0)) for i in range(6)]
        await wait_for(notifier.waiting, 6)
        published = [RequestId(f"batch-{i}") for i in (0, 2, 3, 5)]
        thread = threading.Thread(target=lambda: (notifier.publish_many([]), notifier.publish_many(published)))
        thread.start()
        results = list(await asyncio.gather(*waits))
        thread.join()
        return results

    assert asyncio.run(scenario()) == [True, False, True, True, False, True]
    late = asyncio.run(wait_for(lambda: notifier.wait(RequestId("batch-3"), timeout_s=0), True))
    assert late is True


def test_wait_any_wakes_on_a_publish_of_any_of_its_ids_after_the_mark(backend: Backend) -> None:
    """A held batched poll waits for several requests with one `wait_any`: a publish of any of them after
    its mark wakes it, one seen before the mark does not (it would make the poll look again and again), and
    the wait leaves nothing parked behind under any of its ids."""
    notifier = backend.notifier
    notifier.publish(RequestId("seen"))

    async def scenario() -> tuple[bool, bool]:
        await wait_for(lambda: notifier.wait(RequestId("seen"), timeout_s=0), True)  # received (Redis: later)
        mark = notifier.mark()
        keys = [RequestId("seen"), RequestId("any-1"), RequestId("any-2")]
        quiet = await notifier.wait_any(keys, 0.05, after=mark)
        parked = asyncio.create_task(notifier.wait_any(keys, 60, after=mark))
        await wait_for(notifier.waiting, 3)  # one wait, parked under each of its ids
        threading.Thread(target=notifier.publish_many, args=([RequestId("other"), RequestId("any-2")],)).start()
        return quiet, await parked

    assert asyncio.run(scenario()) == (False, True)
    assert notifier.waiting() == 0


def test_wait_any_returns_at_once_for_a_publish_between_the_mark_and_the_wait(backend: Backend) -> None:
    notifier = backend.notifier

    async def scenario() -> tuple[bool, bool]:
        mark = notifier.mark()
        notifier.publish(RequestId("between"))
        await wait_for(lambda: notifier.wait(RequestId("between"), timeout_s=0), True)
        late = await notifier.wait_any([RequestId("between")], 0, after=mark)
        return late, await notifier.wait_any([RequestId("between")], 0, after=notifier.mark())

    assert asyncio.run(scenario()) == (True, False)
    assert notifier.waiting() == 0


def test_changed_since_tells_a_publish_after_the_mark_without_waiting(backend: Backend) -> None:
    """What an ack poll answered from memory asks: was any of these ids announced after my mark? Only a
    publish of one of them after the mark says yes; and whenever it says no, `wait_any` would park."""
    notifier = backend.notifier
    keys = [RequestId("seen"), RequestId("watched")]

    async def received(request_id: str) -> None:  # Redis delivers a publish later, on its listener thread
        await wait_for(lambda: notifier.wait(RequestId(request_id), timeout_s=0), True)

    async def scenario() -> list[bool]:
        notifier.publish(RequestId("seen"))
        await received("seen")
        mark = notifier.mark()
        answers = [notifier.changed_since(keys, mark), await notifier.wait_any(keys, 0, after=mark)]
        notifier.publish(RequestId("unwatched"))
        await received("unwatched")
        answers.append(notifier.changed_since(keys, mark))
        notifier.publish_many([RequestId("watched")])
        await received("watched")
        answers += [notifier.changed_since(keys, mark), notifier.changed_since([RequestId("seen")], mark),
                    notifier.changed_since(keys, notifier.mark())]
        return answers

    assert asyncio.run(scenario()) == [False, False, False, True, False, False]
    assert notifier.waiting() == 0
