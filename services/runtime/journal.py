"""Where adapters live and how to rebuild them: the placement map and the durability journal, on Redis.

Placement: adapter id → replica id, one hash per base model, so a scheduler that takes over knows where
every adapter is resident.

Journal, per adapter: the path of its newest complete snapshot (weights + optimizer state + pending
gradients, written by the replica that holds it) and a log of every adapter-changing call dispatched
since, in dispatch order (`PassEntry` / `OptimEntry`, codec bytes in a stream). A call is logged before
it is dispatched, so a replica that dies mid-call leaves it in the log and the restore replays it.
Committing a snapshot swaps the pointer and deletes the log in one MULTI: both describe the same state.

The pointer also names the requests the snapshot *covers but whose results may not have reached a client*
(`applied`: request id → result of the call that carried the snapshot order). Without them a scheduler and
a replica dying within one snapshot interval could apply a step twice: the successor re-dispatches the
in-flight request, the adapter is restored from a snapshot that already contains it, and the replica that
remembered the request id died with its memory. A restore seeds the new replica's memory with `applied`,
so the re-dispatched request is answered, not applied again.
The superseded snapshot is deleted only by a *later* snapshot order (`previous`), never before the new
pointer is committed, so the pointer always names a snapshot that exists.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import redis
from redis.retry import Retry

from services.jobqueue.codec import decode, encode
from services.jobqueue.redis_queue import default_retry, require_bytes_client
from services.runtime.redis_replicas import ClusterKeys, as_text
from services.runtime.replica_protocol import LogEntry, OptimEntry, PassEntry

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotPointer:
    path: str
    previous: str | None = None
    """The snapshot this one superseded: safe to delete once a newer one is committed."""
    applied: dict[str, object] = field(default_factory=dict)
    """Results of the requests this snapshot already contains that a successor may send again."""


class PlacementStore(Protocol):
    def load(self) -> dict[str, str]:
        """Every adapter's replica."""
        ...

    def place(self, adapter_id: str, replica_id: str) -> None: ...

    def remove(self, adapter_id: str) -> None: ...


class DurabilityJournal(Protocol):
    def snapshot(self, adapter_id: str) -> SnapshotPointer | None: ...

    def entries(self, adapter_id: str) -> list[LogEntry]: ...

    def append(self, entries: Iterable[tuple[str, LogEntry]]) -> None:
        """Log (adapter, entry) pairs, in order, before their call is dispatched."""
        ...

    def commit_snapshot(self, adapter_id: str, path: str, applied: Mapping[str, object] | None = None) -> None:
        """`path` now holds the adapter's state including every logged call and the `applied` requests (by
        id, with their results): point at it, clear the log."""
        ...

    def forget(self, adapter_id: str) -> None: ...


class _RedisStore:
    def __init__(self, client: redis.Redis, keys: ClusterKeys, retry: Retry | None) -> None:
        require_bytes_client(client)
        self._client = client
        self.keys = keys
        self._retry = retry or default_retry()

    def _call(self, operation: Callable[[], T]) -> T:
        return self._retry.call_with_retry(operation, lambda error: log.warning("redis retry: %s", error))


class RedisPlacement(_RedisStore):
    """`PlacementStore` as one hash per base model."""

    def __init__(self, client: redis.Redis, keys: ClusterKeys, retry: Retry | None = None) -> None:
        super().__init__(client, keys, retry)

    def load(self) -> dict[str, str]:
        raw = self._call(lambda: self._client.hgetall(self.keys.placement))
        return {as_text(k): as_text(v) for k, v in raw.items()}

    def place(self, adapter_id: str, replica_id: str) -> None:
        self._call(lambda: self._client.hset(self.keys.placement, adapter_id, replica_id))

    def remove(self, adapter_id: str) -> None:
        self._call(lambda: self._client.hdel(self.keys.placement, adapter_id))


class RedisJournal(_RedisStore):
    """`DurabilityJournal`: snapshot pointers in a hash, one log stream per adapter."""

    def __init__(self, client: redis.Redis, keys: ClusterKeys, retry: Retry | None = None) -> None:
        super().__init__(client, keys, retry)

    def snapshot(self, adapter_id: str) -> SnapshotPointer | None:
        raw = self._call(lambda: self._client.hget(self.keys.snapshots, adapter_id))
        if raw is None:
            return None
        fields = json.loads(raw)
        blob = fields.pop("applied", None)
        applied = decode(base64.b64decode(blob), dict) if blob else {}
        return SnapshotPointer(**fields, applied=applied)

    def entries(self, adapter_id: str) -> list[LogEntry]:
        rows = self._call(lambda: self._client.xrange(self.keys.log(adapter_id)))
        return [_entry(fields[b"entry"]) for _, fields in rows]

    def append(self, entries: Iterable[tuple[str, LogEntry]]) -> None:
        blobs = [(self.keys.log(adapter_id), encode(entry)) for adapter_id, entry in entries]
        if not blobs:
            return

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            for key, blob in blobs:
                pipe.xadd(key, {"entry": blob})
            pipe.execute()

        self._call(write)

    def commit_snapshot(self, adapter_id: str, path: str, applied: Mapping[str, object] | None = None) -> None:
        current = self.snapshot(adapter_id)
        previous = current.path if current is not None and current.path != path else None
        fields: dict[str, object] = {"path": path, "previous": previous}
        if applied:  # codec bytes inside the JSON pointer: results are domain objects (numpy arrays)
            fields["applied"] = base64.b64encode(encode(dict(applied))).decode("ascii")
        pointer = json.dumps(fields)

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(self.keys.snapshots, adapter_id, pointer)
            pipe.delete(self.keys.log(adapter_id))
            pipe.execute()

        self._call(write)

    def forget(self, adapter_id: str) -> None:
        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.hdel(self.keys.snapshots, adapter_id)
            pipe.delete(self.keys.log(adapter_id))
            pipe.execute()

        self._call(write)


def _entry(blob: bytes) -> LogEntry:
    entry = decode(blob, object)
    if not isinstance(entry, PassEntry | OptimEntry):
        raise TypeError(f"log entry decodes to {type(entry).__name__}, not a PassEntry or OptimEntry")
    return entry

