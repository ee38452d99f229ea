"""JWTs of `auth/token` and of trace links: signed with a key derived from the server secret, short-lived,
and never interchangeable (an auth token is no trace link, another server's token is nothing)."""

from __future__ import annotations

import jwt
import pytest

from services.auth.tenants import Tenant
from services.control.jwt_tokens import TokenSigner
from services.db.ids import ApiKeyId, TenantId
from services.db.tenants import TenantQuotas

SECRET = b"s" * 32
TENANT = Tenant(TenantId("ten-1"), "alice", False, TenantQuotas(), ApiKeyId(7))


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_auth_token_carries_tenant_and_key_and_expires() -> None:
    clock = Clock()
    signer = TokenSigner(SECRET, auth_ttl_s=900, clock=clock)
    token = signer.mint_auth(TENANT)
    claims = signer.check_auth(token)
    assert claims is not None and (claims.tenant_id, claims.key_id) == ("ten-1", 7)
    unverified = jwt.decode(token, options={"verify_signature": False})
    assert unverified["exp"] - unverified["iat"] == 900  # the SDK refreshes at half the lifetime
    assert unverified["sub"] and unverified["org_id"] == "ten-1"  # what RestClient.whoami() reads
    clock.now += 899
    assert signer.check_auth(token) is not None
    clock.now += 1
    assert signer.check_auth(token) is None


def test_tokens_of_another_secret_or_kind_or_tampered_are_refused() -> None:
    signer = TokenSigner(SECRET)
    token = signer.mint_auth(TENANT)
    assert TokenSigner(b"t" * 32).check_auth(token) is None
    assert signer.check_trace_link(token) is None
    assert signer.check_auth(signer.mint_trace_link("ten-1", "sess-1")) is None
    header, payload, signature = token.split(".")
    assert signer.check_auth(f"{header}.{payload}.{signature[::-1]}") is None
    forged = jwt.encode({"iss": "carpool", "org_id": "ten-2", "kid": 1, "iat": 0, "exp": 4_000_000_000},
                        SECRET, algorithm="HS256")  # signed with the root secret, not the derived key
    assert signer.check_auth(forged) is None
    none_alg = jwt.encode({"iss": "carpool", "org_id": "ten-1", "kid": 7, "iat": 0, "exp": 4_000_000_000},
                          key=None, algorithm="none")
    assert signer.check_auth(none_alg) is None


def test_trace_links_name_tenant_and_session() -> None:
    signer = TokenSigner(SECRET)
    assert signer.check_trace_link(signer.mint_trace_link("ten-1", "sess-9")) == ("ten-1", "sess-9")


def test_only_key_authenticated_callers_get_a_jwt() -> None:
    with pytest.raises(ValueError):
        TokenSigner(SECRET).mint_auth(Tenant(TenantId("ten-1"), "alice", False, TenantQuotas()))
