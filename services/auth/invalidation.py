"""Cross-gateway invalidation of cached authentications, over Redis pub/sub.

Each gateway caches successful key lookups for a few seconds (`gateway.auth.DatabaseAuthenticator`). A
key revoked through one gateway stops working there at once; the others would keep serving it from their
caches until the entry expires. `RedisAuthInvalidations` closes that gap: the revoking process publishes
an `Invalidation` (one key, or every key of a tenant) on `{prefix}:auth:invalidate`, and every
subscribed gateway drops the matching cache entries as the message arrives (milliseconds).

Pub/sub delivers only to subscribers connected at the time: after a lost connection the listener
resubscribes and reports `Invalidation.everything()`, so a gateway that may have missed a message
forgets its whole cache once instead of trusting it. The cache TTL stays the bound if Redis is down.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import redis

log = logging.getLogger(__name__)

_EVERY_TENANT = "*"


@dataclass(frozen=True)
class Invalidation:
    """Forget cached authentications of `tenant_id`: of key `api_key_id`, or of all its keys (None)."""

    tenant_id: str
    api_key_id: int | None = None

    @classmethod
    def everything(cls) -> Invalidation:
        return cls(_EVERY_TENANT)

    @property
    def is_everything(self) -> bool:
        return self.tenant_id == _EVERY_TENANT

    def to_json(self) -> str:
        return json.dumps({"tenant_id": self.tenant_id, "api_key_id": self.api_key_id})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Invalidation:
        data = json.loads(raw)
        key = data.get("api_key_id")
        return cls(str(data["tenant_id"]), int(key) if key is not None else None)


class RedisAuthInvalidations:
    """Publishes invalidations and delivers everyone's to a callback, on a listener thread of its own."""

    def __init__(self, client: redis.Redis, *, prefix: str, reconnect_s: float = 1.0) -> None:
        self._client = client
        self.channel = f"{prefix}:auth:invalidate"
        self._reconnect_s = reconnect_s
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self, invalidation: Invalidation) -> None:
        """Tell every gateway; a Redis failure is logged (their caches then expire as usual)."""
        try:
            self._client.publish(self.channel, invalidation.to_json())
        except redis.RedisError as error:
            log.warning("auth invalidation not published (caches expire on their own): %s", error)

    def subscribe(self, callback: Callable[[Invalidation], None], timeout_s: float = 5.0) -> bool:
        """Deliver every invalidation to `callback` (on the listener thread); True once subscribed."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._listen, args=(callback,), name="auth-invalidations",
                                            daemon=True)
            self._thread.start()
        return self._subscribed.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _listen(self, callback: Callable[[Invalidation], None]) -> None:
        connections = 0
        while not self._stop.is_set():
            try:
                pubsub = self._client.pubsub()
                pubsub.subscribe(self.channel)
                try:
                    connections += 1
                    self._relay(pubsub, callback, missed=connections > 1)
                finally:
                    pubsub.close()
            except redis.RedisError as error:
                self._subscribed.clear()
                log.warning("auth invalidations: Redis connection lost (%s); resubscribing", error)
                self._stop.wait(self._reconnect_s)

    def _relay(self, pubsub: redis.client.PubSub, callback: Callable[[Invalidation], None], *, missed: bool) -> None:
        while not self._stop.is_set():
            message = pubsub.get_message(timeout=0.5)
            if message is None:
                continue
            if message["type"] == "subscribe":
                self._subscribed.set()
                if missed:  # messages published while disconnected are lost: forget everything once
                    self._deliver(callback, Invalidation.everything())
                continue
            if message["type"] == "message":
                try:
                    invalidation = Invalidation.from_json(message["data"])
                except (ValueError, KeyError, TypeError):
                    log.warning("auth invalidations: unreadable message ignored")
                    continue
                self._deliver(callback, invalidation)

    @staticmethod
    def _deliver(callback: Callable[[Invalidation], None], invalidation: Invalidation) -> None:
        try:
            callback(invalidation)
        except Exception:  # noqa: BLE001 - one bad callback must not end the subscription
            log.exception("auth invalidation callback failed")
