"""Replica calls over Redis: `RedisReplicaLink` (the scheduler's side) and `RedisReplicaEndpoint` (a replica's).

Ray Serve hosts the replicas but its router cannot address one replica, and adapter placement needs
exactly that. So each replica registers itself and pulls its own commands (keys: `ClusterKeys` below):

    pool ── XADD envelope ──▶ {p}:replica:{base}:{id} ──XREAD── replica ── executes ──┐
    pool ◀── GET ─────────── {p}:reply:{call id}        ◀─── SET reply ─────────────────┤
    pool ◀── BLPOP (wake) ── {p}:reply:{call id}:wake   ◀─── RPUSH ─────────────────────┘

The reply itself is a plain key, read with GET after every wake-up or poll, never popped: a BLPOP whose
answer is lost with a dropped connection (Redis restarting) then costs one poll interval, not the reply.

Liveness is a heartbeat key refreshed every third of its TTL. A replica counts as gone only once its
heartbeat has been missing for a further grace period (default: one TTL), so a Redis restart that drops
or delays the keys for a moment does not trigger a fail-over. While waiting for a reply the pool checks
liveness once per poll; a reply from a replica that dies meanwhile never comes, and `ReplicaGone` is
raised instead. Connection errors are retried with backoff (Redis restarting costs a delay); a retried
XADD that had landed delivers an envelope twice, which the endpoint drops by call id.

The key layout of cluster mode, for one base model (`ClusterKeys`, used by every cluster module):

    {prefix}:replicas:{base}                 hash   replica id → JSON `ReplicaInfo` (membership)
    {prefix}:replica-alive:{base}:{replica}  string heartbeat; expires `heartbeat_ttl_s` after the last beat
    {prefix}:replica:{base}:{replica}        stream commands for that one replica (it alone reads it)
    {prefix}:reply:{call id}                 string the replica's answer to one call
    {prefix}:reply:{call id}:wake            list   pushed with the answer; the caller's BLPOP wakes on it
    {prefix}:fence:{base}                    string counter, INCR'd by every scheduler that takes the lease
    {prefix}:lease:{base}                    string holder of the scheduler lease (SET NX PX, renewed)
    {prefix}:placement:{base}                hash   adapter id → replica id
    {prefix}:snapshot:{base}                 hash   adapter id → path of its newest complete snapshot
    {prefix}:log:{base}:{adapter}            stream training requests dispatched since that snapshot
    {prefix}:model:{base}                    string JSON `BaseModelInfo` + limits, published by workers
    {prefix}:stats:{base}                    string JSON `RuntimeStats` of the active scheduler

The work queue, results and the notifier keep their own keys (`services.jobqueue`), under the same prefix.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis
from redis.retry import Retry

from services.jobqueue.codec import CodecError, decode, encode

# `_entries_of` reads XREAD and XREADGROUP answers alike (RESP2 and RESP3): one parser for both.
from services.jobqueue.redis_queue import DEFAULT_PREFIX, _entries_of, default_retry, require_bytes_client
from services.runtime.replica_protocol import (
    Envelope,
    Fenced,
    PublishedModel,
    ReplicaCall,
    ReplicaCallError,
    ReplicaGone,
    ReplicaInfo,
    Reply,
)

T = TypeVar("T")
log = logging.getLogger(__name__)

INBOX_MAXLEN = 10_000
REPLY_TTL_S = 3600
SEEN_CALLS = 4096
SOCKET_TIMEOUT_S = 30.0
"""Longer than any blocking read of cluster traffic (≤ 1 s), so a BLOCK never reads as a dead socket."""


def connect(url: str) -> redis.Redis:
    """A bytes client for cluster traffic; keepalive and health checks notice a dead peer early."""
    return redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5,
                                socket_keepalive=True, health_check_interval=30)


@dataclass(frozen=True)
class ClusterKeys:
    """Key names of one base model's cluster state."""

    base_model: str
    prefix: str = DEFAULT_PREFIX

    @property
    def replicas(self) -> str:
        return f"{self.prefix}:replicas:{self.base_model}"

    def alive(self, replica_id: str) -> str:
        return f"{self.prefix}:replica-alive:{self.base_model}:{replica_id}"

    def inbox(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{self.base_model}:{replica_id}"

    def reply(self, call_id: str) -> str:
        return f"{self.prefix}:reply:{call_id}"

    @property
    def fence(self) -> str:
        return f"{self.prefix}:fence:{self.base_model}"

    @property
    def lease(self) -> str:
        return f"{self.prefix}:lease:{self.base_model}"

    @property
    def placement(self) -> str:
        return f"{self.prefix}:placement:{self.base_model}"

    @property
    def snapshots(self) -> str:
        return f"{self.prefix}:snapshot:{self.base_model}"

    def log(self, adapter_id: str) -> str:
        return f"{self.prefix}:log:{self.base_model}:{adapter_id}"

    @property
    def model_info(self) -> str:
        return f"{self.prefix}:model:{self.base_model}"

    @property
    def stats(self) -> str:
        return f"{self.prefix}:stats:{self.base_model}"


class _Redis:
    """A client plus the retry policy every call goes through."""

    def __init__(self, client: redis.Redis, retry: Retry | None) -> None:
        require_bytes_client(client)
        self.client = client
        self._retry = retry or default_retry()

    def call(self, operation: Callable[[], T]) -> T:
        return self._retry.call_with_retry(operation, lambda error: log.warning("redis retry: %s", error))


class RedisReplicaLink:
    """`ReplicaLink` over Redis for one base model. Thread-safe (parallel sub-passes share it)."""

    def __init__(self, client: redis.Redis, keys: ClusterKeys, *, heartbeat_ttl_s: float = 5.0,
                 grace_s: float | None = None, poll_s: float = 0.5, call_timeout_s: float = 1800.0,
                 retry: Retry | None = None) -> None:
        self._redis = _Redis(client, retry)
        self.keys = keys
        self._grace_s = heartbeat_ttl_s if grace_s is None else grace_s
        self._poll_s = poll_s
        self._call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._missing_since: dict[str, float] = {}

    def live_replicas(self) -> list[str]:
        registered = [as_text(k) for k in self._redis.call(lambda: self._redis.client.hkeys(self.keys.replicas))]
        return sorted(r for r in registered if not self._gone(r))

    def alive(self, replica_id: str) -> bool:
        return not self._gone(replica_id)

    def call(self, replica_id: str, call: ReplicaCall, fence: int) -> object:
        if self._gone(replica_id):
            raise ReplicaGone(replica_id, "no heartbeat")
        call_id = uuid.uuid4().hex
        envelope = Envelope(call_id, self.keys.reply(call_id), fence, call)
        blob = encode(envelope)
        inbox = self.keys.inbox(replica_id)
        self._redis.call(lambda: self._redis.client.xadd(inbox, {"env": blob}, maxlen=INBOX_MAXLEN))
        return _unwrap(replica_id, self._await_reply(replica_id, envelope))

    def forget(self, replica_id: str) -> None:
        client = self._redis.client

        def drop() -> None:
            pipe = client.pipeline(transaction=True)
            pipe.hdel(self.keys.replicas, replica_id)
            pipe.delete(self.keys.inbox(replica_id), self.keys.alive(replica_id))
            pipe.execute()

        self._redis.call(drop)
        with self._lock:
            self._missing_since.pop(replica_id, None)

    def published_model(self) -> PublishedModel | None:
        raw = self._redis.call(lambda: self._redis.client.get(self.keys.model_info))
        return None if raw is None else PublishedModel.from_json(raw)

    def replica_infos(self) -> list[ReplicaInfo]:
        """Registered replicas (for operators and tests: host and pid of each)."""
        raw = self._redis.call(lambda: self._redis.client.hgetall(self.keys.replicas))
        return sorted((ReplicaInfo.from_json(v) for v in raw.values()), key=lambda i: i.replica_id)

    def _await_reply(self, replica_id: str, envelope: Envelope) -> Reply:
        deadline = time.monotonic() + self._call_timeout_s
        client, key, wake = self._redis.client, envelope.reply_to, _wake_key(envelope.reply_to)
        while True:
            self._redis.call(lambda: client.blpop([wake], timeout=self._poll_s))
            blob = self._redis.call(lambda: client.get(key))
            if blob is not None:
                self._redis.call(lambda: client.delete(key, wake))
                try:
                    return decode(blob, Reply)
                except CodecError as exc:
                    raise ReplicaCallError(f"unreadable reply from replica {replica_id}: {exc}") from exc
            if self._gone(replica_id):
                raise ReplicaGone(replica_id, "heartbeat expired while it ran a call")
            if time.monotonic() > deadline:
                raise ReplicaCallError(f"replica {replica_id} did not answer within {self._call_timeout_s:.0f} s")

    def _gone(self, replica_id: str) -> bool:
        """Heartbeat missing for longer than the grace period (a restart of Redis is not a death)."""
        beating = self._redis.call(lambda: self._redis.client.exists(self.keys.alive(replica_id)))
        now = time.monotonic()
        with self._lock:
            if beating:
                self._missing_since.pop(replica_id, None)
                return False
            since = self._missing_since.setdefault(replica_id, now)
        return now - since >= self._grace_s


class RedisReplicaEndpoint:
    """A replica's side: registration, heartbeat, and the loop that executes its inbox in order."""

    def __init__(self, client: redis.Redis, keys: ClusterKeys, info: ReplicaInfo, published: PublishedModel,
                 *, heartbeat_ttl_s: float = 5.0, block_s: float = 1.0, retry: Retry | None = None) -> None:
        self._redis = _Redis(client, retry)
        self.keys = keys
        self.info = info
        self._published = published.to_json()
        self._ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._block_ms = max(1, int(block_s * 1000))
        self._stop = threading.Event()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._threads: list[threading.Thread] = []

    @property
    def replica_id(self) -> str:
        return self.info.replica_id

    def start(self, handler: Callable[[Envelope], Reply]) -> None:
        """Register, then beat and serve the inbox on daemon threads until `stop()`."""
        self.beat()
        for name, target in (("heartbeat", self._beat_forever), ("inbox", lambda: self._serve(handler))):
            thread = threading.Thread(target=target, name=f"replica-{name}:{self.replica_id}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, *, leave: bool = True) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if leave:
            self._leave()

    @property
    def healthy(self) -> bool:
        """Both threads still run (Ray Serve's health check asks this)."""
        return not self._stop.is_set() and all(t.is_alive() for t in self._threads)

    def beat(self) -> None:
        """Refresh the heartbeat and (re-)register: after a Redis restart the next beat restores both."""
        client = self._redis.client

        def write() -> None:
            pipe = client.pipeline(transaction=False)
            pipe.set(self.keys.alive(self.replica_id), str(time.time()), px=self._ttl_ms)
            pipe.hset(self.keys.replicas, self.replica_id, self.info.to_json())
            pipe.set(self.keys.model_info, self._published)
            pipe.execute()

        self._redis.call(write)

    def _beat_forever(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                self.beat()
            except redis.RedisError as error:  # keep beating: Redis may come back
                log.warning("replica %s heartbeat failed: %s", self.replica_id, error)

    def _serve(self, handler: Callable[[Envelope], Reply]) -> None:
        last_id = "0"
        while not self._stop.is_set():
            try:
                for entry_id, fields in self._read(last_id):
                    last_id = entry_id
                    self._handle(entry_id, fields, handler)
            except redis.RedisError as error:
                log.warning("replica %s inbox read failed (%s); retrying", self.replica_id, error)
                self._stop.wait(0.5)

    def _read(self, last_id: str) -> list[tuple[str, dict[bytes, bytes]]]:
        inbox = self.keys.inbox(self.replica_id)
        response = self._redis.call(
            lambda: self._redis.client.xread({inbox: last_id}, count=16, block=self._block_ms))
        return [(as_text(i), f) for i, f in _entries_of(response)]

    def _handle(self, entry_id: str, fields: dict[bytes, bytes], handler: Callable[[Envelope], Reply]) -> None:
        inbox = self.keys.inbox(self.replica_id)
        self._redis.call(lambda: self._redis.client.xdel(inbox, entry_id))
        try:
            envelope = decode(fields.get(b"env", b""), Envelope)
        except CodecError as error:
            log.error("replica %s dropped an unreadable call %s: %s", self.replica_id, entry_id, error)
            return
        if envelope.call_id in self._seen:  # a retried XADD that had landed: answer once
            return
        self._seen[envelope.call_id] = None
        if len(self._seen) > SEEN_CALLS:
            self._seen.popitem(last=False)
        blob = encode(handler(envelope))

        def answer() -> None:
            wake = _wake_key(envelope.reply_to)
            pipe = self._redis.client.pipeline(transaction=True)
            pipe.set(envelope.reply_to, blob, ex=REPLY_TTL_S)
            pipe.rpush(wake, b"1")
            pipe.expire(wake, REPLY_TTL_S)
            pipe.execute()

        self._redis.call(answer)

    def _leave(self) -> None:
        client = self._redis.client

        def drop() -> None:
            pipe = client.pipeline(transaction=True)
            pipe.hdel(self.keys.replicas, self.replica_id)
            pipe.delete(self.keys.alive(self.replica_id), self.keys.inbox(self.replica_id))
            pipe.execute()

        try:
            self._redis.call(drop)
        except redis.RedisError as error:
            log.warning("replica %s could not deregister: %s", self.replica_id, error)


def _unwrap(replica_id: str, reply: Reply) -> object:
    if reply.fenced:
        raise Fenced(f"replica {replica_id}: {reply.error}")
    if reply.error is not None:
        raise ReplicaCallError(f"replica {replica_id}: {reply.error}")
    return reply.value


def _wake_key(reply_key: str) -> str:
    return f"{reply_key}:wake"


def as_text(value: bytes | str) -> str:
    """A Redis answer (bytes with this bytes client) as text."""
    return value.decode() if isinstance(value, bytes) else value
