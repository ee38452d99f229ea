"""Repository behaviour on both backends: SQLite (a temp file) and a scratch PostgreSQL database."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.auth.tenants import authenticate, create_tenant_with_key, issue_api_key
from services.db import (
    ConflictError,
    Database,
    NotFoundError,
    hub_pushes,
    request_log,
    runs,
    sessions,
    tenants,
    usage,
)
from services.db import checkpoints as ckpts
from services.db.ids import ApiKeyId, HubPushId, ModelId, SessionId, TenantId
from services.db.testing import wipe_tables

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture
def db(database: Database) -> Iterator[Session]:
    wipe_tables(database.engine)
    with database.sessions.begin() as session:
        yield session


def _tenant(db: Session, name: str = "acme") -> TenantId:
    return TenantId(tenants.create_tenant(db, name).id)


def _run(db: Session, tenant_id: TenantId, n: int = 0) -> tuple[SessionId, ModelId]:
    session_id = SessionId(sessions.create_session(db, tenant_id).id)
    run = runs.create_training_run(db, tenant_id, session_id, n, base_model="smol", lora_rank=8)
    return session_id, ModelId(run.id)


def test_tenant_crud_and_quotas(db: Session) -> None:
    quotas = tenants.TenantQuotas(max_models=3, tokens_per_minute=1000)
    row = tenants.create_tenant(db, "acme", quotas=quotas)
    assert row.id.startswith("tenant-") and not row.is_admin and not row.disabled
    assert row.created_at.tzinfo is not None
    with pytest.raises(ConflictError):
        tenants.create_tenant(db, "acme")
    assert tenants.tenant_quotas(row) == quotas
    assert tenants.set_tenant_quotas(db, TenantId(row.id), tenants.TenantQuotas(max_concurrent_requests=2))
    db.expire_all()
    fetched = tenants.get_tenant(db, TenantId(row.id))
    assert fetched is not None and fetched.max_models is None and fetched.max_concurrent_requests == 2
    assert tenants.get_tenant_by_name(db, "acme") is fetched
    assert tenants.set_tenant_disabled(db, TenantId(row.id), True)
    assert not tenants.set_tenant_disabled(db, TenantId("tenant-nope"), True)
    tenants.create_tenant(db, "beta")
    assert [t.name for t in tenants.list_tenants(db)] == ["acme", "beta"]
    assert [t.name for t in tenants.list_tenants(db, limit=1, offset=1)] == ["beta"]
    with pytest.raises(ValueError):
        tenants.list_tenants(db, limit=0)


def test_authenticate_accepts_live_keys_only(db: Session) -> None:
    tenant, issued = create_tenant_with_key(db, "acme", pepper=b"pep")
    assert authenticate(db, issued.key, pepper=b"pep", now=T0) == tenant
    assert authenticate(db, issued.key) is None  # wrong pepper
    assert authenticate(db, "tml-" + "x" * 43, pepper=b"pep") is None
    assert authenticate(db, "not a key", pepper=b"pep") is None
    (stored,) = tenants.list_api_keys(db, tenant.id)
    assert stored.key_hash != issued.key and issued.key not in stored.key_hash
    assert stored.prefix == issued.prefix and stored.last_used_at == T0

    second = issue_api_key(db, tenant.id, pepper=b"pep")
    assert tenants.revoke_api_key(db, tenant.id, issued.key_id)
    assert not tenants.revoke_api_key(db, tenant.id, issued.key_id)
    assert authenticate(db, issued.key, pepper=b"pep") is None
    assert authenticate(db, second.key, pepper=b"pep") is not None
    assert [k.id for k in tenants.list_api_keys(db, tenant.id)] == [second.key_id]
    assert len(tenants.list_api_keys(db, tenant.id, include_revoked=True)) == 2

    tenants.set_tenant_disabled(db, tenant.id, True)
    db.expire_all()
    assert authenticate(db, second.key, pepper=b"pep") is None


def test_touch_api_key_is_throttled(db: Session) -> None:
    tenant, issued = create_tenant_with_key(db, "acme")
    authenticate(db, issued.key, now=T0)
    authenticate(db, issued.key, now=T0 + timedelta(seconds=30))
    db.expire_all()
    assert tenants.list_api_keys(db, tenant.id)[0].last_used_at == T0
    authenticate(db, issued.key, now=T0 + timedelta(seconds=90))
    db.expire_all()
    assert tenants.list_api_keys(db, tenant.id)[0].last_used_at == T0 + timedelta(seconds=90)


class _Statements(list[str]):
    """SQL statements sent on a connection while `record` listens."""

    def record(self, conn: object, cursor: object, statement: str, *args: object) -> None:
        self.append(statement)


def _recording(db: Session) -> _Statements:
    statements = _Statements()
    event.listen(db.get_bind(), "before_cursor_execute", statements.record)
    return statements


def test_authenticating_a_recently_used_key_writes_nothing(db: Session) -> None:
    # Every gateway auth-cache miss runs `authenticate`; with hundreds of tenants that is many per second,
    # and an UPDATE each (even one matching no row) takes SQLite's single write lock.
    tenant, issued = create_tenant_with_key(db, "acme")
    authenticate(db, issued.key, now=T0)
    db.expire_all()
    statements = _recording(db)
    try:
        assert authenticate(db, issued.key, now=T0 + timedelta(seconds=59)) == tenant
    finally:
        event.remove(db.get_bind(), "before_cursor_execute", statements.record)
    assert statements and all(s.lstrip().upper().startswith("SELECT") for s in statements)
    db.expire_all()
    assert tenants.list_api_keys(db, tenant.id)[0].last_used_at == T0


def test_authenticating_a_key_is_one_statement(db: Session) -> None:
    # At 512 tenants most requests miss the gateway's 5 s auth cache: key and tenant come in one SELECT.
    tenant, issued = create_tenant_with_key(db, "acme")
    authenticate(db, issued.key, now=T0)
    db.expire_all()
    statements = _recording(db)
    try:
        assert authenticate(db, issued.key, now=T0 + timedelta(seconds=1)) == tenant
        assert authenticate(db, "tml-" + "x" * 43, now=T0) is None
    finally:
        event.remove(db.get_bind(), "before_cursor_execute", statements.record)
    assert len(statements) == 2  # one per lookup, the unknown key's included


def test_revoke_by_prefix(db: Session) -> None:
    tenant_id = _tenant(db)
    issued = issue_api_key(db, tenant_id)
    assert tenants.revoke_api_keys_by_prefix(db, tenant_id, issued.prefix) == 1
    assert tenants.revoke_api_keys_by_prefix(db, tenant_id, issued.prefix) == 0
    assert tenants.list_api_keys(db, tenant_id) == []


def test_sessions_heartbeat_finish_and_stale_sweep(db: Session) -> None:
    tenant_id = _tenant(db)
    row = sessions.create_session(
        db, tenant_id, tags=["a", "b"], user_metadata={"k": 1}, sdk_version="0.38", now=T0
    )
    session_id = SessionId(row.id)
    assert row.id.startswith("sess-")
    db.expire_all()
    fetched = sessions.get_session(db, tenant_id, session_id)
    assert fetched is not None and fetched.tags == ["a", "b"] and fetched.user_metadata == {"k": 1}
    assert fetched.created_at == T0
    stale = sessions.find_stale_sessions(db, heartbeat_before=T0 + timedelta(minutes=5))
    assert [s.id for s in stale] == [session_id]
    assert sessions.heartbeat_session(db, tenant_id, session_id, now=T0 + timedelta(minutes=10))
    assert sessions.find_stale_sessions(db, heartbeat_before=T0 + timedelta(minutes=5)) == []
    assert sessions.finish_session(db, tenant_id, session_id, now=T0 + timedelta(hours=1))
    assert not sessions.heartbeat_session(db, tenant_id, session_id)
    assert sessions.list_sessions(db, tenant_id, include_finished=False) == []
    assert len(sessions.list_sessions(db, tenant_id)) == 1


def test_a_heartbeat_within_the_write_interval_only_reads(db: Session) -> None:
    tenant_id = _tenant(db)
    session_id = SessionId(sessions.create_session(db, tenant_id, now=T0).id)
    statements = _recording(db)
    try:
        assert sessions.heartbeat_session(db, tenant_id, session_id, now=T0 + timedelta(seconds=29),
                                          min_interval_s=30)
        assert statements and all(s.lstrip().upper().startswith("SELECT") for s in statements)
        assert sessions.heartbeat_session(db, tenant_id, session_id, now=T0 + timedelta(seconds=31),
                                          min_interval_s=30)
        assert any(s.lstrip().upper().startswith("UPDATE") for s in statements)
    finally:
        event.remove(db.get_bind(), "before_cursor_execute", statements.record)
    db.expire_all()
    fetched = sessions.get_session(db, tenant_id, session_id)
    assert fetched is not None and fetched.last_heartbeat_at == T0 + timedelta(seconds=31)
    assert not sessions.heartbeat_session(db, TenantId("tenant-other"), session_id, min_interval_s=30)
    sessions.finish_session(db, tenant_id, session_id, now=T0 + timedelta(seconds=40))
    assert not sessions.heartbeat_session(db, tenant_id, session_id, now=T0 + timedelta(seconds=41),
                                          min_interval_s=30)


def test_training_runs_are_idempotent_and_count_quota(db: Session) -> None:
    tenant_id = _tenant(db)
    session_id, model_id = _run(db, tenant_id)
    assert model_id == f"{session_id}:train:0"
    again = runs.create_training_run(db, tenant_id, session_id, 0, base_model="other", lora_rank=4)
    assert again.id == model_id and again.base_model == "smol"
    runs.create_training_run(
        db, tenant_id, session_id, 1, base_model="smol", lora_rank=8, lora_config={"a": 1}
    )
    assert runs.count_active_training_runs(db, tenant_id) == 2
    assert runs.set_training_run_status(db, tenant_id, model_id, "unloaded")
    assert runs.count_active_training_runs(db, tenant_id) == 1
    listed = runs.list_training_runs(db, tenant_id, session_id=session_id)
    assert {r.id for r in listed} == {model_id, f"{session_id}:train:1"}
    with pytest.raises(NotFoundError):
        runs.create_training_run(db, tenant_id, SessionId("sess-missing"), 0, base_model="x", lora_rank=1)


def test_reserve_seq_id(db: Session) -> None:
    tenant_id = _tenant(db)
    _, model_id = _run(db, tenant_id)
    assert runs.reserve_seq_id(db, tenant_id, model_id) == 0
    assert runs.reserve_seq_id(db, tenant_id, model_id) == 1
    assert runs.reserve_seq_id(db, tenant_id, model_id, 10, now=T0) == 10
    assert runs.reserve_seq_id(db, tenant_id, model_id, 3) == 3  # an older number does not move it back
    assert runs.reserve_seq_id(db, tenant_id, model_id) == 11
    assert runs.reserve_seq_id(db, tenant_id, ModelId("sess-x:train:0")) is None
    db.expire_all()
    run = runs.get_training_run(db, tenant_id, model_id)
    assert run is not None and run.next_seq_id == 12 and run.last_request_at is not None


def test_sampling_sessions(db: Session) -> None:
    tenant_id = _tenant(db)
    session_id = SessionId(sessions.create_session(db, tenant_id).id)
    row = runs.create_sampling_session(
        db, tenant_id, session_id, 0, base_model="smol", model_path="tinker://x"
    )
    assert row.id == f"{session_id}:sample:0"
    assert runs.create_sampling_session(db, tenant_id, session_id, 0, base_model="other").base_model == "smol"
    assert [s.id for s in runs.list_sampling_sessions(db, tenant_id, session_id=session_id)] == [row.id]


def test_request_lifecycle(db: Session) -> None:
    tenant_id = _tenant(db)
    _, model_id = _run(db, tenant_id)
    req = request_log.record_request(db, tenant_id, "forward_backward", model_id=model_id, seq_id=0, now=T0)
    req_id = req.id
    assert request_log.count_unfinished_requests(db, tenant_id) == 1
    assert request_log.mark_request_running(db, tenant_id, req_id, pass_id="pass-1", now=T0)
    assert not request_log.mark_request_running(db, tenant_id, req_id)
    assert request_log.mark_request_done(db, tenant_id, req_id, num_tokens=42, now=T0 + timedelta(seconds=1))
    assert not request_log.mark_request_failed(db, tenant_id, req_id, error="late")
    db.expire_all()
    done = request_log.get_request(db, tenant_id, req_id)
    assert done is not None and done.status == "done" and done.num_tokens == 42 and done.pass_id == "pass-1"
    assert request_log.count_unfinished_requests(db, tenant_id) == 0

    other = request_log.record_request(db, tenant_id, "sample")
    assert request_log.mark_request_failed(db, tenant_id, other.id, error="boom", category="user")
    queued = request_log.record_request(db, tenant_id, "optim_step", model_id=model_id, seq_id=1)
    assert request_log.fail_unfinished_requests(db, error="server restarted") == 1
    assert [r.id for r in request_log.list_requests(db, tenant_id, status="failed")] == [queued.id, other.id]
    assert len(request_log.list_requests(db, tenant_id, model_id=model_id)) == 2


def test_finishing_without_a_running_report_records_pass_and_start(db: Session) -> None:
    tenant_id = _tenant(db)
    _, model_id = _run(db, tenant_id)
    quick = request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=1, now=T0)
    slow = request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=2, now=T0)
    broken = request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=3, now=T0)
    later = T0 + timedelta(seconds=5)
    assert request_log.mark_request_done(db, tenant_id, quick.id, num_tokens=3, pass_id="p1", started_at=T0)
    assert request_log.mark_request_running(db, tenant_id, slow.id, pass_id="p2", now=T0)
    assert request_log.mark_request_done(db, tenant_id, slow.id, num_tokens=3, pass_id="p2", started_at=later)
    assert request_log.mark_request_failed(db, tenant_id, broken.id, error="x", pass_id="p3", started_at=later)
    assert not request_log.mark_request_running(db, tenant_id, quick.id, pass_id="p1")  # too late: no change
    db.expire_all()
    rows = {r.id: r for r in request_log.list_requests(db, tenant_id)}
    assert (rows[quick.id].status, rows[quick.id].pass_id, rows[quick.id].started_at) == ("done", "p1", T0)
    assert rows[slow.id].started_at == T0  # the running report's time stays
    assert (rows[broken.id].status, rows[broken.id].pass_id, rows[broken.id].started_at) == ("failed", "p3", later)


def test_duplicate_seq_id_on_a_model_is_rejected(database: Database) -> None:
    wipe_tables(database.engine)
    with database.sessions.begin() as db:
        tenant_id = _tenant(db)
        _, model_id = _run(db, tenant_id)
        request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=5)
        request_log.record_request(db, tenant_id, "sample")  # NULL model / seq ids never collide
        request_log.record_request(db, tenant_id, "sample")
    with pytest.raises(IntegrityError), database.sessions.begin() as db:
        request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=5)


def test_checkpoints_publish_ttl_delete(db: Session) -> None:
    tenant_id = _tenant(db)
    _, model_id = _run(db, tenant_id)

    def save(name: str, kind: ckpts.CheckpointKind, at: datetime) -> str:
        prefix = "weights" if kind == "training" else "sampler_weights"
        path = f"tinker://{model_id}/{prefix}/{name}"
        ckpts.create_checkpoint(
            db,
            tenant_id,
            model_id,
            f"{prefix}/{name}",
            kind=kind,
            tinker_path=path,
            storage_uri=f"file:///data/{name}",
            size_bytes=100,
            now=at,
        )
        return path

    first = save("c1", "training", T0)
    second = save("c2", "training", T0 + timedelta(minutes=1))
    sampler = save("s1", "sampler", T0 + timedelta(minutes=2))
    with pytest.raises(ConflictError):
        save("c1", "training", T0)
    with pytest.raises(NotFoundError):
        ckpts.create_checkpoint(
            db,
            tenant_id,
            ModelId("sess-x:train:9"),
            "weights/a",
            kind="training",
            tinker_path="tinker://sess-x:train:9/weights/a",
            storage_uri="file:///x",
        )
    assert [c.tinker_path for c in ckpts.list_checkpoints_for_run(db, tenant_id, model_id)] == [
        first,
        second,
        sampler,
    ]
    assert [c.tinker_path for c in ckpts.list_checkpoints(db, tenant_id, kind="training")] == [second, first]
    latest = ckpts.latest_checkpoint(db, tenant_id, model_id, "training")
    assert latest is not None and latest.tinker_path == second
    assert ckpts.checkpoint_storage_bytes(db, tenant_id) == 300

    assert ckpts.set_checkpoint_public(db, tenant_id, first, True)
    assert ckpts.set_checkpoint_expiry(db, tenant_id, second, T0 + timedelta(hours=1))
    expired = ckpts.find_expired_checkpoints(db, now=T0 + timedelta(hours=2))
    assert [c.tinker_path for c in expired] == [second]
    assert ckpts.get_readable_checkpoint(db, tenant_id, second, now=T0 + timedelta(hours=2)) is None
    assert ckpts.get_readable_checkpoint(db, tenant_id, second, now=T0) is not None

    deleted = ckpts.delete_checkpoint(db, tenant_id, second)
    assert deleted is not None and deleted.storage_uri == "file:///data/c2"
    assert ckpts.get_checkpoint(db, tenant_id, second) is None
    assert ckpts.delete_checkpoint(db, tenant_id, second) is None


def test_hub_pushes_survive_checkpoint_deletion(db: Session) -> None:
    tenant_id = _tenant(db)
    _, model_id = _run(db, tenant_id)
    path = f"tinker://{model_id}/sampler_weights/final"
    ckpts.create_checkpoint(
        db,
        tenant_id,
        model_id,
        "sampler_weights/final",
        kind="sampler",
        tinker_path=path,
        storage_uri="s3://b/k",
    )
    push = hub_pushes.create_hub_push(db, tenant_id, path, target="hf", repo="acme/lora", private=True)
    push_id = HubPushId(push.id)
    assert push.status == "queued"
    assert not hub_pushes.set_hub_push_status(db, tenant_id, push_id, "queued")
    assert hub_pushes.set_hub_push_status(db, tenant_id, push_id, "running")
    assert hub_pushes.set_hub_push_status(db, tenant_id, push_id, "failed", error="401", now=T0)
    assert not hub_pushes.set_hub_push_status(db, tenant_id, push_id, "done")
    ckpts.delete_checkpoint(db, tenant_id, path)
    db.flush()
    db.expire_all()
    kept = hub_pushes.get_hub_push(db, tenant_id, push_id)
    assert kept is not None and kept.checkpoint_id is None and kept.tinker_path == path
    assert kept.status == "failed" and kept.error == "401" and kept.finished_at == T0
    assert [p.id for p in hub_pushes.list_hub_pushes(db, tenant_id)] == [push_id]
    with pytest.raises(NotFoundError):
        hub_pushes.create_hub_push(db, tenant_id, "tinker://nope/weights/x", target="ms", repo="r")


def test_marking_a_pass_done_at_once_equals_marking_each_request(db: Session) -> None:
    """`mark_requests_done` (one executemany per shape, what the completion hook uses) writes what one
    `mark_request_done` per request writes: loss or not, a running report's start kept, finished ones left."""
    tenant_id, other = _tenant(db), _tenant(db, "other")
    _, model_id = _run(db, tenant_id)
    _, other_model = _run(db, other, 1)
    fresh = request_log.record_request(db, tenant_id, "forward_backward", model_id=model_id, seq_id=1, now=T0)
    running = request_log.record_request(db, tenant_id, "optim_step", model_id=model_id, seq_id=2, now=T0)
    theirs = request_log.record_request(db, other, "forward_backward", model_id=other_model, seq_id=1, now=T0)
    ended = request_log.record_request(db, tenant_id, "forward", model_id=model_id, seq_id=3, now=T0)
    assert request_log.mark_request_running(db, tenant_id, running.id, pass_id="p0", now=T0)
    assert request_log.mark_request_failed(db, tenant_id, ended.id, error="x")
    later = T0 + timedelta(seconds=3)
    request_log.mark_requests_done(db, [
        request_log.DoneMark(tenant_id, fresh.id, 32, loss=1.5),
        request_log.DoneMark(tenant_id, running.id, 0),
        request_log.DoneMark(other, theirs.id, 16, loss=0.25),
        request_log.DoneMark(tenant_id, ended.id, 8),  # already failed: stays failed
        request_log.DoneMark(other, fresh.id, 99),  # another tenant's request: untouched
    ], pass_id="p1", started_at=later, now=later)
    db.expire_all()
    rows = {r.id: r for r in [*request_log.list_requests(db, tenant_id), *request_log.list_requests(db, other)]}
    assert (rows[fresh.id].status, rows[fresh.id].num_tokens, rows[fresh.id].loss) == ("done", 32, 1.5)
    assert (rows[fresh.id].pass_id, rows[fresh.id].started_at, rows[fresh.id].finished_at) == ("p1", later, later)
    assert (rows[running.id].status, rows[running.id].loss, rows[running.id].started_at) == ("done", None, T0)
    assert (rows[theirs.id].status, rows[theirs.id].num_tokens, rows[theirs.id].loss) == ("done", 16, 0.25)
    assert (rows[ended.id].status, rows[ended.id].num_tokens) == ("failed", None)
    request_log.mark_requests_done(db, [])  # nothing to write is fine


def test_usage_of_many_tenants_at_once_equals_one_increment_each(db: Session) -> None:
    tenant_id, other = _tenant(db), _tenant(db, "other")
    usage.record_usage(db, tenant_id, "forward_backward", tokens=10, now=T0)
    usage.record_usage_many(db, {(tenant_id, "forward_backward"): (32, 2), (other, "forward_backward"): (5, 1),
                                 (tenant_id, "optim_step"): (0, 1)}, now=T0 + timedelta(minutes=5))
    totals = usage.usage_totals(db, tenant_id, since=T0 - timedelta(days=1))
    assert totals == {"forward_backward": usage.UsageTotal("forward_backward", 42, 3),
                      "optim_step": usage.UsageTotal("optim_step", 0, 1)}
    assert usage.usage_totals(db, other, since=T0 - timedelta(days=1)) == {
        "forward_backward": usage.UsageTotal("forward_backward", 5, 1)}
    usage.record_usage_many(db, {})
    with pytest.raises(ValueError):
        usage.record_usage_many(db, {(tenant_id, "x"): (-1, 1)})


def test_usage_buckets_accumulate(db: Session) -> None:
    tenant_id = _tenant(db)
    other = _tenant(db, "other")
    usage.record_usage(db, tenant_id, "train_tokens", tokens=100, now=T0)
    usage.record_usage(db, tenant_id, "train_tokens", tokens=50, now=T0 + timedelta(minutes=30))
    usage.record_usage(db, tenant_id, "train_tokens", tokens=7, now=T0 + timedelta(hours=1))
    usage.record_usage(db, tenant_id, "sample_tokens", tokens=5, requests=2, now=T0)
    usage.record_usage(db, other, "train_tokens", tokens=1000, now=T0)
    buckets = usage.usage_buckets(db, tenant_id, since=T0, kind="train_tokens")
    assert [(b.bucket_start, b.tokens, b.requests) for b in buckets] == [
        (usage.hour_bucket(T0), 150, 2),
        (usage.hour_bucket(T0) + timedelta(hours=1), 7, 1),
    ]
    totals = usage.usage_totals(db, tenant_id, since=T0 - timedelta(days=1))
    assert totals == {
        "train_tokens": usage.UsageTotal("train_tokens", 157, 3),
        "sample_tokens": usage.UsageTotal("sample_tokens", 5, 2),
    }
    until = usage.usage_totals(db, tenant_id, since=T0, until=usage.hour_bucket(T0) + timedelta(hours=1))
    assert until["train_tokens"].tokens == 150
    with pytest.raises(ValueError):
        usage.record_usage(db, tenant_id, "x", tokens=-1)


def test_api_key_row_id_is_typed(db: Session) -> None:
    tenant_id = _tenant(db)
    issued = issue_api_key(db, tenant_id)
    assert isinstance(issued.key_id, int)
    assert tenants.revoke_api_key(db, tenant_id, ApiKeyId(issued.key_id))
