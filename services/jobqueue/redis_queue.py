"""`WorkQueue` over Redis Streams: one stream per base model, one consumer group shared by its schedulers.

Key layout (`prefix` defaults to "carpool"):

    {prefix}:work:{base_model}   stream; entry fields: req (codec bytes), rid, kind, model (for redis-cli)
    {prefix}:dead:{base_model}   capped stream of entries no codec could read (poison), kept for inspection

Mapping onto the `WorkQueue` contract:

- `enqueue` = XADD; the entry id ("<ms>-<seq>") is the delivery id, so ids sort in enqueue order.
- `claim` = XREADGROUP ">" (BLOCK only when `timeout_s > 0`; BLOCK 0 would mean "forever" in Redis).
- `ack` = XACK + XDEL in one MULTI, so acknowledged entries do not pile up in the stream.
- `recover` = XPENDING + XCLAIM of every entry pending in the group (whichever consumer holds it, e.g. a
  crashed scheduler's) onto this consumer; their ids are remembered locally and the next `claim`s return
  them first, in id order, before anything new. `recover_min_idle_s > 0` limits that to entries idle for
  so long, for a standby that runs `recover` periodically next to a live scheduler.
- `depth` = entries never delivered to the group (XLEN − pending; acked entries are deleted, so the stream
  holds exactly undelivered + pending) plus recovered entries this instance has not handed out again.

Restarts: our Redis keeps nothing on disk, so after a restart both stream and group are gone. Every
group command that answers NOGROUP recreates the group (MKSTREAM, from id 0: since acked entries are
deleted, whatever the stream still holds is unacked work) and runs again. Connection errors are retried
with backoff (`default_retry`: 50 ms doubling to 2 s, 15 times, on top of the client's own retries), so
a restart costs callers a delay, not an exception; only a longer outage raises. A retried XADD whose
first attempt did land enqueues a duplicate: delivery is at-least-once anyway and the scheduler's
sequencer drops duplicates.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from redis.backoff import EqualJitterBackoff
from redis.retry import Retry

from services.jobqueue.codec import DEFAULT_CODEC, Codec, CodecError, decode_request, encode_request
from services.jobqueue.protocol import Delivery
from services.scheduler.requests import QueuedRequest

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_PREFIX = "carpool"
DEFAULT_GROUP = "scheduler"
DEAD_LETTER_MAXLEN = 10_000
PENDING_PAGE = 500
_STREAM_ID = re.compile(r"\d+-\d+")
Entry = tuple[bytes, dict[bytes, bytes] | None]


def default_retry() -> Retry:
    """Backoff for connection errors (e.g. Redis restarting): 50 ms doubling to 2 s, 12-23 s in all."""
    return Retry(EqualJitterBackoff(cap=2.0, base=0.05), retries=15)


def default_consumer_name() -> str:
    """`host:pid`: unique per scheduler process, readable in XINFO CONSUMERS."""
    return f"{socket.gethostname()}:{os.getpid()}"


def require_bytes_client(client: redis.Redis) -> None:
    """Codec blobs are bytes: a client that decodes responses to str would corrupt them."""
    if client.get_connection_kwargs().get("decode_responses"):
        raise ValueError("the Redis client must be created with decode_responses=False")


def is_nogroup(error: redis.ResponseError) -> bool:
    return str(error).startswith("NOGROUP")


def _stream_id_key(delivery_id: str) -> tuple[int, int]:
    ms, _, seq = delivery_id.partition("-")
    return int(ms), int(seq)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisWorkQueue:
    """`WorkQueue` on Redis Streams. Thread-safe: the client's pool is, and a lock guards local state."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        group: str = DEFAULT_GROUP,
        consumer: str | None = None,
        recover_min_idle_s: float = 0.0,
        retry: Retry | None = None,
        codec: Codec = DEFAULT_CODEC,
    ) -> None:
        require_bytes_client(client)
        self._client = client
        self._prefix = prefix
        self._group = group
        self.consumer = consumer or default_consumer_name()
        self._recover_min_idle_ms = int(recover_min_idle_s * 1000)
        self._retry = retry or default_retry()
        self._codec = codec
        self._lock = threading.Lock()
        self._recovered: dict[str, deque[str]] = {}
        """Per base model: ids recovered onto this consumer and not yet handed out again, in id order."""
        self._max_block_s = self._longest_safe_block()

    def stream_key(self, base_model: str) -> str:
        return f"{self._prefix}:work:{base_model}"

    def dead_letter_key(self, base_model: str) -> str:
        return f"{self._prefix}:dead:{base_model}"

    def enqueue(self, base_model: str, request: QueuedRequest) -> str:
        fields = {
            "req": encode_request(request, self._codec),
            "rid": request.request_id,
            "kind": request.kind.value,
            "model": request.model_id,
        }
        entry_id = self._call(lambda: self._client.xadd(self.stream_key(base_model), fields))
        return _text(entry_id)

    def claim(self, base_model: str, max_items: int, timeout_s: float = 0.0) -> list[Delivery]:
        if max_items <= 0:
            return []
        deliveries = self._replay(base_model, max_items)
        room = max_items - len(deliveries)
        if room > 0:
            # Never block when recovered entries are already in hand: the caller should get them now.
            wait_s = 0.0 if deliveries else min(timeout_s, self._max_block_s)
            deliveries += self._read_new(base_model, room, wait_s)
        return deliveries

    def ack(self, base_model: str, delivery_ids: Iterable[str]) -> int:
        # A malformed id was never a stream entry (and Redis would reject the whole command).
        ids = [i for i in dict.fromkeys(delivery_ids) if _STREAM_ID.fullmatch(i)]
        if not ids:
            return 0
        self._forget_recovered(base_model, ids)
        return self._call(lambda: self._ack_and_delete(self.stream_key(base_model), ids))

    def recover(self, base_model: str) -> int:
        key = self.stream_key(base_model)
        claimed = self._call(lambda: self._grouped(key, lambda: self._claim_all_pending(key)))
        with self._lock:
            queued = self._recovered.setdefault(base_model, deque())
            known = set(queued)
            fresh = [i for i in claimed if i not in known]
            merged = sorted(known.union(fresh), key=_stream_id_key)
            queued.clear()
            queued.extend(merged)
        return len(fresh)

    def depth(self, base_model: str) -> int:
        length, pending = self._length_and_pending(base_model)
        with self._lock:
            held = len(self._recovered.get(base_model, ()))
        return max(0, length - pending) + held

    def unacked(self, base_model: str) -> int:
        """Entries delivered to the group (any consumer) and not acked, less those held here for replay."""
        _, pending = self._length_and_pending(base_model)
        with self._lock:
            held = len(self._recovered.get(base_model, ()))
        return max(0, pending - held)

    def _call(self, operation: Callable[[], T]) -> T:
        """Run one Redis operation, retrying connection errors with backoff (Redis restarting)."""
        return self._retry.call_with_retry(operation, lambda error: log.warning("redis retry: %s", error))

    def _grouped(self, key: str, operation: Callable[[], T]) -> T:
        """Run a consumer-group command, creating the group first if it (or its stream) does not exist."""
        try:
            return operation()
        except redis.ResponseError as error:
            if not is_nogroup(error):
                raise
        self._create_group(key)
        return operation()

    def _create_group(self, key: str) -> None:
        try:
            self._client.xgroup_create(key, self._group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if not str(error).startswith("BUSYGROUP"):  # another scheduler created it first
                raise

    def _longest_safe_block(self) -> float:
        """A BLOCK must end before the client's socket timeout, or the read fails as a timeout instead."""
        socket_timeout = self._client.get_connection_kwargs().get("socket_timeout")
        return float("inf") if not socket_timeout else max(0.001, float(socket_timeout) * 0.8)

    def _read_new(self, base_model: str, count: int, wait_s: float) -> list[Delivery]:
        key = self.stream_key(base_model)
        deadline = time.monotonic() + wait_s

        def read() -> Any:
            # Recomputed per attempt so a retried read does not wait longer than the caller asked.
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            block = max(1, remaining_ms) if wait_s > 0 else None
            return self._client.xreadgroup(self._group, self.consumer, {key: ">"}, count=count, block=block)

        response = self._call(lambda: self._grouped(key, read))
        return self._to_deliveries(base_model, _entries_of(response))

    def _replay(self, base_model: str, max_items: int) -> list[Delivery]:
        """Hand out recovered entries first: XCLAIM returns their fields (skipping any acked meanwhile)."""
        with self._lock:
            queued = self._recovered.get(base_model)
            ids = [queued.popleft() for _ in range(min(max_items, len(queued)))] if queued else []
        if not ids:
            return []
        key = self.stream_key(base_model)
        entries = self._call(
            lambda: self._grouped(key, lambda: self._client.xclaim(key, self._group, self.consumer, 0, ids))
        )
        return self._to_deliveries(base_model, sorted(entries, key=lambda e: _stream_id_key(_text(e[0]))))

    def _claim_all_pending(self, key: str) -> list[str]:
        """Move every pending entry of the group (idle long enough) onto this consumer, page by page."""
        claimed: list[str] = []
        start = "-"
        while True:
            idle = self._recover_min_idle_ms or None
            page = self._client.xpending_range(key, self._group, start, "+", PENDING_PAGE, idle=idle)
            if not page:
                return claimed
            ids = [_text(p["message_id"]) for p in page]
            got = self._client.xclaim(key, self._group, self.consumer, self._recover_min_idle_ms, ids, justid=True)
            claimed += sorted((_text(i) for i in got), key=_stream_id_key)
            start = f"({ids[-1]}"

    def _ack_and_delete(self, key: str, ids: list[str]) -> int:
        pipe = self._client.pipeline(transaction=True)
        pipe.xack(key, self._group, *ids)
        pipe.xdel(key, *ids)
        acked, _ = pipe.execute(raise_on_error=False)
        if isinstance(acked, redis.ResponseError):
            if is_nogroup(acked):
                return 0  # no group, nothing was pending (the stream vanished in a restart)
            raise acked
        return int(acked)

    def _length_and_pending(self, base_model: str) -> tuple[int, int]:
        key = self.stream_key(base_model)

        def read() -> tuple[int, int]:
            pipe = self._client.pipeline(transaction=False)
            pipe.xlen(key)
            pipe.xpending(key, self._group)
            length, summary = pipe.execute(raise_on_error=False)
            if isinstance(length, Exception):
                raise length
            if isinstance(summary, redis.ResponseError) and is_nogroup(summary):
                return int(length), 0  # nothing claimed yet: every entry is waiting
            if isinstance(summary, Exception):
                raise summary
            return int(length), int(summary["pending"])

        return self._call(read)

    def _forget_recovered(self, base_model: str, ids: list[str]) -> None:
        with self._lock:
            queued = self._recovered.get(base_model)
            if queued:
                gone = set(ids)
                self._recovered[base_model] = deque(i for i in queued if i not in gone)

    def _to_deliveries(self, base_model: str, entries: list[Entry]) -> list[Delivery]:
        deliveries: list[Delivery] = []
        for raw_id, fields in entries:
            delivery_id = _text(raw_id)
            request = self._decode_or_bury(base_model, delivery_id, fields)
            if request is not None:
                deliveries.append(Delivery(delivery_id=delivery_id, request=request))
        return deliveries

    def _decode_or_bury(
        self, base_model: str, delivery_id: str, fields: dict[bytes, bytes] | None
    ) -> QueuedRequest | None:
        """The entry's request; an entry deleted under us is acked, a poison one moved to the dead stream.

        Returning a poison entry's error to its waiter is not possible (its request id may be unreadable
        too), and leaving it pending would hand it to every `recover` forever.
        """
        if fields:
            try:
                return decode_request(fields.get(b"req", b""), self._codec)
            except CodecError as error:
                log.error("poison queue entry %s of %s moved aside: %s", delivery_id, base_model, error)
                dead = {**fields, b"id": delivery_id.encode(), b"error": str(error).encode()}
                dead_key = self.dead_letter_key(base_model)
                self._call(lambda: self._client.xadd(dead_key, dead, maxlen=DEAD_LETTER_MAXLEN))
        self.ack(base_model, [delivery_id])
        return None


def _entries_of(response: Any) -> list[Entry]:
    """XREADGROUP answers `[[key, entries]]` (RESP2), `{key: [entries]}` (RESP3), or nothing on timeout."""
    if not response:
        return []
    if isinstance(response, dict):
        return [entry for streams in response.values() for entry in streams[0]]
    return [entry for _, stream_entries in response for entry in stream_entries]
