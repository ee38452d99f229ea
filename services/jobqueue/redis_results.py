"""`ResultStore` (keys with a TTL) and `Notifier` (one pub/sub subscription per process) over Redis.

Key layout (`prefix` defaults to "carpool"):

    {prefix}:result:{request_id}   string, codec bytes of a `StoredResult`, SET ... PX ttl; once answered
                                   PEXPIRE ... LT keep (Redis >= 7: shortens, never lengthens)
    {prefix}:done                  pub/sub channel; message = the request id whose result was just stored

Async side: both classes use the thread-safe sync client and hop off the event loop for I/O, instead of
`redis.asyncio`, whose connections belong to the loop that opened them. That keeps one client (one
retry policy, one pool) valid for the scheduler's worker thread, the gateway's loop and tests that run
several loops. `ResultStore.get` runs in a small private thread pool, and so do the TTL cuts of answered
results: `answered` only notes the key, and one pipelined flush sends every key noted meanwhile (no round
trip on the event loop, and under load one per batch rather than per answer). The notifier's subscription
is one daemon thread reading one connection, resolving each waiter's asyncio future on the waiter's own
loop (`call_soon_threadsafe`), exactly like the in-process notifier. No request ever polls Redis.

Lost wake-ups. A publish can go unseen by a gateway only while its subscription is down (Redis restart,
killed connection, network cut). Whenever the subscription is (re)established, every parked waiter is
woken to re-check the result store, and for `resubscribe_grace_s` after a *re*subscription any new
`wait` returns True at once (its caller's `get` may have run just before the outage ended); a `wait_any`
whose mark was taken before a (re)subscription returns True at once whenever it starts, and
`changed_since` answers True for such a mark, and for any mark while the subscription is down. Results
are stored before they are published, so get → wait → get never misses a result, only costs a re-check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.backoff import EqualJitterBackoff
from redis.retry import Retry

from services.domain.training import WorkError
from services.jobqueue.codec import DEFAULT_CODEC, Codec, CodecError, decode_result, encode_result
from services.jobqueue.memory import Announcements, resolve_all_threadsafe
from services.jobqueue.protocol import DEFAULT_RESULT_TTL_S, ResultStatus, StoredResult
from services.jobqueue.redis_queue import DEFAULT_PREFIX, default_retry, require_bytes_client
from services.scheduler.requests import RequestId

log = logging.getLogger(__name__)

LISTEN_POLL_S = 0.25
"""How often the listener thread looks up from its socket to notice `close()`."""


class RedisResultStore:
    """`ResultStore` as one Redis key per result, expiring with its TTL (Redis purges, not us)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        retry: Retry | None = None,
        codec: Codec = DEFAULT_CODEC,
        io_threads: int = 8,
    ) -> None:
        require_bytes_client(client)
        self._client = client
        self._prefix = prefix
        self._retry = retry or default_retry()
        self._codec = codec
        # Gets are sub-millisecond; a few threads absorb thousands of concurrent long-polls.
        self._executor = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="carpool-results")
        self._answered_lock = threading.Lock()
        self._answered: dict[str, int] = {}
        """Keys answered since the last flush → milliseconds to keep them."""
        self._flush_queued = False

    def result_key(self, request_id: RequestId) -> str:
        return f"{self._prefix}:result:{request_id}"

    def put(self, request_id: RequestId, result: StoredResult, ttl_s: float = DEFAULT_RESULT_TTL_S) -> None:
        key = self.result_key(request_id)
        if ttl_s <= 0:  # already expired: same as never stored
            self.delete(request_id)
            return
        blob = encode_result(result, self._codec)
        ttl_ms = max(1, round(ttl_s * 1000))
        self._call(lambda: self._client.set(key, blob, px=ttl_ms))

    def get_nowait(self, request_id: RequestId) -> StoredResult | None:
        """Synchronous `get`, for callers outside an event loop. Blocks on Redis."""
        blob = self._call(lambda: self._client.get(self.result_key(request_id)))
        if blob is None:
            return None
        try:
            return decode_result(blob, self._codec)
        except CodecError as error:
            # The client must learn that its request ended; an unreadable blob will not become readable.
            log.error("unreadable result for %s: %s", request_id, error)
            return StoredResult(ResultStatus.ERROR, WorkError(f"result unreadable: {error}", "server"))

    async def get(self, request_id: RequestId) -> StoredResult | None:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.get_nowait, request_id)

    def delete(self, request_id: RequestId) -> None:
        self._call(lambda: self._client.delete(self.result_key(request_id)))

    def answered(self, request_id: RequestId, keep_s: float) -> None:
        keep_ms = max(0, round(keep_s * 1000))
        with self._answered_lock:
            key = self.result_key(request_id)
            self._answered[key] = min(keep_ms, self._answered.get(key, keep_ms))
            if self._flush_queued:
                return  # the queued flush has not taken the batch yet: it sends this key too
            self._flush_queued = True
        try:
            self._executor.submit(self.flush_answered)
        except RuntimeError:  # closed: the keys keep their full TTL, which is only longer
            with self._answered_lock:
                self._flush_queued = False

    def flush_answered(self) -> int:
        """Cut the TTLs of the keys answered since the last flush, in one round trip; returns how many.
        A failure leaves them their full TTL (memory, not correctness)."""
        with self._answered_lock:
            batch, self._answered, self._flush_queued = self._answered, {}, False
        if not batch:
            return 0

        def send() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, keep_ms in batch.items():
                if keep_ms > 0:
                    pipe.pexpire(key, keep_ms, lt=True)  # LT: a key whose TTL is already shorter keeps it
                else:
                    pipe.delete(key)
            pipe.execute()

        try:
            self._call(send)  # a retry sends the batch again: LT keeps the earlier, shorter cut
        except redis.RedisError as error:
            log.warning("answered results keep their full TTL (%d keys): %s", len(batch), error)
        return len(batch)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _call(self, operation: Any) -> Any:
        return self._retry.call_with_retry(operation, lambda error: log.warning("redis retry: %s", error))


class RedisNotifier:
    """`Notifier` over Redis pub/sub: PUBLISH from any thread; one subscription wakes this process's waiters.

    Create one per gateway process (after any fork: the listener thread does not survive one) and call
    `start()` at start-up, which waits for the subscription. Otherwise the first `wait` starts it, and
    waits parked before the subscription is confirmed are woken to re-check (they may have missed one).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        prefix: str = DEFAULT_PREFIX,
        channel: str | None = None,
        subscriber: redis.Redis | None = None,
        retention_s: float = 60.0,
        max_retained: int = 100_000,
        resubscribe_grace_s: float = 1.0,
        ping_interval_s: float = 10.0,
        retry: Retry | None = None,
    ) -> None:
        self._owned_client = redis.Redis.from_url(client) if isinstance(client, str) else None
        self._client = self._owned_client or client
        self._subscriber = subscriber or self._client
        self.channel = channel or f"{prefix}:done"
        self._grace_s = resubscribe_grace_s
        self._ping_interval_s = ping_interval_s
        self._retry = retry or default_retry()
        self._backoff = EqualJitterBackoff(cap=2.0, base=0.05)
        self._announced = Announcements(retention_s, max_retained)
        self._lock = self._announced.lock  # publishes, (re)subscriptions and the waits that check them
        self._subscribed = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscribed_at = 0.0
        self.subscriptions = 0
        """How many times the subscription was (re)established; > 1 means it survived a reconnect."""

    def publish(self, request_id: RequestId) -> None:
        self._retry.call_with_retry(
            lambda: self._client.publish(self.channel, request_id),
            lambda error: log.warning("redis retry (publish): %s", error),
        )

    def publish_many(self, request_ids: Sequence[RequestId]) -> None:
        if not request_ids:
            return

        def send() -> None:
            pipe = self._client.pipeline(transaction=False)  # one round trip; order is kept
            for request_id in request_ids:
                pipe.publish(self.channel, request_id)
            pipe.execute()

        # A retry re-sends every id: a duplicate announcement only makes a waiter look again.
        self._retry.call_with_retry(send, lambda error: log.warning("redis retry (publish): %s", error))

    async def wait(self, request_id: RequestId, timeout_s: float) -> bool:
        self._ensure_listening()
        return await self._announced.wait([request_id], timeout_s,
                                          lambda seen: seen.contains(request_id) or self._just_resubscribed())

    def mark(self) -> int:
        return self._announced.mark()

    async def wait_any(self, request_ids: Collection[RequestId], timeout_s: float, *, after: int) -> bool:
        self._ensure_listening()
        return await self._announced.wait(
            request_ids, timeout_s, lambda seen: seen.any_since(request_ids, after) or self._just_resubscribed())

    def changed_since(self, request_ids: Collection[RequestId], mark: int) -> bool:
        # Not subscribed now (never yet, or lost): publishes go unseen, so nothing can be vouched for.
        # Just resubscribed: `wait_any` answers at once then, and a False here must mean it would park.
        return self._announced.seen(lambda seen: not self._subscribed.is_set() or self._just_resubscribed()
                                    or seen.any_since(request_ids, mark))

    def start(self, timeout_s: float = 5.0) -> bool:
        """Start the subscription thread; True once subscribed (False if Redis did not answer in time)."""
        self._ensure_listening()
        return self._subscribed.wait(timeout_s)

    def close(self) -> None:
        """Stop listening (waiters left parked time out as usual)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=LISTEN_POLL_S * 4)
        if self._owned_client is not None:
            self._owned_client.close()

    def waiting(self) -> int:
        """Waiters currently parked (for metrics)."""
        return self._announced.waiters.count()

    @property
    def is_subscribed(self) -> bool:
        return self._subscribed.is_set()

    def _ensure_listening(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._listen, name="carpool-notifier", daemon=True)
                self._thread.start()

    def _listen(self) -> None:
        """The subscription thread: listen until closed, reconnecting with backoff whenever Redis drops us."""
        failures = 0
        while not self._stopping.is_set():
            subscriptions_before = self.subscriptions
            try:
                self._listen_on_one_connection()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                self._subscribed.clear()
                # A connection that got subscribed resets the backoff: this failure starts a new outage.
                failures = 1 if self.subscriptions > subscriptions_before else failures + 1
                delay = self._backoff.compute(failures)
                log.warning("notifier subscription lost (%s); retrying in %.2fs", error, delay)
                self._stopping.wait(delay)
            except Exception:  # a bug must not silently end wake-ups for the whole process
                self._subscribed.clear()
                log.exception("notifier listener failed; restarting it")
                self._stopping.wait(1.0)

    def _listen_on_one_connection(self) -> None:
        pubsub = self._subscriber.pubsub()
        try:
            pubsub.subscribe(self.channel)
            last_ping = time.monotonic()
            while not self._stopping.is_set():
                message = pubsub.get_message(timeout=LISTEN_POLL_S)
                if message is not None:
                    self._handle(message)
                # A PING makes a silently dead connection (no RST after a host loss) fail and reconnect.
                if time.monotonic() - last_ping >= self._ping_interval_s:
                    pubsub.ping()
                    last_ping = time.monotonic()
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()

    def _handle(self, message: dict[str, Any]) -> None:
        # redis-py re-subscribes by itself after a dropped connection; either way a confirmation arrives.
        if message["type"] == "subscribe":
            self._on_subscribed()
        elif message["type"] == "message":
            data = message["data"]
            self._on_published(RequestId(data.decode() if isinstance(data, bytes) else str(data)))

    def _on_subscribed(self) -> None:
        """Wake every parked waiter: publishes made while we were not subscribed were lost to us."""
        with self._lock:
            self.subscriptions += 1
            self._subscribed_at = time.monotonic()
            self._announced.published.forget_all()  # a mark taken before the outage must look again, always
            parked = self._announced.waiters.take_all()
        self._subscribed.set()
        resolve_all_threadsafe(parked)
        if self.subscriptions > 1:
            log.info("notifier resubscribed to %s; woke %d waiters to re-check", self.channel, len(parked))

    def _on_published(self, request_id: RequestId) -> None:
        self._announced.add([request_id])

    def _just_resubscribed(self) -> bool:
        return self.subscriptions > 1 and time.monotonic() - self._subscribed_at < self._grace_s
