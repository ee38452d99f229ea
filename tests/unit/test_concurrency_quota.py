"""`QuotaGate.check_concurrency` on a real database: under the limit it costs one statement (the count),
and only at the limit does it look for the gap exemption (the model's next runnable request is let through,
so refusing it cannot stall the model). With a limit in force every submission runs this check; at 512 SDK
tenants in cluster mode the gap query was a sixth of the gateway's database time (py-spy)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from services.auth.tenants import Tenant
from services.control.api import QuotaExceeded
from services.control.quotas import QuotaGate, QuotaOptions
from services.db import database_url_for_data_dir, open_database
from services.db.database import Database
from services.db.ids import ModelId, TenantId
from services.db.request_log import record_request
from services.db.runs import create_training_run
from services.db.sessions import create_session
from services.db.tenants import TenantQuotas, create_tenant, tenant_quotas


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = open_database(database_url_for_data_dir(tmp_path), migrate=True)
    yield database
    database.dispose()


def _setup(db: Database) -> tuple[Tenant, ModelId]:
    with db.sessions.begin() as s:
        row = create_tenant(s, "t")
        session = create_session(s, TenantId(row.id))
        run = create_training_run(s, TenantId(row.id), session.id, 0, base_model="m", lora_rank=4)
        return Tenant.from_row(row), ModelId(run.id)


def _log(db: Database, tenant: Tenant, model: ModelId, *seq_ids: int) -> None:
    with db.sessions.begin() as s:
        for seq_id in seq_ids:
            record_request(s, TenantId(tenant.id), "forward_backward", model_id=model, seq_id=seq_id)


def _check(db: Database, gate: QuotaGate, tenant: Tenant, model: ModelId, seq_id: int) -> int:
    """Run the check; returns the statements it executed."""
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        with db.sessions.begin() as s:
            gate.check_concurrency(s, tenant, model_id=model, seq_id=seq_id)
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    return sum(1 for text in statements if text.lstrip().upper().startswith("SELECT"))


def test_under_the_limit_the_check_is_one_statement(db: Database) -> None:
    tenant, model = _setup(db)
    gate = QuotaGate(QuotaOptions(default_max_concurrent_requests=3))
    _log(db, tenant, model, 2, 3)  # two unfinished, later than seq 1
    assert _check(db, gate, tenant, model, 1) == 1


def test_at_the_limit_only_the_request_the_model_waits_for_is_let_through(db: Database) -> None:
    tenant, model = _setup(db)
    gate = QuotaGate(QuotaOptions(default_max_concurrent_requests=2))
    _log(db, tenant, model, 2, 3)  # the limit is reached; seq 1 is what the model waits for
    assert _check(db, gate, tenant, model, 1) >= 2  # the count, then the gap
    with pytest.raises(QuotaExceeded, match="2 unfinished requests, its limit is 2"):
        _check(db, gate, tenant, model, 4)  # nothing later is waiting on seq 4: refused


def test_a_tenants_own_limit_comes_before_the_default(db: Database) -> None:
    tenant, model = _setup(db)
    _log(db, tenant, model, 5)
    own = Tenant(tenant.id, tenant.name, tenant.is_admin, TenantQuotas(max_concurrent_requests=1))
    with pytest.raises(QuotaExceeded):
        _check(db, QuotaGate(QuotaOptions(default_max_concurrent_requests=10)), own, model, 7)
    assert _check(db, QuotaGate(QuotaOptions(default_max_concurrent_requests=10)), tenant, model, 7) == 1


def test_quotas_are_read_from_the_tenant_row_field_by_field(db: Database) -> None:
    with db.sessions.begin() as s:
        row = create_tenant(s, "q")
        row.max_concurrent_requests, row.max_models = 7, 3
        assert tenant_quotas(row) == TenantQuotas(max_concurrent_requests=7, max_models=3)
