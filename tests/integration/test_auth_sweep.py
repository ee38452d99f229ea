"""The gateway's API-key cache re-checks the keys in use together (one statement for all of them, every half
cache interval) instead of looking each key up again when its entry expires, and keeps the cache's promise
while doing so: a key revoked or a tenant disabled elsewhere (another gateway, the CLI, straight in the
database) stops working within `cache_seconds`, a revocation that lands during a re-check is not undone, and
a tenant's changed quotas reach the cache. Run on SQLite and PostgreSQL; time is a fake clock."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event, update

from gateway.auth import DatabaseAuthenticator
from services.auth.invalidation import Invalidation
from services.auth.tenants import IssuedKey, Tenant, create_tenant_with_key
from services.db import Database
from services.db.ids import ApiKeyId
from services.db.models import TenantRow
from services.db.tenants import revoke_api_key
from tests.fake_clock import FakeClock

CACHE_S = 10.0


@contextmanager
def _statements(database: Database) -> Iterator[list[str]]:
    seen: list[str] = []

    def note(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        seen.append(statement)

    event.listen(database.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(database.engine, "before_cursor_execute", note)


def _tenants(database: Database, n: int) -> list[tuple[Tenant, IssuedKey]]:
    tag = uuid.uuid4().hex[:8]
    with database.sessions.begin() as db:
        return [create_tenant_with_key(db, f"sweep-{tag}-{i}") for i in range(n)]


def _all(auth: DatabaseAuthenticator, keys: list[str]) -> list[Tenant | None]:
    async def go() -> list[Tenant | None]:
        return [await auth.authenticate(key) for key in keys]

    return asyncio.run(go())


def test_keys_in_use_are_rechecked_together_not_looked_up_one_by_one(database: Database) -> None:
    issued = _tenants(database, 20)
    keys = [key.key for _, key in issued]
    clock = FakeClock()
    auth = DatabaseAuthenticator(database, cache_seconds=CACHE_S, clock=clock)
    with _statements(database) as sql:
        assert [t.id for t in _all(auth, keys) if t] == [t.id for t, _ in issued]
        assert len(sql) >= 20  # each new key is looked up once
    for at in (1.0, 6.0, 12.0, 18.0, 24.0):  # well past the first entries' expiry (10 s)
        clock.now = 1000.0 + at
        with _statements(database) as sql:
            assert [t.id for t in _all(auth, keys) if t] == [t.id for t, _ in issued]
        # At most one re-check of all twenty keys (a SELECT; an UPDATE of last_used_at only once a minute).
        assert len(sql) <= 2, sql


def test_a_key_presented_less_often_than_the_cache_interval_stays_cached_while_in_use(database: Database) -> None:
    """At 512 tenants a client may call every 10-15 s (its step waits behind the others'): longer than the
    cache interval, so a re-check of only the keys used since the last one let its entry lapse between calls."""
    issued = _tenants(database, 6)
    driver, sparse = issued[0][1].key, [key.key for _, key in issued[1:]]
    clock = FakeClock()
    auth = DatabaseAuthenticator(database, cache_seconds=CACHE_S, clock=clock)
    assert all(_all(auth, [driver, *sparse]))
    with _statements(database) as sql:
        for step in range(1, 16):  # 60 s: the driver calls every 4 s, the others every 12 s
            clock.now = 1000.0 + 4.0 * step
            assert all(_all(auth, [driver, *sparse] if step % 3 == 0 else [driver]))
    assert not [statement for statement in sql if "key_hash" in statement], "a key in use was looked up again"
    assert 0 < len(sql) <= 2 * 15


def test_a_key_revoked_or_a_tenant_disabled_elsewhere_stops_working_within_the_cache_interval(
        database: Database) -> None:
    (revoked, revoked_key), (disabled, disabled_key), (_, kept_key) = _tenants(database, 3)
    keys = [revoked_key.key, disabled_key.key, kept_key.key]
    clock = FakeClock()
    auth = DatabaseAuthenticator(database, cache_seconds=CACHE_S, failure_seconds=3600, clock=clock)
    assert all(_all(auth, keys))
    with database.sessions.begin() as db:  # as another gateway without a bus, or the CLI, would
        assert revoke_api_key(db, revoked.id, revoked_key.key_id)
        db.execute(update(TenantRow).where(TenantRow.id == disabled.id).values(disabled=True))
    clock.now += 1.0
    assert all(_all(auth, keys))  # still cached: the promise is "within cache_seconds", not at once
    clock.now += CACHE_S / 2
    results = _all(auth, keys)
    assert results[0] is None and results[1] is None and results[2] is not None
    clock.now += CACHE_S * 3
    assert _all(auth, keys)[:2] == [None, None]  # remembered as failures, and the database agrees


def test_a_revocation_during_a_recheck_is_not_undone(database: Database) -> None:
    (tenant, issued), (_, other) = _tenants(database, 2)
    clock = FakeClock()
    auth = DatabaseAuthenticator(database, cache_seconds=CACHE_S, failure_seconds=3600, clock=clock)
    assert all(_all(auth, [issued.key, other.key]))
    recheck = auth._revalidate
    seen = threading.Event()

    def revoked_meanwhile(key_ids: list[ApiKeyId]) -> dict[ApiKeyId, Tenant]:
        answer = recheck(key_ids)  # read while the key was still live...
        auth.invalidate(Invalidation(tenant.id, issued.key_id))  # ...and revoked before the answer lands
        seen.set()
        return answer

    auth._revalidate = revoked_meanwhile  # type: ignore[method-assign]
    clock.now += CACHE_S / 2 + 0.1
    assert _all(auth, [other.key, issued.key]) == [_all(auth, [other.key])[0], None]
    assert seen.is_set()


def test_a_cache_dropped_during_a_recheck_looks_the_key_up_again_rather_than_refusing_it(database: Database) -> None:
    """A gateway whose invalidation bus resubscribes forgets its whole cache (it may have missed revocations);
    a request whose re-check ran meanwhile found its entry gone. Make chaos (a Redis restart) saw a 401 here."""
    [(tenant, issued)] = _tenants(database, 1)
    clock = FakeClock()
    auth = DatabaseAuthenticator(database, cache_seconds=CACHE_S, failure_seconds=3600, clock=clock)
    assert all(_all(auth, [issued.key]))
    recheck = auth._revalidate

    def cache_dropped_meanwhile(key_ids: list[ApiKeyId]) -> dict[ApiKeyId, Tenant]:
        answer = recheck(key_ids)
        auth.invalidate(Invalidation.everything())
        return answer

    auth._revalidate = cache_dropped_meanwhile  # type: ignore[method-assign]
    clock.now += CACHE_S / 2 + 0.1
    [again] = _all(auth, [issued.key])
    assert again is not None and again.id == tenant.id


def test_a_recheck_reads_the_tenants_changed_quotas(database: Database) -> None:
    [(tenant, issued)] = _tenants(database, 1)
    clock = FakeClock()
    auth = DatabaseAuthenticator(database, cache_seconds=CACHE_S, clock=clock)
    [before] = _all(auth, [issued.key])
    assert before is not None and before.quotas.max_models is None
    with database.sessions.begin() as db:
        db.execute(update(TenantRow).where(TenantRow.id == tenant.id).values(max_models=3))
    clock.now += CACHE_S / 2 + 0.1
    [after] = _all(auth, [issued.key])
    assert after is not None and after.quotas.max_models == 3
