"""Who is calling: the `Authenticator` Protocol the gateway depends on, its database implementation, and
reading a credential from request headers.

The gateway never sees key hashes or tenant rows. It asks an `Authenticator` to turn the presented key
into a `Tenant` (None = reject with 401) and, for `DELETE /api/v1/auth/apikey/me`, to revoke the key the
caller authenticated with. `DatabaseAuthenticator` implements it over `services.auth.tenants` and a
`services.db.Database`, running the (synchronous) SQLAlchemy work in a thread and caching successful
lookups for a few seconds so long-polls and chunked forward_backward calls do not each hit the database.
Failed lookups are remembered too, for less time, so a flood of one bad key costs one lookup per
`failure_seconds` rather than one per request (the edge's per-address limit slows many distinct keys).

Credentials arrive as `X-API-Key: tml-...` (the SDK) or `Authorization: Bearer tml-...` (REST clients), or
as a JWT (`eyJ...`) that `auth/token` minted from such a key (the SDK's JWT mode).
Keys are never logged: errors name the header, not its value.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from services.auth.keys import KEY_PREFIX
from services.auth.tenants import Tenant, authenticate
from services.db.database import Database
from services.db.tenants import revoke_api_key

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
    `cache_seconds`. A failed key is answered from memory for `failure_seconds` (both caches are keyed by a
    SHA-256 digest of the key and bounded in size, least recently used first out); a newly issued key was
    never presented before, so it works immediately.
    """

    def __init__(
        self, database: Database, *, pepper: bytes | None = None, cache_seconds: float = 5.0,
        cache_size: int = 10_000, failure_seconds: float = 2.0, failure_cache_size: int = 10_000,
    ) -> None:
        self._database = database
        self._pepper = pepper
        self._cache_seconds = cache_seconds
        self._cache_size = cache_size
        self._cache: OrderedDict[str, _Cached] = OrderedDict()
        self._failure_seconds = failure_seconds
        self._failure_cache_size = failure_cache_size
        self._failures: OrderedDict[str, float] = OrderedDict()
        """Digest of a key whose lookup failed → monotonic time until which it is refused from memory."""

    async def authenticate(self, api_key: str) -> Tenant | None:
        # The cache is keyed by a digest so the process never holds raw keys beyond the request.
        digest = hashlib.sha256(api_key.encode("utf-8")).hexdigest()
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit.expires_at > now:
            return hit.tenant
        if self._failures.get(digest, 0.0) > now:
            return None
        tenant = await asyncio.to_thread(self._lookup, api_key)
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
        for digest in [d for d, c in self._cache.items() if c.tenant.api_key_id == tenant.api_key_id]:
            del self._cache[digest]
            self._remember_failure(digest)  # fails here at once, without a lookup
        return revoked

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
        self._failures[digest] = time.monotonic() + self._failure_seconds
        self._failures.move_to_end(digest)
        while len(self._failures) > self._failure_cache_size:
            self._failures.popitem(last=False)

    def _remember(self, digest: str, tenant: Tenant) -> None:
        if self._cache_seconds <= 0 or self._cache_size <= 0:
            return
        self._cache[digest] = _Cached(tenant, time.monotonic() + self._cache_seconds)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
