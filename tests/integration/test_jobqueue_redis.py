"""Redis-only behaviour of the queue, result store and notifier: standby takeover, poison entries,
killed connections and a real server restart.

Most tests use the shared Redis (`$CARPOOL_TEST_REDIS_URL`) under a random key prefix. Connections are
killed one by one by id (never `CLIENT KILL TYPE pubsub` alone: that would cut other suites' subscriptions
on the shared server). The restart test runs its own throwaway `redis-server` on a free port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.jobqueue import ResultStatus, StoredResult
from services.jobqueue.codec import CodecError, decode_request, encode, encode_request
from services.jobqueue.redis_queue import RedisWorkQueue
from services.jobqueue.redis_results import RedisNotifier, RedisResultStore
from services.scheduler import ModelId, QueuedRequest, RequestId, RequestKind, TenantId
from tests.required import require_binary, require_redis

REDIS_URL = os.environ.get("CARPOOL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BASE = "base-model"


def request(i: int) -> QueuedRequest:
    return QueuedRequest(RequestId(f"r{i}"), TenantId("t"), ModelId("m"), RequestKind.FORWARD, i, 3)


def ids(deliveries: list) -> list[str]:
    return [d.request.request_id for d in deliveries]


@pytest.fixture
def prefix() -> str:
    return f"carpool-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client(prefix: str) -> Iterator[redis.Redis]:
    require_redis(REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2, client_name=prefix)
    yield client
    keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
    if keys:
        client.delete(*keys)
    client.close()


def kill_connections(admin: redis.Redis, name: str, kind: str = "normal") -> int:
    """Kill the connections named `name` of one kind, one by one: a restart as seen by those clients."""
    killed = 0
    for info in admin.client_list(_type=kind):
        if info.get("name") == name:
            killed += admin.client_kill_filter(_id=info["id"], _type=kind)
    return killed


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_standby_scheduler_takes_over_the_unacked_entries_of_a_dead_one(client: redis.Redis, prefix: str) -> None:
    first = RedisWorkQueue(client, prefix=prefix, consumer="sched-a")
    standby = RedisWorkQueue(client, prefix=prefix, consumer="sched-b")
    for i in range(5):
        first.enqueue(BASE, request(i))
    claimed = first.claim(BASE, max_items=3)
    first.ack(BASE, [claimed[1].delivery_id])
    # sched-a dies here with r0 and r2 pending.
    assert standby.recover(BASE) == 2
    owners = client.xpending(first.stream_key(BASE), "scheduler")["consumers"]
    assert owners == [{"name": b"sched-b", "pending": 2}]
    got = standby.claim(BASE, max_items=10)
    assert ids(got) == ["r0", "r2", "r3", "r4"]  # recovered entries first, then new ones
    assert [d.delivery_id for d in got[:2]] == [claimed[0].delivery_id, claimed[2].delivery_id]
    assert standby.ack(BASE, [d.delivery_id for d in got]) == 4
    assert client.xpending(first.stream_key(BASE), "scheduler")["pending"] == 0


def test_a_periodic_recover_only_takes_entries_idle_long_enough(client: redis.Redis, prefix: str) -> None:
    live = RedisWorkQueue(client, prefix=prefix, consumer="live")
    standby = RedisWorkQueue(client, prefix=prefix, consumer="standby", recover_min_idle_s=1.0)
    live.enqueue(BASE, request(1))
    live.claim(BASE, max_items=1)
    assert standby.recover(BASE) == 0  # the live scheduler is still working on it
    assert wait_until(lambda: standby.recover(BASE) == 1, timeout_s=30)  # once idle long enough, taken over
    assert ids(standby.claim(BASE, max_items=1)) == ["r1"]


def test_acked_entries_leave_the_stream_and_entries_hold_only_codec_bytes_and_ids(
    client: redis.Redis, prefix: str
) -> None:
    queue = RedisWorkQueue(client, prefix=prefix)
    queue.enqueue(BASE, request(1))
    queue.enqueue(BASE, request(2))
    key = queue.stream_key(BASE)
    [(_, fields)] = client.xrange(key, count=1)
    assert set(fields) == {b"req", b"rid", b"kind", b"model"}
    assert decode_request(fields[b"req"]).request_id == "r1" and fields[b"rid"] == b"r1"
    claimed = queue.claim(BASE, max_items=2)
    assert client.xlen(key) == 2
    queue.ack(BASE, [d.delivery_id for d in claimed])
    assert client.xlen(key) == 0
    assert queue.depth(BASE) == 0 and queue.unacked(BASE) == 0


def test_the_queue_recreates_its_group_when_the_stream_vanishes(client: redis.Redis, prefix: str) -> None:
    queue = RedisWorkQueue(client, prefix=prefix)
    queue.enqueue(BASE, request(1))
    assert ids(queue.claim(BASE, max_items=1)) == ["r1"]
    client.delete(queue.stream_key(BASE))  # what a restart of our diskless Redis does
    assert queue.recover(BASE) == 0
    assert queue.claim(BASE, max_items=1) == []
    queue.enqueue(BASE, request(2))
    client.delete(queue.stream_key(BASE))
    queue.enqueue(BASE, request(3))  # stream exists again, group does not
    assert queue.depth(BASE) == 1
    assert ids(queue.claim(BASE, max_items=5, timeout_s=0.5)) == ["r3"]


def test_poison_entries_are_moved_aside_and_do_not_block_the_stream(client: redis.Redis, prefix: str) -> None:
    queue = RedisWorkQueue(client, prefix=prefix)
    key = queue.stream_key(BASE)
    client.xadd(key, {"req": b"garbage", "rid": "bad-1"})
    client.xadd(key, {"req": encode("not a request"), "rid": "bad-2"})
    queue.enqueue(BASE, request(3))
    assert ids(queue.claim(BASE, max_items=10)) == ["r3"]
    dead = client.xrange(queue.dead_letter_key(BASE))
    assert [fields[b"rid"] for _, fields in dead] == [b"bad-1", b"bad-2"]
    assert all(b"error" in fields for _, fields in dead)
    assert queue.unacked(BASE) == 1 and client.xlen(key) == 1


def test_a_block_never_outlasts_the_client_socket_timeout(prefix: str, client: redis.Redis,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    # A generous socket timeout: the cap leaves 20 % of it (0.6 s) for the reply to arrive on a busy box.
    impatient = redis.Redis.from_url(REDIS_URL, socket_timeout=3.0)
    queue = RedisWorkQueue(impatient, prefix=prefix)
    # A server-side block longer than the socket timeout ends in redis.TimeoutError on the client, which
    # the queue then retries as if Redis were down; capped below it, the read simply returns empty.
    with caplog.at_level(logging.WARNING, logger="services.jobqueue"):
        assert queue.claim(BASE, max_items=1, timeout_s=8.0) == []
    assert not [r for r in caplog.records if "redis retry" in r.getMessage()], caplog.text
    impatient.close()


def test_clients_that_decode_responses_are_refused() -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        RedisWorkQueue(redis.Redis.from_url(REDIS_URL, decode_responses=True))
    with pytest.raises(ValueError, match="decode_responses"):
        RedisResultStore(redis.Redis.from_url(REDIS_URL, decode_responses=True))


def test_blobs_of_another_codec_are_refused_and_unreadable_results_become_errors(
    client: redis.Redis, prefix: str
) -> None:
    with pytest.raises(CodecError, match="tagged"):
        decode_request(b"msgpack1:\x81")
    with pytest.raises(CodecError, match="expected QueuedRequest"):
        decode_request(encode({"not": "a request"}))
    assert decode_request(encode_request(request(5))).seq_id == 5
    store = RedisResultStore(client, prefix=prefix)
    client.set(store.result_key(RequestId("corrupt")), b"pickle5:\x00junk")
    result = asyncio.run(store.get(RequestId("corrupt")))
    assert result is not None and result.status is ResultStatus.ERROR
    store.close()


def hold_back_flushes(store: RedisResultStore) -> None:
    """Make `answered` believe a flush is queued: the keys wait for the test's own `flush_answered`."""
    with store._answered_lock:
        store._flush_queued = True


def test_answered_results_get_their_ttl_cut_in_one_batch_never_lengthened(client: redis.Redis, prefix: str) -> None:
    store = RedisResultStore(client, prefix=prefix)
    ok = StoredResult(ResultStatus.OK, b"proto-bytes")
    for name in ("answered", "unanswered", "short", "dropped"):
        store.put(RequestId(name), ok, ttl_s=3600 if name != "short" else 30)
    hold_back_flushes(store)  # so that every answer below is in one batch, flushed here
    store.answered(RequestId("answered"), 120)
    store.answered(RequestId("short"), 120)  # PEXPIRE ... LT: 30 s stays 30 s
    store.answered(RequestId("dropped"), 0)
    store.answered(RequestId("never-stored"), 120)
    assert store.flush_answered() == 4 and store.flush_answered() == 0
    ttl = {name: client.pttl(store.result_key(RequestId(name))) for name in ("answered", "unanswered", "short")}
    assert 110_000 < ttl["answered"] <= 120_000
    assert ttl["unanswered"] > 3_590_000
    assert 0 < ttl["short"] <= 30_000
    assert not client.exists(store.result_key(RequestId("dropped")), store.result_key(RequestId("never-stored")))
    hold_back_flushes(store)
    store.answered(RequestId("answered"), 600)  # answered again: its grace is not extended
    assert store.flush_answered() == 1 and client.pttl(store.result_key(RequestId("answered"))) <= 120_000
    store.close()


def test_an_answer_is_flushed_off_the_caller_without_being_asked(client: redis.Redis, prefix: str) -> None:
    """`answered` only notes the key (it is called on the gateway's event loop); the store's own threads
    send the cut, here with nothing else going on."""
    store = RedisResultStore(client, prefix=prefix)
    store.put(RequestId("a"), StoredResult(ResultStatus.OK, 1), ttl_s=3600)
    store.answered(RequestId("a"), 0.05)
    deadline = time.monotonic() + 10  # a bound for a hang, not a measurement
    while asyncio.run(store.get(RequestId("a"))) is not None:
        assert time.monotonic() < deadline, "the answered result never expired"
        time.sleep(0.01)
    store.close()
    store.answered(RequestId("b"), 1)  # closed: noted, never sent, and no error


def test_queue_operations_survive_their_connections_being_killed(client: redis.Redis, prefix: str) -> None:
    queue = RedisWorkQueue(client, prefix=prefix)
    queue.enqueue(BASE, request(1))
    admin = redis.Redis.from_url(REDIS_URL)  # a separate client: Redis never kills the caller (SKIPME)
    assert kill_connections(admin, prefix) >= 1
    queue.enqueue(BASE, request(2))
    assert ids(queue.claim(BASE, max_items=5)) == ["r1", "r2"]
    admin.close()


def test_the_notifier_survives_its_subscription_being_killed(client: redis.Redis, prefix: str) -> None:
    admin = redis.Redis.from_url(REDIS_URL)
    subscriber = redis.Redis.from_url(REDIS_URL, client_name=f"{prefix}-sub")
    notifier = RedisNotifier(client, prefix=prefix, subscriber=subscriber, resubscribe_grace_s=0.1)
    assert notifier.start()

    async def scenario() -> tuple[bool, bool]:
        parked = asyncio.create_task(notifier.wait(RequestId("lost-during-restart"), timeout_s=5))
        assert await asyncio.to_thread(wait_until, lambda: notifier.waiting() == 1)
        assert await asyncio.to_thread(kill_connections, admin, f"{prefix}-sub", "pubsub") == 1
        woken_by_reconnect = await parked  # its publish may have been lost: it must re-check
        assert await asyncio.to_thread(wait_until, lambda: notifier.is_subscribed and notifier.subscriptions == 2)
        await asyncio.sleep(0.15)  # past the grace period: only a real publish may wake the next waiter
        later = asyncio.create_task(notifier.wait(RequestId("after"), timeout_s=5))
        assert await asyncio.to_thread(wait_until, lambda: notifier.waiting() == 1)
        assert not later.done()
        await asyncio.to_thread(notifier.publish, RequestId("after"))
        return woken_by_reconnect, await later

    assert asyncio.run(scenario()) == (True, True)
    notifier.close()
    subscriber.close()
    admin.close()


def test_a_wait_any_marked_before_a_resubscription_looks_again(client: redis.Redis, prefix: str) -> None:
    """Publishes made while the subscription was down are lost to this process: a batched poll whose mark
    predates the resubscription returns at once, however long after the grace period it starts waiting."""
    admin = redis.Redis.from_url(REDIS_URL)
    subscriber = redis.Redis.from_url(REDIS_URL, client_name=f"{prefix}-sub")
    notifier = RedisNotifier(client, prefix=prefix, subscriber=subscriber, resubscribe_grace_s=0.0)
    assert notifier.start()
    mark = notifier.mark()
    assert kill_connections(admin, f"{prefix}-sub", "pubsub") == 1
    assert wait_until(lambda: notifier.is_subscribed and notifier.subscriptions == 2)

    async def waits() -> tuple[bool, bool]:
        return (await notifier.wait_any([RequestId("lost")], 0, after=mark),
                await notifier.wait_any([RequestId("lost")], 0, after=notifier.mark()))

    assert asyncio.run(waits()) == (True, False)
    notifier.close()
    subscriber.close()
    admin.close()


# --- a real restart, on a private server -------------------------------------------------------------


class PrivateRedis:
    """A throwaway diskless redis-server on a free port that a test may stop and start again."""

    def __init__(self, workdir: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        assert wait_until(lambda: _answers(probe)), "private redis-server did not start"
        probe.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    require_binary("redis-server", "redis-server")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_everything_recovers_from_a_real_redis_restart(private_redis: PrivateRedis) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_timeout=2)
    queue = RedisWorkQueue(client, consumer="sched")
    store = RedisResultStore(client)
    notifier = RedisNotifier(private_redis.url, resubscribe_grace_s=0.1)
    assert notifier.start()
    queue.enqueue(BASE, request(1))
    queue.claim(BASE, max_items=1)

    def restart_with_an_enqueue_during_the_outage() -> str:
        private_redis.stop()
        threading.Timer(0.3, private_redis.start).start()
        return queue.enqueue(BASE, request(2))  # retried with backoff until the server is back

    async def scenario() -> tuple[bool, bool, StoredResult | None]:
        parked = asyncio.create_task(notifier.wait(RequestId("r1"), timeout_s=10))
        assert await asyncio.to_thread(wait_until, lambda: notifier.waiting() == 1)
        await asyncio.to_thread(restart_with_an_enqueue_during_the_outage)
        woken_by_reconnect = await parked
        assert await asyncio.to_thread(wait_until, lambda: notifier.subscriptions >= 2 and notifier.is_subscribed)
        await asyncio.sleep(0.15)  # past the grace period: only a real publish may wake the next waiter
        later = asyncio.create_task(notifier.wait(RequestId("r2"), timeout_s=5))
        assert await asyncio.to_thread(wait_until, lambda: notifier.waiting() == 1)
        store.put(RequestId("r2"), StoredResult(ResultStatus.OK, "fresh"))
        notifier.publish(RequestId("r2"))
        return woken_by_reconnect, await later, await store.get(RequestId("r2"))

    assert asyncio.run(scenario()) == (True, True, StoredResult(ResultStatus.OK, "fresh"))
    # The diskless restart lost r1 (pending) and the stream; the group came back for r2.
    assert ids(queue.claim(BASE, max_items=5, timeout_s=0.5)) == ["r2"]
    notifier.close()
    store.close()
    client.close()
