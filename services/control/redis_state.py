"""Control-plane state that several gateway processes must share, on Redis (cluster mode).

    {prefix}:sampler:{sampling session id}    string JSON `SamplerBinding` (which adapter serves it)
    {prefix}:sampler-load:{adapter id}        hash   attempt → JSON `LoadAttempt` of a checkpoint load

Bindings never change once written, so each process caches the ones it has read. A load attempt is
claimed with HSETNX on its number, so when two gateways start the same attempt only one enqueues it and
both wait for that one's result. Bindings expire after `BINDING_TTL_S` (a gateway that finds none rebuilds it
from the database row and re-checks that the checkpoint is still readable); load attempts carry no TTL.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import TypeVar

import redis
from redis.retry import Retry

from services.control.samplers import LoadAttempt, SamplerBinding
from services.db.ids import RequestId, SamplingSessionId
from services.domain.training import AdapterId
from services.jobqueue.redis_queue import DEFAULT_PREFIX, default_retry

T = TypeVar("T")
BINDING_TTL_S = 7 * 24 * 3600
"""Lifetime of a shared sampler binding on Redis (rebuilt from the database when gone)."""
log = logging.getLogger(__name__)


class _Shared:
    def __init__(self, client: redis.Redis, prefix: str, retry: Retry | None) -> None:
        self._client = client
        self._prefix = prefix
        self._retry = retry or default_retry()

    def _call(self, operation: Callable[[], T]) -> T:
        return self._retry.call_with_retry(operation, lambda error: log.warning("redis retry: %s", error))


class RedisSamplerDirectory(_Shared):
    """`SamplerBindings` shared by every gateway process."""

    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX, retry: Retry | None = None) -> None:
        super().__init__(client, prefix, retry)
        self._lock = threading.Lock()
        self._cache: dict[SamplingSessionId, SamplerBinding] = {}

    def key(self, sampling_id: str) -> str:
        return f"{self._prefix}:sampler:{sampling_id}"

    def bind(self, sampling_id: SamplingSessionId, binding: SamplerBinding) -> None:
        payload = json.dumps(asdict(binding))
        self._call(lambda: self._client.set(self.key(sampling_id), payload, ex=BINDING_TTL_S))
        with self._lock:
            self._cache[sampling_id] = binding

    def get(self, sampling_id: SamplingSessionId) -> SamplerBinding | None:
        with self._lock:
            cached = self._cache.get(sampling_id)
        if cached is not None:
            return cached
        raw = self._call(lambda: self._client.get(self.key(sampling_id)))
        if raw is None:
            return None
        fields = json.loads(raw)
        adapter = fields.get("adapter_id")
        binding = SamplerBinding(fields["base_model"], None if adapter is None else AdapterId(adapter))
        with self._lock:
            self._cache[sampling_id] = binding
        return binding


class RedisLoadLedger(_Shared):
    """`LoadLedger` shared by every gateway process."""

    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX, retry: Retry | None = None) -> None:
        super().__init__(client, prefix, retry)

    def key(self, adapter_id: str) -> str:
        return f"{self._prefix}:sampler-load:{adapter_id}"

    def current(self, adapter_id: AdapterId) -> LoadAttempt | None:
        raw = self._call(lambda: self._client.hgetall(self.key(adapter_id)))
        attempts = [_attempt(value) for value in raw.values()]
        return max(attempts, key=lambda a: a.attempt, default=None)

    def begin(self, adapter_id: AdapterId, attempt: LoadAttempt) -> LoadAttempt:
        key, field = self.key(adapter_id), str(attempt.attempt)
        if self._call(lambda: self._client.hsetnx(key, field, _json(attempt))):
            return attempt
        standing = self._call(lambda: self._client.hget(key, field))
        return attempt if standing is None else _attempt(standing)

    def mark_ok(self, adapter_id: AdapterId, attempt: int) -> None:
        key, field = self.key(adapter_id), str(attempt)
        raw = self._call(lambda: self._client.hget(key, field))
        if raw is not None:
            done = _attempt(raw)
            self._call(lambda: self._client.hset(key, field, _json(LoadAttempt(done.request_id, attempt, True,
                                                                               done.started_at))))


def _json(attempt: LoadAttempt) -> str:
    return json.dumps(asdict(attempt))


def _attempt(raw: bytes | str) -> LoadAttempt:
    fields = json.loads(raw)
    return LoadAttempt(RequestId(fields["request_id"]), int(fields["attempt"]), bool(fields["ok"]),
                       float(fields["started_at"]))
