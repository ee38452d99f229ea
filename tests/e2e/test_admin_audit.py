"""The audit log, written by the operator actions themselves: the `carpool` CLI (here) and the dashboard
(tests/e2e/test_admin_dashboard.py) record who created/revoked a key, changed a quota, disabled a tenant.

Entries page newest first by id, filter by the tenant affected, and never hold a key (only its prefix).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy.admin import open_admin_database
from deploy.cli import app
from deploy.settings import ServiceSettings
from services.db.audit import AuditEntry, list_audit, record_audit
from services.db.tenants import get_tenant_by_name


def audit_of(data_dir: Path, *, tenant: str | None = None, limit: int = 50,
             before_id: int | None = None) -> list[AuditEntry]:
    db = open_admin_database(ServiceSettings(data_dir=data_dir))
    try:
        with db.sessions.begin() as session:
            tenant_id = None
            if tenant is not None:
                row = get_tenant_by_name(session, tenant)
                assert row is not None
                tenant_id = row.id
            return list_audit(session, tenant_id=tenant_id, limit=limit, before_id=before_id)
    finally:
        db.dispose()


def test_cli_actions_are_audited_newest_first_and_never_hold_a_key(tmp_path: Path) -> None:
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path)]

    def run(*args: str) -> str:
        result = runner.invoke(app, [*args, *data])
        assert result.exit_code == 0, result.output
        return result.stdout

    first_key = run("tenants", "create", "acme").strip().splitlines()[-1]
    run("tenants", "create", "other")
    run("tenants", "set-quota", "acme", "--tokens-per-minute", "500")
    second_key = run("keys", "create", "acme").strip().splitlines()[-1]
    run("keys", "revoke", second_key[:12])
    run("tenants", "disable", "acme")

    entries = audit_of(tmp_path, tenant="acme")
    assert [e.action for e in entries] == ["tenant.disable", "key.revoke", "key.create", "quota.change",
                                           "tenant.create"]
    assert all(e.actor_tenant_id is None and e.actor_key_prefix is None for e in entries)  # the CLI
    quota = entries[3].detail
    assert quota["before"]["tokens_per_minute"] is None and quota["after"]["tokens_per_minute"] == 500
    assert entries[2].detail == {"prefix": second_key[:12]} and entries[1].detail["prefix"] == second_key[:12]
    dumped = json.dumps([e.detail for e in audit_of(tmp_path)])
    assert first_key not in dumped and second_key not in dumped

    everyone = audit_of(tmp_path)
    assert len(everyone) == 6 and len({e.tenant_id for e in everyone}) == 2  # acme's five, other's one
    page = audit_of(tmp_path, limit=2)
    rest = audit_of(tmp_path, limit=50, before_id=page[-1].id)
    assert [e.id for e in page + rest] == [e.id for e in everyone]


def test_listing_refuses_unbounded_pages(tmp_path: Path) -> None:
    db = open_admin_database(ServiceSettings(data_dir=tmp_path))
    try:
        with db.sessions.begin() as session:
            record_audit(session, action="tenant.create", target_type="tenant", target_id="t",
                         actor_tenant_id=None, actor_key_prefix=None, tenant_id="t", detail={"x": "y" * 5000})
            assert len(list_audit(session, tenant_id="t", limit=1, before_id=None)[0].detail["x"]) < 2100
            with pytest.raises(ValueError, match="limit must be in"):
                list_audit(session, tenant_id=None, limit=0, before_id=None)
    finally:
        db.dispose()
