"""The statements a batched sampling poll and a sample submission run (`services/db/sdk_surface.py`,
`services.control.context.sample_request_for_seq`) are built once with bind parameters and run on the
session's connection. These tests pin what they answer, on SQLite and on PostgreSQL, against the rules
written out here in Python: a session's completions after a cursor in finishing order (done and failed,
its clone's seq ids only, at most `limit`), its oldest unfinished requests, and the first sample request
holding a seq id."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from services.control.context import sample_request_for_seq
from services.db import Database, request_log, runs, sessions, tenants
from services.db.ids import RequestId, SamplingSessionId, SessionId, TenantId
from services.db.sdk_surface import CLONE_STRIDE, completions_after, to_cursor, unfinished_requests
from services.db.testing import wipe_tables

T0 = datetime(2026, 12, 4, 5, 0, 0, tzinfo=UTC)


@pytest.fixture
def db(database: Database) -> Iterator[Session]:
    wipe_tables(database.engine)
    with database.sessions.begin() as session:
        yield session


def _sampler(db: Session, tenant_id: TenantId, seq: int) -> SamplingSessionId:
    session_id = SessionId(sessions.create_session(db, tenant_id).id)
    return SamplingSessionId(runs.create_sampling_session(db, tenant_id, session_id, seq, base_model="smol").id)


def _log(db: Session, tenant_id: TenantId, sampler: SamplingSessionId, seq_id: int, at: datetime) -> RequestId:
    return request_log.record_request(db, tenant_id, "sample", sampling_session_id=sampler, seq_id=seq_id,
                                      now=at).id


def test_completions_and_unfinished_requests_follow_the_rules(db: Session) -> None:
    tenant_id = TenantId(tenants.create_tenant(db, "acme").id)
    mine, other = _sampler(db, tenant_id, 0), _sampler(db, tenant_id, 1)
    rows: dict[RequestId, tuple[SamplingSessionId, int, str, datetime | None, datetime]] = {}
    for i in range(12):
        sampler = other if i % 5 == 4 else mine
        seq_id = i + (CLONE_STRIDE if i % 4 == 3 else 0)  # every fourth one from clone 1
        created = T0 + timedelta(milliseconds=i)
        request_id = _log(db, tenant_id, sampler, seq_id, created)
        finished = T0 + timedelta(seconds=1, microseconds=(37 * i) % 11)  # not in creation order
        status = ("done", "failed", "running", "queued")[i % 4] if i % 3 else "done"
        if status == "done":
            request_log.mark_request_done(db, tenant_id, request_id, now=finished)
        elif status == "failed":
            request_log.mark_request_failed(db, tenant_id, request_id, error="x", now=finished)
        elif status == "running":
            request_log.mark_request_running(db, tenant_id, request_id, now=created)
        rows[request_id] = (sampler, seq_id, status, finished if status in ("done", "failed") else None, created)

    def expected_completions(clone: int, after: datetime, limit: int) -> list[tuple[str, bool, int]]:
        found = [(at, rid, status) for rid, (s, seq, status, at, _) in rows.items()
                 if s == mine and at is not None and at > after and seq // CLONE_STRIDE == clone]
        return [(rid, status == "failed", to_cursor(at)) for at, rid, status in sorted(found)[:limit]]

    def expected_unfinished(clone: int, limit: int) -> list[str]:
        found = [(created, rid) for rid, (s, seq, _, at, created) in rows.items()
                 if s == mine and at is None and seq // CLONE_STRIDE == clone]
        return [rid for _, rid in sorted(found)[:limit]]

    for clone in (0, 1, 2):
        for after in (T0, T0 + timedelta(seconds=1, microseconds=4)):
            for limit in (1, 2, 1000):
                got = completions_after(db, mine, clone, to_cursor(after), limit)
                assert [(c.request_id, c.failed, c.cursor) for c in got] == expected_completions(clone, after, limit)
        for limit in (1, 1000):
            assert unfinished_requests(db, mine, clone, limit) == expected_unfinished(clone, limit)
    assert expected_completions(0, T0, 1000) and expected_unfinished(0, 1000)  # the rules were exercised


def test_a_sample_seq_id_maps_to_its_first_request(db: Session) -> None:
    tenant_id = TenantId(tenants.create_tenant(db, "acme").id)
    sampler, other = _sampler(db, tenant_id, 0), _sampler(db, tenant_id, 1)
    assert sample_request_for_seq(db, sampler, 7) is None
    first = _log(db, tenant_id, sampler, 7, T0)
    _log(db, tenant_id, sampler, 7, T0 + timedelta(seconds=1))  # a later row with the same seq id
    _log(db, tenant_id, other, 8, T0)
    assert sample_request_for_seq(db, sampler, 7) == (first, "queued")
    request_log.mark_request_done(db, tenant_id, first, now=T0 + timedelta(seconds=2))
    assert sample_request_for_seq(db, sampler, 7) == (first, "done")
    assert sample_request_for_seq(db, sampler, 8) is None and sample_request_for_seq(db, other, 8) is not None
