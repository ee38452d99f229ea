"""The dashboard's read models and sessions on PostgreSQL (the e2e server runs SQLite; production does not).

Usage is summed by day with `date_trunc` here (SQLite: `date()`), audit ids are BIGINT, and every listing
pages with one extra row instead of a COUNT. Written through the real repositories into a scratch database.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from services.admin import actions, queries
from services.admin.actions import Actor
from services.admin.sessions import close_session, open_session, resolve_session
from services.db import Database, open_database
from services.db.audit import list_audit
from services.db.ids import TenantId
from services.db.request_log import mark_request_done, mark_request_running, record_request
from services.db.runs import create_training_run
from services.db.sessions import create_session
from services.db.testing import scratch_postgres_database
from services.db.usage import record_usage
from tests.required import require_postgres

NOW = datetime(2026, 12, 1, 15, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def db() -> Iterator[Database]:
    require_postgres()
    with scratch_postgres_database(prefix="carpool_test_admin") as url:
        database = open_database(url, migrate=True)
        try:
            yield database
        finally:
            database.dispose()


def test_listings_page_and_aggregate_on_postgres(db: Database) -> None:
    actor = Actor("tenant-root", "tml-rootroot")
    with db.sessions.begin() as s:
        tenants = [actions.create_tenant(s, actor, f"pg-{i}")[0] for i in range(3)]
        t0 = TenantId(tenants[0].id)
        session = create_session(s, t0, now=NOW)
        run = create_training_run(s, t0, session.id, 0, base_model="m", lora_rank=4, now=NOW)
        for seq, kind in enumerate(["forward_backward", "optim_step", "forward_backward", "optim_step"], 1):
            request = record_request(s, t0, kind, model_id=run.id, seq_id=seq, now=NOW)
            mark_request_running(s, t0, request.id, pass_id=f"pass-{seq}", now=NOW + timedelta(seconds=1))
            mark_request_done(s, t0, request.id, num_tokens=100, now=NOW + timedelta(seconds=2),
                              loss=5.0 / seq if kind == "forward_backward" else None)
        for day in range(3):
            record_usage(s, t0, "forward_backward", tokens=10 + day, now=NOW - timedelta(days=day))
        record_usage(s, t0, "sample", tokens=7, now=NOW)
        actions.set_disabled(s, actor, TenantId(tenants[2].id), True)

    with db.sessions.begin() as s:
        first = queries.tenants(s, queries.Page(2), today=queries.day_start(NOW))
        assert [t.name for t in first.rows] == ["pg-0", "pg-1"] and first.more
        assert first.rows[0].tokens_trained_today == 10 and first.rows[0].tokens_sampled_today == 7
        assert queries.tenants(s, queries.Page(2, 2), today=NOW).rows[0].disabled

        runs = queries.runs(s, queries.Page(10), tenant_id=t0)
        assert [(r.id, r.steps) for r in runs.rows] == [(run.id, 2)] and not runs.more
        detail = queries.run_detail(s, run.id)
        assert detail is not None and detail.losses == [(1, 5.0), (3, 5.0 / 3)]

        failed = queries.requests(s, queries.Page(10), queries.RequestFilter(status="failed"))
        assert failed.rows == []
        steps = queries.requests(s, queries.Page(1), queries.RequestFilter(tenant_id=t0, kind="optim_step"))
        assert len(steps.rows) == 1 and steps.more and steps.rows[0].wait_s == 1.0

        usage = queries.usage_by_day(s, queries.Page(10), since=queries.days_ago(NOW, 1), tenant_id=t0)
        assert [(u.day.isoformat(), u.kind, u.tokens) for u in usage.rows] == [
            ("2026-12-01", "forward_backward", 10), ("2026-12-01", "sample", 7), ("2026-11-30", "forward_backward", 11)]

        passes = queries.recent_passes(s, limit=10)
        assert {p.pass_id for p in passes} == {"pass-1", "pass-3"} and all(p.tenants == ["pg-0"] for p in passes)
        standing = queries.standings(s, since=NOW - timedelta(hours=1))
        assert [(x.tenant_name, x.share, x.fair_share) for x in standing] == [("pg-0", 1.0, 1.0)]

        audit = list_audit(s, tenant_id=None, limit=2, before_id=None)
        assert [e.action for e in audit] == ["tenant.disable", "tenant.create"] and audit[0].id > audit[1].id
        assert audit[0].actor_key_prefix == "tml-rootroot"


def test_sessions_end_at_logout_expiry_and_key_revocation(db: Database) -> None:
    actor = Actor()
    with db.sessions.begin() as s:
        tenant, issued = actions.create_tenant(s, actor, "pg-admin", is_admin=True)
        plain, plain_key = actions.create_tenant(s, actor, "pg-plain")
        tid = TenantId(tenant.id)
        live = open_session(s, tenant_id=tid, api_key_id=issued.key_id, ttl=timedelta(hours=1))
        logged_out = open_session(s, tenant_id=tid, api_key_id=issued.key_id, ttl=timedelta(hours=1))
        expired = open_session(s, tenant_id=tid, api_key_id=issued.key_id, ttl=timedelta(minutes=1),
                               now=datetime.now(UTC) - timedelta(hours=1))
        not_admin = open_session(s, tenant_id=TenantId(plain.id), api_key_id=plain_key.key_id,
                                 ttl=timedelta(hours=1))
        close_session(s, logged_out)
    with db.sessions.begin() as s:
        found = resolve_session(s, live)
        assert found is not None and found.key_prefix == issued.prefix and found.tenant_name == "pg-admin"
        assert [resolve_session(s, t) for t in (logged_out, expired, not_admin, "nonsense")] == [None] * 4
        assert actions.revoke_key(s, actor, tid, issued.key_id)
    with db.sessions.begin() as s:
        assert resolve_session(s, live) is None
