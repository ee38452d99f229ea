"""`ServiceSettings` parsing (environment, overrides, base-model specs) and the admin CLI commands."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from deploy.admin import bootstrap_admin, open_admin_database
from deploy.cli import app
from deploy.settings import BaseModelSpec, ServiceSettings, parse_base_model
from services.auth.keys import looks_like_api_key
from services.auth.tenants import authenticate


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "CARPOOL_DATA_DIR",
        "CARPOOL_DATABASE_URL",
        "CARPOOL_BASE_MODELS",
        "CARPOOL_PORT",
        "CARPOOL_HOST",
        "CARPOOL_CACHE_DIR",
    ):
        monkeypatch.delenv(name, raising=False)


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = ServiceSettings()
    assert settings.data_dir == Path("data") and settings.host == "127.0.0.1" and settings.port == 8000
    assert settings.served_base_models() == [
        BaseModelSpec("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m")
    ]
    assert settings.resolved_database_url() == f"sqlite:///{tmp_path / 'data' / 'carpool.db'}"
    assert settings.models_dir == Path("data") / "models"
    assert all(field.description for field in ServiceSettings.model_fields.values())


def test_environment_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_DATA_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CARPOOL_PORT", "9001")
    monkeypatch.setenv("CARPOOL_BASE_MODELS", "tiny=/models/tiny, big=hf://org/big@main")
    settings = ServiceSettings()
    assert settings.data_dir == tmp_path / "state" and settings.port == 9001
    assert settings.served_base_models() == [
        BaseModelSpec("tiny", "/models/tiny"),
        BaseModelSpec("big", "hf://org/big@main"),
    ]
    monkeypatch.setenv("CARPOOL_BASE_MODELS", '["only=/m"]')
    assert ServiceSettings().served_base_models() == [BaseModelSpec("only", "/m")]
    override = ServiceSettings(data_dir=tmp_path / "cli", base_models=["x=/y"], port=8100)
    assert (
        override.data_dir == tmp_path / "cli" and override.port == 8100 and override.base_models == ["x=/y"]
    )
    monkeypatch.setenv("CARPOOL_DATABASE_URL", "postgres://u@db/carpool")
    assert ServiceSettings().resolved_database_url() == "postgresql+psycopg://u@db/carpool"


def test_base_model_specs() -> None:
    assert parse_base_model("smollm2-135m") == BaseModelSpec(
        "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"
    )
    assert parse_base_model("org/name=gguf:///m.gguf") == BaseModelSpec("org/name", "gguf:///m.gguf")
    for bad in ("", "=src", "name=", "some/unknown-model"):
        with pytest.raises(ValueError, match="NAME=SOURCE"):
            parse_base_model(bad)
    with pytest.raises(ValidationError):
        ServiceSettings(base_models=["a=/x", "a=/y"])
    with pytest.raises(ValidationError):
        ServiceSettings(port=0)


def test_cli_tenants_create_prints_the_key_last(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["tenants", "create", "acme", "--max-models", "2", "--data-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    key = result.stdout.strip().splitlines()[-1]
    assert looks_like_api_key(key)
    db = open_admin_database(ServiceSettings(data_dir=tmp_path))
    try:
        with db.sessions.begin() as session:
            tenant = authenticate(session, key)
            assert tenant is not None and tenant.name == "acme" and tenant.quotas.max_models == 2
    finally:
        db.dispose()

    again = runner.invoke(app, ["tenants", "create", "acme", "--data-dir", str(tmp_path)])
    assert again.exit_code == 1 and "already exists" in again.output
    listing = runner.invoke(app, ["tenants", "list", "--data-dir", str(tmp_path)])
    assert "acme" in listing.stdout and key not in listing.stdout


def test_cli_keys_create_and_revoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_DATA_DIR", str(tmp_path))
    runner = CliRunner()
    assert runner.invoke(app, ["tenants", "create", "acme"]).exit_code == 0
    created = runner.invoke(app, ["keys", "create", "acme"])
    key = created.stdout.strip().splitlines()[-1]
    assert created.exit_code == 0 and looks_like_api_key(key)
    revoked = runner.invoke(app, ["keys", "revoke", key[:12]])
    assert revoked.exit_code == 0 and "revoked 1 key" in revoked.stdout
    missing = runner.invoke(app, ["keys", "revoke", key[:12]])
    assert missing.exit_code == 1
    assert runner.invoke(app, ["keys", "create", "nobody"]).exit_code == 1
    assert runner.invoke(app, ["migrate"]).exit_code == 0


def test_first_start_prints_the_admin_key_once(tmp_path: Path) -> None:
    db = open_admin_database(ServiceSettings(data_dir=tmp_path))
    try:
        first, second = io.StringIO(), io.StringIO()
        assert bootstrap_admin(db, first)
        assert not bootstrap_admin(db, second)
        key = first.getvalue().strip().splitlines()[-1]
        assert looks_like_api_key(key) and second.getvalue() == ""
        with db.sessions.begin() as session:
            admin = authenticate(session, key)
            assert admin is not None and admin.is_admin and admin.name == "admin"
    finally:
        db.dispose()


def test_a_pass_never_holds_more_adapters_than_the_resident_slots() -> None:
    """A pass pins its adapters on the device: with more of them than `max_resident_adapters` the worker's
    banks would grow past the slots the operator sized (bench/load.py saw 78 rows for 16 slots)."""
    from deploy.embedded import _scheduler

    few_slots = ServiceSettings(max_resident_adapters=16, max_adapters_per_pass=64)
    assert _scheduler(few_slots).limits.max_adapters_per_pass == 16
    few_per_pass = ServiceSettings(max_resident_adapters=64, max_adapters_per_pass=8)
    assert _scheduler(few_per_pass).limits.max_adapters_per_pass == 8


def test_the_answered_result_grace_reaches_the_control_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CARPOOL_ANSWERED_RESULT_SECONDS`: how long a result stays once answered; 0 drops it, below 0 is refused."""
    from deploy.embedded import _control_options

    assert _control_options(ServiceSettings()).answered_result_s == 120.0
    monkeypatch.setenv("CARPOOL_ANSWERED_RESULT_SECONDS", "0")
    assert _control_options(ServiceSettings()).answered_result_s == 0.0
    monkeypatch.setenv("CARPOOL_ANSWERED_RESULT_SECONDS", "-1")
    with pytest.raises(ValidationError, match="answered_result_seconds"):
        ServiceSettings()
