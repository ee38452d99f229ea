"""Short-lived JWTs: the SDK's JWT mode (`auth/token`) and the signed links of session trace exports.

`auth/token` exchanges the caller's API key for an HS256 JWT (default 15 minutes) naming the tenant and the
key it was minted from (`kid` claim); the SDK then sends the JWT in `X-API-Key` and refreshes it at half its
life. A JWT is accepted only while its signature and expiry check out *and* its key is still live and its
tenant enabled (looked up, cached for `cache_seconds` like API keys): revoking the key kills its JWTs.
The signing key is derived from a server secret (the persisted URL-signing secret in `carpool serve`), with a
purpose label per token kind so an auth token never passes as a trace link or the other way round.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import jwt
from sqlalchemy import select
from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.db.database import Database
from services.db.ids import ApiKeyId
from services.db.models import ApiKeyRow, TenantRow

ISSUER = "carpool"
ALGORITHM = "HS256"
DEFAULT_AUTH_TTL_S = 900.0
TRACE_LINK_TTL_S = 3600.0


@dataclass(frozen=True)
class AuthClaims:
    tenant_id: str
    key_id: int
    expires_at: float


class TokenSigner:
    """Mints and checks this server's JWTs; `clock` returns Unix seconds (injectable for tests)."""

    def __init__(self, secret: bytes | None = None, *, auth_ttl_s: float = DEFAULT_AUTH_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        root = secret if secret else secrets.token_bytes(32)
        self._auth_key = hmac.new(root, b"carpool-jwt-auth-v1", hashlib.sha256).digest()
        self._trace_key = hmac.new(root, b"carpool-jwt-trace-v1", hashlib.sha256).digest()
        self.auth_ttl_s = auth_ttl_s
        self._now = clock

    def mint_auth(self, tenant: Tenant) -> str:
        if tenant.api_key_id is None:
            raise ValueError("only a caller authenticated with an API key can exchange it for a JWT")
        now = int(self._now())
        claims = {"iss": ISSUER, "sub": f"tml:user:{tenant.id}", "org_id": tenant.id, "email": tenant.name,
                  "kid": int(tenant.api_key_id), "iat": now, "exp": now + int(self.auth_ttl_s)}
        return jwt.encode(claims, self._auth_key, algorithm=ALGORITHM)

    def check_auth(self, token: str) -> AuthClaims | None:
        claims = self._decode(token, self._auth_key)
        if claims is None or not isinstance(claims.get("kid"), int) or not isinstance(claims.get("org_id"), str):
            return None
        return AuthClaims(claims["org_id"], claims["kid"], float(claims["exp"]))

    def mint_trace_link(self, tenant_id: str, session_id: str) -> str:
        now = int(self._now())
        claims = {"iss": ISSUER, "org_id": tenant_id, "session": session_id, "iat": now,
                  "exp": now + int(TRACE_LINK_TTL_S)}
        return jwt.encode(claims, self._trace_key, algorithm=ALGORITHM)

    def check_trace_link(self, token: str) -> tuple[str, str] | None:
        claims = self._decode(token, self._trace_key)
        if claims is None or not isinstance(claims.get("session"), str):
            return None
        return str(claims["org_id"]), claims["session"]

    def _decode(self, token: str, key: bytes) -> dict[str, object] | None:
        try:
            # Expiry is checked against this signer's clock below (PyJWT would use the wall clock).
            claims: dict[str, object] = jwt.decode(
                token, key, algorithms=[ALGORITHM], issuer=ISSUER,
                options={"require": ["exp", "iat", "iss"], "verify_exp": False, "verify_iat": False},
            )
        except jwt.PyJWTError:
            return None
        expires = claims.get("exp")
        if not isinstance(expires, int | float) or expires <= self._now():
            return None
        return claims


class JwtAuth:
    """`auth/token` and JWT authentication; a JWT's key is re-checked at most every `cache_seconds`."""

    def __init__(self, db: Database, signer: TokenSigner, *, cache_seconds: float = 5.0,
                 cache_size: int = 10_000) -> None:
        self._db = db
        self.signer = signer
        self._cache_seconds = cache_seconds
        self._cache_size = cache_size
        self._cache: OrderedDict[int, tuple[Tenant, float]] = OrderedDict()

    def mint(self, tenant: Tenant) -> tuple[str, float]:
        return self.signer.mint_auth(tenant), self.signer.auth_ttl_s

    async def authenticate(self, token: str) -> Tenant | None:
        claims = self.signer.check_auth(token)
        if claims is None:
            return None
        hit = self._cache.get(claims.key_id)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        tenant = await asyncio.to_thread(self._live_key, claims)
        if tenant is None:
            self._cache.pop(claims.key_id, None)
            return None
        self._cache[claims.key_id] = (tenant, time.monotonic() + self._cache_seconds)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return tenant

    def _live_key(self, claims: AuthClaims) -> Tenant | None:
        with self._db.sessions.begin() as db:
            return _tenant_of_key(db, claims)


def _tenant_of_key(db: Session, claims: AuthClaims) -> Tenant | None:
    row = db.execute(select(ApiKeyRow, TenantRow).join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id)
                     .where(ApiKeyRow.id == claims.key_id)).one_or_none()
    if row is None:
        return None
    key, tenant = row
    if key.revoked_at is not None or tenant.disabled or tenant.id != claims.tenant_id:
        return None
    return Tenant.from_row(tenant, ApiKeyId(key.id))

