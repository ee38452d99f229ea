"""Tenant isolation: no repository lets tenant B read or change tenant A's rows, on either backend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy.orm import Session

from services.auth.tenants import issue_api_key
from services.db import (
    Database,
    NotFoundError,
    hub_pushes,
    request_log,
    runs,
    sessions,
    tenants,
)
from services.db import checkpoints as ckpts
from services.db.ids import HubPushId, ModelId, RequestId, SamplingSessionId, SessionId, TenantId
from services.db.testing import wipe_tables


@dataclass(frozen=True)
class Owned:
    """Everything tenant A owns, by id."""

    tenant: TenantId
    session: SessionId
    run: ModelId
    sampler: SamplingSessionId
    checkpoint: str
    request: RequestId
    push: HubPushId


@pytest.fixture
def db(database: Database) -> Iterator[Session]:
    wipe_tables(database.engine)
    with database.sessions.begin() as session:
        yield session


@pytest.fixture
def a(db: Session) -> Owned:
    tenant = TenantId(tenants.create_tenant(db, "tenant-a").id)
    session = SessionId(sessions.create_session(db, tenant).id)
    run = ModelId(runs.create_training_run(db, tenant, session, 0, base_model="smol", lora_rank=8).id)
    sampler = SamplingSessionId(runs.create_sampling_session(db, tenant, session, 0, base_model="smol").id)
    path = f"tinker://{run}/weights/c1"
    ckpts.create_checkpoint(
        db, tenant, run, "weights/c1", kind="training", tinker_path=path, storage_uri="file:///c1"
    )
    request = RequestId(request_log.record_request(db, tenant, "forward_backward", model_id=run, seq_id=0).id)
    push = HubPushId(hub_pushes.create_hub_push(db, tenant, path, target="hf", repo="a/x").id)
    return Owned(tenant, session, run, sampler, path, request, push)


@pytest.fixture
def b(db: Session) -> TenantId:
    return TenantId(tenants.create_tenant(db, "tenant-b").id)


def test_owner_sees_everything(db: Session, a: Owned) -> None:
    assert sessions.get_session(db, a.tenant, a.session) is not None
    assert runs.get_training_run(db, a.tenant, a.run) is not None
    assert runs.get_sampling_session(db, a.tenant, a.sampler) is not None
    assert ckpts.get_checkpoint(db, a.tenant, a.checkpoint) is not None
    assert request_log.get_request(db, a.tenant, a.request) is not None
    assert hub_pushes.get_hub_push(db, a.tenant, a.push) is not None


def test_other_tenant_cannot_fetch(db: Session, a: Owned, b: TenantId) -> None:
    assert sessions.get_session(db, b, a.session) is None
    assert runs.get_training_run(db, b, a.run) is None
    assert runs.get_sampling_session(db, b, a.sampler) is None
    assert ckpts.get_checkpoint(db, b, a.checkpoint) is None
    assert ckpts.get_readable_checkpoint(db, b, a.checkpoint) is None
    assert request_log.get_request(db, b, a.request) is None
    assert hub_pushes.get_hub_push(db, b, a.push) is None


def test_other_tenant_lists_nothing(db: Session, a: Owned, b: TenantId) -> None:
    assert sessions.list_sessions(db, b) == []
    assert runs.list_training_runs(db, b) == []
    assert runs.list_training_runs(db, b, session_id=a.session) == []
    assert runs.list_sampling_sessions(db, b, session_id=a.session) == []
    assert ckpts.list_checkpoints(db, b) == []
    assert ckpts.list_checkpoints_for_run(db, b, a.run) == []
    assert ckpts.latest_checkpoint(db, b, a.run, "training") is None
    assert ckpts.checkpoint_storage_bytes(db, b) == 0
    assert request_log.list_requests(db, b) == []
    assert request_log.count_unfinished_requests(db, b) == 0
    assert hub_pushes.list_hub_pushes(db, b) == []
    assert runs.count_active_training_runs(db, b) == 0


def test_other_tenant_cannot_modify(db: Session, a: Owned, b: TenantId) -> None:
    assert not sessions.heartbeat_session(db, b, a.session)
    assert not sessions.finish_session(db, b, a.session)
    assert runs.reserve_seq_id(db, b, a.run) is None
    assert not runs.set_training_run_status(db, b, a.run, "corrupted")
    assert not ckpts.set_checkpoint_public(db, b, a.checkpoint, True)
    assert not ckpts.set_checkpoint_expiry(db, b, a.checkpoint, None)
    assert ckpts.delete_checkpoint(db, b, a.checkpoint) is None
    assert not request_log.mark_request_running(db, b, a.request)
    assert not request_log.mark_request_failed(db, b, a.request, error="x")
    assert not hub_pushes.set_hub_push_status(db, b, a.push, "running")
    db.expire_all()
    # A's rows are untouched.
    session = sessions.get_session(db, a.tenant, a.session)
    assert session is not None and session.finished_at is None
    run = runs.get_training_run(db, a.tenant, a.run)
    assert run is not None and run.next_seq_id == 0 and run.status == "active"
    checkpoint = ckpts.get_checkpoint(db, a.tenant, a.checkpoint)
    assert checkpoint is not None and not checkpoint.public
    request = request_log.get_request(db, a.tenant, a.request)
    assert request is not None and request.status == "queued"


def test_other_tenant_cannot_create_children_of_foreign_rows(db: Session, a: Owned, b: TenantId) -> None:
    with pytest.raises(NotFoundError):
        runs.create_training_run(db, b, a.session, 0, base_model="smol", lora_rank=8)
    with pytest.raises(NotFoundError):
        runs.create_training_run(db, b, a.session, 7, base_model="smol", lora_rank=8)
    with pytest.raises(NotFoundError):
        runs.create_sampling_session(db, b, a.session, 1, base_model="smol")
    with pytest.raises(NotFoundError):
        ckpts.create_checkpoint(
            db,
            b,
            a.run,
            "weights/evil",
            kind="training",
            tinker_path=f"tinker://{a.run}/weights/evil",
            storage_uri="file:///evil",
        )
    with pytest.raises(NotFoundError):
        hub_pushes.create_hub_push(db, b, a.checkpoint, target="hf", repo="b/steal")


def test_public_checkpoints_are_readable_but_still_not_owned(db: Session, a: Owned, b: TenantId) -> None:
    assert ckpts.set_checkpoint_public(db, a.tenant, a.checkpoint, True)
    readable = ckpts.get_readable_checkpoint(db, b, a.checkpoint)
    assert readable is not None and readable.tenant_id == a.tenant
    # Publishing grants loading, not ownership: B still cannot manage, delete or export it.
    assert ckpts.get_checkpoint(db, b, a.checkpoint) is None
    assert ckpts.delete_checkpoint(db, b, a.checkpoint) is None
    assert not ckpts.set_checkpoint_public(db, b, a.checkpoint, False)
    with pytest.raises(NotFoundError):
        hub_pushes.create_hub_push(db, b, a.checkpoint, target="hf", repo="b/steal")


def test_api_keys_are_scoped(db: Session, a: Owned, b: TenantId) -> None:
    issued = issue_api_key(db, a.tenant)
    assert tenants.list_api_keys(db, b) == []
    assert not tenants.revoke_api_key(db, b, issued.key_id)
    assert tenants.revoke_api_keys_by_prefix(db, b, issued.prefix) == 0
    assert len(tenants.list_api_keys(db, a.tenant)) == 1
