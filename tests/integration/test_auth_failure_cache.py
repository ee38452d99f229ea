"""Failed authentications are remembered (issue 16): a repeated bad key does not reach the database, the
memory is bounded, a key revoked through a gateway fails there at once and, through Redis pub/sub, on the
other gateways despite their caches; and the gateway's blocking control-plane work (here: key lookups)
runs on its own bounded pool, not the default executor."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from conftest import Harness
from fastapi.testclient import TestClient
from sqlalchemy import event

from deploy.admin import create_key, redis_announcer, revoke_keys, set_disabled
from deploy.settings import ServiceSettings
from gateway.app import create_app
from gateway.auth import DatabaseAuthenticator
from gateway.settings import GatewaySettings
from services.auth.invalidation import RedisAuthInvalidations
from services.auth.keys import generate_api_key
from services.auth.tenants import create_tenant_with_key
from services.db import Database
from tests.required import REDIS_URL, require_redis


class Statements:
    """SQL statements the database actually receives, with the thread that sent each."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __len__(self) -> int:
        return len(self.threads)


@contextmanager
def _watching(database: Database) -> Iterator[Statements]:
    seen = Statements()

    def note(*_: object) -> None:
        seen.threads.append(threading.current_thread().name)

    event.listen(database.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(database.engine, "before_cursor_execute", note)


def test_a_bad_key_is_looked_up_once_and_the_memory_is_bounded(harness: Harness) -> None:
    auth = DatabaseAuthenticator(harness.db, failure_seconds=3600, failure_cache_size=2)
    bad = [generate_api_key() for _ in range(3)]  # well-formed, never issued: each needs a lookup
    with _watching(harness.db) as sql:
        assert asyncio.run(auth.authenticate(bad[0])) is None
        first = len(sql)
        assert first > 0
        for _ in range(5):
            assert asyncio.run(auth.authenticate(bad[0])) is None
        assert len(sql) == first  # answered from memory
        asyncio.run(auth.authenticate(bad[1]))
        asyncio.run(auth.authenticate(bad[2]))  # the cache holds two: bad[0] is forgotten
        before = len(sql)
        assert asyncio.run(auth.authenticate(bad[0])) is None
        assert len(sql) > before


def test_a_revoked_key_fails_at_once_on_the_revoking_gateway(harness: Harness) -> None:
    with harness.db.sessions.begin() as db:
        _, issued = create_tenant_with_key(db, "revokes")
    auth = DatabaseAuthenticator(harness.db, cache_seconds=3600, failure_seconds=3600)
    tenant = asyncio.run(auth.authenticate(issued.key))
    assert tenant is not None
    assert asyncio.run(auth.revoke(tenant)) is True
    assert asyncio.run(auth.authenticate(issued.key)) is None
    fresh = DatabaseAuthenticator(harness.db)  # and the database agrees (another gateway, no cache)
    assert asyncio.run(fresh.authenticate(issued.key)) is None


def test_the_gateway_remembers_failures_and_looks_keys_up_on_its_bounded_pool(harness: Harness) -> None:
    settings = GatewaySettings(blocking_threads=2, edge_failed_auth_per_minute=None)
    auth = DatabaseAuthenticator(harness.db, failure_seconds=settings.auth_failure_cache_seconds)
    app = create_app(settings, harness.control, auth)
    bad = generate_api_key()
    with TestClient(app) as http, _watching(harness.db) as sql:
        first = http.get("/api/v1/get_server_capabilities", headers={"X-API-Key": bad})
        assert first.status_code == 401, first.text
        assert sql.threads and all(t.startswith("carpool-blocking") for t in sql.threads), sql.threads
        looked_up = len(sql)
        for _ in range(5):
            assert http.get("/api/v1/get_server_capabilities", headers={"X-API-Key": bad}).status_code == 401
        assert len(sql) == looked_up


def test_a_key_revoked_on_one_gateway_stops_working_on_another_at_once(harness: Harness) -> None:
    require_redis(REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    prefix = f"test-auth-{uuid.uuid4().hex[:8]}"
    buses = [RedisAuthInvalidations(client, prefix=prefix) for _ in range(2)]
    with harness.db.sessions.begin() as db:
        _, issued = create_tenant_with_key(db, "two-gateways")
        _, other = create_tenant_with_key(db, "bystander")
    try:
        # Caches far longer than the test: only the invalidation can make gateway B forget the key.
        a, b = (DatabaseAuthenticator(harness.db, cache_seconds=3600, bus=bus) for bus in buses)
        tenant = asyncio.run(a.authenticate(issued.key))
        assert tenant is not None and asyncio.run(b.authenticate(issued.key)) is not None
        assert asyncio.run(b.authenticate(other.key)) is not None
        assert asyncio.run(a.revoke(tenant)) is True
        deadline = time.monotonic() + 10  # pub/sub delivers in milliseconds; this only bounds a hang
        while asyncio.run(b.authenticate(issued.key)) is not None:
            assert time.monotonic() < deadline, "gateway B kept serving the revoked key from its cache"
            time.sleep(0.01)
        assert asyncio.run(b.authenticate(other.key)) is not None  # other tenants' keys are untouched
    finally:
        for bus in buses:
            bus.close()
        client.close()


def test_carpool_tenants_disable_ends_cached_logins_on_every_gateway(harness: Harness, tmp_path: Path) -> None:
    require_redis(REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    prefix = f"test-auth-{uuid.uuid4().hex[:8]}"
    bus = RedisAuthInvalidations(client, prefix=prefix)
    with harness.db.sessions.begin() as db:
        _, issued = create_tenant_with_key(db, "to-disable")
    try:
        gateway = DatabaseAuthenticator(harness.db, cache_seconds=3600, bus=bus)
        assert asyncio.run(gateway.authenticate(issued.key)) is not None
        # What `carpool tenants disable to-disable --redis-url ...` runs, on the harness's database.
        set_disabled(ServiceSettings(data_dir=tmp_path), "to-disable", True,
                     announce=redis_announcer(REDIS_URL, prefix))
        deadline = time.monotonic() + 10  # bounds a hang only
        while asyncio.run(gateway.authenticate(issued.key)) is not None:
            assert time.monotonic() < deadline, "the disabled tenant's key kept working from the cache"
            time.sleep(0.01)
    finally:
        bus.close()
        client.close()


def test_carpool_keys_revoke_ends_that_key_on_every_gateway_and_no_other(harness: Harness, tmp_path: Path) -> None:
    """The CLI announces each revoked key, not its whole tenant: an invalidated entry is refused from memory for
    a moment, so a tenant-wide announcement also refused the tenant's other, live keys (401) until it passed."""
    require_redis(REDIS_URL)
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    prefix = f"test-auth-{uuid.uuid4().hex[:8]}"
    bus = RedisAuthInvalidations(client, prefix=prefix)
    settings = ServiceSettings(data_dir=tmp_path)  # the harness's database
    with harness.db.sessions.begin() as db:
        _, revoked = create_tenant_with_key(db, "two-keys")
    _, survivor = create_key(settings, "two-keys")
    try:
        gateway = DatabaseAuthenticator(harness.db, cache_seconds=3600, failure_seconds=60, bus=bus)
        assert all(asyncio.run(gateway.authenticate(k.key)) is not None for k in (revoked, survivor))
        # What `carpool keys revoke PREFIX --redis-url ...` runs.
        assert revoke_keys(settings, revoked.prefix, announce=redis_announcer(REDIS_URL, prefix)) == 1
        deadline = time.monotonic() + 10  # bounds a hang only
        while asyncio.run(gateway.authenticate(revoked.key)) is not None:
            assert time.monotonic() < deadline, "the revoked key kept working from the cache"
            time.sleep(0.01)
        assert asyncio.run(gateway.authenticate(survivor.key)) is not None
    finally:
        bus.close()
        client.close()
