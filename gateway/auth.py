"""Who is calling: the `Authenticator` Protocol the gateway depends on, its database implementation, and
reading a credential from request headers.

The gateway never sees key hashes or tenant rows. It asks an `Authenticator` to turn the presented key
into a `Tenant` (None = reject with 401) and, for `DELETE /api/v1/auth/apikey/me`, to revoke the key the
caller authenticated with. `DatabaseAuthenticator` implements it over `services.auth.tenants` and a
`services.db.Database`, running the (synchronous) SQLAlchemy work in a thread and caching successful
lookups for a few seconds so long-polls and chunked forward_backward calls do not each hit the database.
Keys in use are re-checked together (`services.auth.tenants.revalidate`, one statement for all of them)
every half cache interval rather than looked up one by one when their entries expire: with 512 tenants
each calling every few seconds, nearly every request missed a 5 s cache, and those lookups were 12 % of
the server's samples (py-spy, bench/load.py).
With an `InvalidationBus` (Redis pub/sub in cluster mode, `services.auth.invalidation`), a revocation
through one gateway reaches the others' caches at once. Failed lookups are remembered too, for less
time, so a flood of one bad key costs one lookup per `failure_seconds` rather than one per request (the
edge's per-address limit slows many distinct keys).

Credentials arrive as `X-API-Key: tml-...` (the SDK) or `Authorization: Bearer tml-...` (REST clients), or
as a JWT (`eyJ...`) that `auth/token` minted from such a key (the SDK's JWT mode).
Keys are never logged: errors name the header, not its value.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from services.auth.invalidation import Invalidation
from services.auth.keys import KEY_PREFIX
from services.auth.tenants import Tenant, authenticate, revalidate
from services.db.database import Database
from services.db.ids import ApiKeyId
from services.db.tenants import revoke_api_key

log = logging.getLogger(__name__)

API_KEY_HEADER = "X-API-Key"
JWT_PREFIX = "eyJ"


class Authenticator(Protocol):
    """Turns an API key into the tenant it belongs to; implemented by the service core or below."""

    async def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant owning `api_key`, or None if it is malformed, unknown, revoked, or the tenant is
        disabled (all four look the same to the caller)."""
        ...

    async def revoke(self, tenant: Tenant) -> bool:
        """Revoke the key `tenant` authenticated with (`tenant.api_key_id`); False if it was not live."""
        ...

    async def announce(self, invalidation: Invalidation) -> None:
        """A key was revoked or a tenant disabled elsewhere (the admin dashboard), already committed: stop
        accepting it here at once and tell the other gateways, rather than serve it until caches expire."""
        ...


class InvalidationBus(Protocol):
    """Carries revocations between gateways (`services.auth.invalidation.RedisAuthInvalidations`)."""

    def publish(self, invalidation: Invalidation) -> None: ...

    def subscribe(self, callback: Callable[[Invalidation], None], timeout_s: float = 5.0) -> bool: ...


class CredentialError(Exception):
    """A request without a usable credential; answered 401 with `message`."""

    def __init__(self, message: str, *, invalid_token: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.invalid_token = invalid_token
        """A JWT that no longer works (expired, or its key revoked): the SDK exchanges its key again."""


def credential_from_headers(headers: Mapping[str, str]) -> str:
    """The presented key: `X-API-Key` first (what the SDK sends), else `Authorization: Bearer <key>`."""
    key = (headers.get(API_KEY_HEADER) or "").strip()
    if not key:
        scheme, _, value = (headers.get("authorization") or "").strip().partition(" ")
        if scheme.lower() == "bearer":
            key = value.strip()
        elif scheme:
            raise CredentialError("Authorization header must use the Bearer scheme: 'Bearer tml-...'")
    if not key:
        raise CredentialError(
            f"missing API key: send '{API_KEY_HEADER}: {KEY_PREFIX}...' or 'Authorization: Bearer {KEY_PREFIX}...'"
        )
    return key  # an API key, or a JWT from `auth/token` (`JWT_PREFIX`; checked by the control plane)


@dataclass(frozen=True)
class _Cached:
    tenant: Tenant
    expires_at: float


class DatabaseAuthenticator:
    """`Authenticator` over the tenants/api_keys tables, with short caches of successes and failures.

    A revoked key stops working here at once when revoked through this instance, elsewhere after at most
    `cache_seconds`: an entry is good for `cache_seconds` from the start of the check that last found the key
    live. The first request after half of that since the last check re-checks, in one transaction
    (`_sweep`), every key presented within `recheck_idle_seconds` (a tenant of a busy server may call less
    often than once per cache interval: its entry must not lapse between its calls); a key idle longer is
    not re-checked and simply expires. A failed key is answered from memory for `failure_seconds` (both
    caches are keyed by a SHA-256 digest of the key and bounded in size, least recently used first out); a
    newly issued key was never presented before, so it works immediately.
    """

    def __init__(
        self, database: Database, *, pepper: bytes | None = None, cache_seconds: float = 5.0,
        cache_size: int = 10_000, failure_seconds: float = 2.0, failure_cache_size: int = 10_000,
        bus: InvalidationBus | None = None, clock: Callable[[], float] = time.monotonic,
        recheck_idle_seconds: float = 60.0,
    ) -> None:
        self._database = database
        self._clock = clock
        self._pepper = pepper
        self._cache_seconds = cache_seconds
        self._cache_size = cache_size
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._failure_seconds = failure_seconds
        self._failure_cache_size = failure_cache_size
        self._failures: OrderedDict[str, float] = OrderedDict()
        """Digest of a key whose lookup failed → monotonic time until which it is refused from memory."""
        # The caches are used on the event loop and invalidated from the bus's listener thread.
        self._lock = threading.Lock()
        self._used: dict[str, float] = {}
        """Digest → when the key was last presented; a sweep re-checks those presented within
        `recheck_idle_seconds` and forgets older ones."""
        self._recheck_idle_seconds = recheck_idle_seconds
        self._next_sweep = 0.0
        self._sweeping = False
        self._bus = bus
        if bus is not None and not bus.subscribe(self.invalidate):
            log.warning("auth invalidations not subscribed yet; revocations elsewhere apply after the cache TTL")

    async def authenticate(self, api_key: str) -> Tenant | None:
        # The cache is keyed by a digest so the process never holds raw keys beyond the request.
        digest = hashlib.sha256(api_key.encode("utf-8")).hexdigest()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None and hit.expires_at > now:
                self._used[digest] = now
                if not self._claim_sweep(now):
                    return hit.tenant
            elif self._failures.get(digest, 0.0) > now:
                return None
            else:
                hit = None
        if hit is not None:
            await self._sweep()
            known = self._known(digest, now)
            if known is not None:
                return known or None
            # Forgotten meanwhile without being refused (the whole cache dropped when the invalidation bus
            # resubscribed, or evicted): look the key up like a new one, not a 401.
        tenant = await asyncio.to_thread(self._lookup, api_key)
        with self._lock:
            if tenant is None:
                self._cache.pop(digest, None)
                self._remember_failure(digest)
            else:
                self._failures.pop(digest, None)
                self._remember(digest, tenant)
        return tenant

    async def revoke(self, tenant: Tenant) -> bool:
        if tenant.api_key_id is None:
            return False
        revoked = await asyncio.to_thread(self._revoke, tenant)
        await self.announce(Invalidation(tenant.id, tenant.api_key_id))
        return revoked

    async def announce(self, invalidation: Invalidation) -> None:
        self.invalidate(invalidation)
        if self._bus is not None:
            await asyncio.to_thread(self._bus.publish, invalidation)

    def invalidate(self, invalidation: Invalidation) -> None:
        """Forget cached successes of a revoked key or disabled tenant (from this gateway or the bus); they
        fail at once, without a lookup, for `failure_seconds`."""
        with self._lock:
            if invalidation.is_everything:
                self._cache.clear()
                return
            for digest in [d for d, c in self._cache.items() if _matches(invalidation, c.tenant)]:
                del self._cache[digest]
                self._remember_failure(digest)

    def _known(self, digest: str, now: float) -> Tenant | bool | None:
        """After a sweep: the key's tenant if its entry is live, False if it is remembered as refused (the
        sweep or an invalidation found it revoked), None if this gateway no longer knows either way."""
        with self._lock:
            entry = self._cache.get(digest)
            if entry is not None and entry.expires_at > now:
                return entry.tenant
            return False if self._failures.get(digest, 0.0) > now else None

    def _claim_sweep(self, now: float) -> bool:
        """Whether the caller (holding the lock) is to run the sweep that is due now."""
        if self._sweeping or now < self._next_sweep:
            return False
        self._sweeping, self._next_sweep = True, now + self._cache_seconds / 2
        return True

    async def _sweep(self) -> None:
        """Re-check every key presented recently in one transaction: a live one's entry is good for
        another `cache_seconds` from the check's start, with its tenant re-read; a revoked or disabled one is
        dropped and remembered as a failure. Entries invalidated or replaced meanwhile are left as they are.
        A failed check changes nothing: entries then expire and each key is looked up on its own again."""
        started = self._clock()
        with self._lock:
            idle = [d for d, at in self._used.items()
                    if at < started - self._recheck_idle_seconds or d not in self._cache]
            for digest in idle:
                del self._used[digest]
            batch = {d: self._cache[d] for d in self._used}
        key_ids = [c.tenant.api_key_id for c in batch.values() if c.tenant.api_key_id is not None]
        try:
            live = await asyncio.to_thread(self._revalidate, key_ids)
        except Exception:
            log.exception("re-checking %d cached API keys failed; they will be looked up one by one", len(key_ids))
            return
        finally:
            with self._lock:
                self._sweeping = False
        with self._lock:
            for digest, cached in batch.items():
                if self._cache.get(digest) is not cached or cached.tenant.api_key_id is None:
                    continue
                tenant = live.get(cached.tenant.api_key_id)
                if tenant is None:
                    del self._cache[digest]
                    self._remember_failure(digest)
                else:
                    self._cache[digest] = _Cached(tenant, started + self._cache_seconds)

    def _revalidate(self, key_ids: list[ApiKeyId]) -> dict[ApiKeyId, Tenant]:
        with self._database.sessions.begin() as session:
            return revalidate(session, key_ids)

    def _lookup(self, api_key: str) -> Tenant | None:
        with self._database.sessions.begin() as session:
            return authenticate(session, api_key, pepper=self._pepper)

    def _revoke(self, tenant: Tenant) -> bool:
        assert tenant.api_key_id is not None
        with self._database.sessions.begin() as session:
            return revoke_api_key(session, tenant.id, tenant.api_key_id)

    def _remember_failure(self, digest: str) -> None:
        if self._failure_seconds <= 0 or self._failure_cache_size <= 0:
            return
        self._failures[digest] = self._clock() + self._failure_seconds
        self._failures.move_to_end(digest)
        while len(self._failures) > self._failure_cache_size:
            self._failures.popitem(last=False)

    def _remember(self, digest: str, tenant: Tenant) -> None:
        if self._cache_seconds <= 0 or self._cache_size <= 0:
            return
        now = self._clock()
        self._cache[digest] = _Cached(tenant, now + self._cache_seconds)
        self._used[digest] = now
        if not self._next_sweep:  # the first entry: the first sweep is due half an interval later
            self._next_sweep = now + self._cache_seconds / 2
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_size:
            forgotten, _ = self._cache.popitem(last=False)
            self._used.pop(forgotten, None)


def _matches(invalidation: Invalidation, tenant: Tenant) -> bool:
    if tenant.id != invalidation.tenant_id:
        return False
    return invalidation.api_key_id is None or tenant.api_key_id == invalidation.api_key_id
