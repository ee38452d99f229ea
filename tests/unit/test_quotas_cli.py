"""`carpool tenants set-quota`: changes only the quotas named, 0 removes one, unknown tenants and negative
values fail with a message, and `tenants list` shows the quotas."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from deploy.admin import open_admin_database
from deploy.cli import app
from deploy.settings import ServiceSettings
from services.db.tenants import TenantQuotas, get_tenant_by_name, tenant_quotas


def quotas_of(data_dir: Path, name: str) -> TenantQuotas:
    db = open_admin_database(ServiceSettings(data_dir=data_dir))
    try:
        with db.sessions.begin() as session:
            row = get_tenant_by_name(session, name)
            assert row is not None
            return tenant_quotas(row)
    finally:
        db.dispose()


def test_set_quota_changes_only_what_is_named_and_zero_removes_a_limit(tmp_path: Path) -> None:
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path)]
    assert runner.invoke(app, ["tenants", "create", "acme", "--max-models", "3", *data]).exit_code == 0

    result = runner.invoke(app, ["tenants", "set-quota", "acme", "--tokens-per-minute", "5000",
                                 "--max-concurrent", "8", *data])
    assert result.exit_code == 0, result.output
    assert "tokens_per_minute=5000 max_concurrent=8 max_models=3" in result.stdout
    assert quotas_of(tmp_path, "acme") == TenantQuotas(max_models=3, tokens_per_minute=5000,
                                                       max_concurrent_requests=8)

    result = runner.invoke(app, ["tenants", "set-quota", "acme", "--max-models", "0", *data])
    assert result.exit_code == 0, result.output
    assert quotas_of(tmp_path, "acme") == TenantQuotas(max_models=None, tokens_per_minute=5000,
                                                       max_concurrent_requests=8)

    listing = runner.invoke(app, ["tenants", "list", *data]).stdout.splitlines()
    assert "TOKENS/MIN" in listing[0] and "MAX_CONCURRENT" in listing[0]
    assert next(line for line in listing if line.startswith("acme")).split()[-3:] == ["-", "5000", "8"]


def test_set_quota_refuses_unknown_tenants_and_negative_limits(tmp_path: Path) -> None:
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path)]
    assert runner.invoke(app, ["tenants", "create", "acme", *data]).exit_code == 0
    unknown = runner.invoke(app, ["tenants", "set-quota", "nobody", "--max-models", "1", *data])
    assert unknown.exit_code == 1 and "no tenant named 'nobody'" in unknown.output
    negative = runner.invoke(app, ["tenants", "set-quota", "acme", "--tokens-per-minute", "-5", *data])
    assert negative.exit_code == 1 and "must be >= 0" in negative.output
    assert quotas_of(tmp_path, "acme") == TenantQuotas()
