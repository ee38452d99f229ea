"""Job-queue latencies the tests no longer assert (tests check behaviour; timings live here).

For the in-process and the Redis backends alike (Redis at `$CARPOOL_TEST_REDIS_URL`, default the local
server, under a throwaway key prefix):

  claim_wake     a claim blocked on an empty queue until another thread enqueues: enqueue → claim returns
  long_poll      one `Notifier.wait` parked on the event loop, published from a worker thread
  many_waiters   500 waiters parked, one thread publishes all: last publish → last waiter woken

Medians over rounds, in milliseconds, and the Redis / in-memory ratio per measure. The last line is
machine-readable: RESULT <backend>_<measure>_ms=X ... redis_vs_memory_<measure>=X ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from services.jobqueue import InMemoryNotifier, InMemoryWorkQueue
from services.jobqueue.redis_queue import RedisWorkQueue
from services.jobqueue.redis_results import RedisNotifier
from services.scheduler import ModelId, QueuedRequest, RequestId, RequestKind, TenantId

REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BASE = "bench-base"
WAITERS = 500


@dataclass
class Backend:
    name: str
    queue: InMemoryWorkQueue | RedisWorkQueue
    notifier: InMemoryNotifier | RedisNotifier


@contextmanager
def backends() -> Iterator[list[Backend]]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    prefix = f"carpool-bench-{uuid.uuid4().hex[:10]}"
    notifier = RedisNotifier(client, prefix=prefix)
    if not notifier.start(timeout_s=5):
        raise SystemExit(f"no Redis subscription at {REDIS_URL}")
    try:
        yield [Backend("memory", InMemoryWorkQueue(), InMemoryNotifier()),
               Backend("redis", RedisWorkQueue(client, prefix=prefix), notifier)]
    finally:
        notifier.close()
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
        client.close()


def claim_wake(backend: Backend, round_: int) -> float:
    """Seconds from an enqueue to the return of the claim that was blocked waiting for it."""
    returned: list[float] = []
    parked = threading.Event()

    def claim() -> None:
        parked.set()
        backend.queue.claim(BASE, max_items=1, timeout_s=10)
        returned.append(time.perf_counter())

    thread = threading.Thread(target=claim)
    thread.start()
    parked.wait()
    time.sleep(0.05)  # let the claim block (this is a measurement, not a test)
    enqueued = time.perf_counter()
    backend.queue.enqueue(BASE, QueuedRequest(RequestId(f"b{round_}"), TenantId("t"), ModelId("m"),
                                              RequestKind.FORWARD, round_, 1))
    thread.join()
    return returned[0] - enqueued


def long_poll(backend: Backend, round_: int) -> float:
    rid = RequestId(f"poll-{round_}")

    async def scenario() -> float:
        task = asyncio.create_task(backend.notifier.wait(rid, timeout_s=10))
        while backend.notifier.waiting() < 1:
            await asyncio.sleep(0.001)
        published: list[float] = []
        threading.Thread(target=lambda: (published.append(time.perf_counter()), backend.notifier.publish(rid))).start()
        await task
        return time.perf_counter() - published[0]

    return asyncio.run(scenario())


def many_waiters(backend: Backend, round_: int) -> float:
    async def scenario() -> float:
        rids = [RequestId(f"many-{round_}-{i}") for i in range(WAITERS)]
        tasks = [asyncio.create_task(backend.notifier.wait(rid, timeout_s=30)) for rid in rids]
        while backend.notifier.waiting() < WAITERS:
            await asyncio.sleep(0.001)
        published: list[float] = []

        def publish_all() -> None:
            for rid in rids:
                backend.notifier.publish(rid)
            published.append(time.perf_counter())

        thread = threading.Thread(target=publish_all)
        thread.start()
        await asyncio.gather(*tasks)
        woken = time.perf_counter()
        thread.join()
        return max(0.0, woken - published[0])

    return asyncio.run(scenario())


MEASURES: dict[str, Callable[[Backend, int], float]] = {
    "claim_wake": claim_wake, "long_poll": long_poll, "many_waiters": many_waiters,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    medians: dict[tuple[str, str], float] = {}
    with backends() as all_backends:
        for measure, run in MEASURES.items():
            for backend in all_backends:
                samples = [run(backend, r) * 1000 for r in range(args.rounds)]
                medians[backend.name, measure] = statistics.median(samples)
                print(f"{backend.name:7s} {measure:13s} median {medians[backend.name, measure]:8.2f} ms  "
                      f"max {max(samples):8.2f} ms")
    result = [f"{b}_{m}_ms={v:.3f}" for (b, m), v in medians.items()]
    result += [f"redis_vs_memory_{m}={medians['redis', m] / max(medians['memory', m], 1e-6):.2f}" for m in MEASURES]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
