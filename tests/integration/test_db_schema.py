"""Engines, URLs, schema-version checks and column types, on SQLite and (where it matters) PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import StatementError

from services.db import (
    DATABASE_URL_ENV,
    SchemaVersionError,
    check_at_head,
    database_url_for_data_dir,
    make_engine,
    open_database,
    resolve_database_url,
    upgrade_to_head,
)
from services.db.engine import normalize_database_url
from services.db.models import TenantRow
from services.db.schema import MIGRATIONS_DIR_ENV, head_revision, migrations_dir
from services.db.testing import scratch_postgres_database
from tests.required import require_postgres


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield database_url_for_data_dir(tmp_path)
        return
    require_postgres()
    with scratch_postgres_database(prefix="carpool_schema") as url:
        yield url


def test_check_at_head_tells_how_to_fix(empty_url: str) -> None:
    with pytest.raises(SchemaVersionError, match=r"code expects .*: run `carpool migrate`") as excinfo:
        check_at_head(empty_url)
    assert excinfo.value.current is None and excinfo.value.expected == head_revision()
    with pytest.raises(SchemaVersionError):
        open_database(empty_url)
    upgrade_to_head(empty_url)
    check_at_head(empty_url)


def test_check_at_head_spots_a_newer_schema(empty_url: str) -> None:
    upgrade_to_head(empty_url)
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    finally:
        engine.dispose()
    with pytest.raises(SchemaVersionError, match="newer Carpool") as excinfo:
        check_at_head(empty_url)
    assert excinfo.value.current == "9999"


def test_open_database_migrates_and_round_trips_utc(empty_url: str) -> None:
    database = open_database(empty_url, migrate=True)
    try:
        plus_two = timezone(timedelta(hours=2))
        created = datetime(2026, 5, 6, 9, 30, tzinfo=plus_two)
        with database.sessions.begin() as db:
            db.add(TenantRow(id="t1", name="acme", created_at=created))
        with database.sessions() as db:
            row = db.scalars(select(TenantRow)).one()
            db.refresh(row)
            assert row.created_at == created
            assert row.created_at.tzinfo == UTC and row.created_at.hour == 7
            assert not row.is_admin and not row.disabled
        with pytest.raises(StatementError, match="naive datetime"), database.sessions.begin() as db:
            db.add(TenantRow(id="t2", name="naive", created_at=datetime(2026, 1, 1)))
    finally:
        database.dispose()


def test_sqlite_connections_get_wal_and_foreign_keys(tmp_path: Path) -> None:
    url = database_url_for_data_dir(tmp_path / "nested" / "dir")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert (tmp_path / "nested" / "dir" / "carpool.db").is_file()
    finally:
        engine.dispose()


def test_foreign_keys_stay_on_after_migrating_sqlite(tmp_path: Path) -> None:
    database = open_database(database_url_for_data_dir(tmp_path), migrate=True)
    try:
        with database.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        database.dispose()


def test_in_memory_sqlite_is_migrated_in_place() -> None:
    database = open_database("sqlite://", migrate=True)
    try:
        with database.sessions.begin() as db:
            db.add(TenantRow(id="t1", name="acme", created_at=datetime.now(UTC)))
        with database.sessions() as db:
            assert db.scalar(select(TenantRow.name)) == "acme"
    finally:
        database.dispose()


def test_database_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = database_url_for_data_dir(tmp_path)
    assert url == f"sqlite:///{tmp_path.resolve()}/carpool.db"
    assert normalize_database_url("postgres://u:p%40ss@h/db") == "postgresql+psycopg://u:p%40ss@h/db"
    assert normalize_database_url("postgresql://h/db") == "postgresql+psycopg://h/db"
    assert normalize_database_url("sqlite:///x.db") == "sqlite:///x.db"

    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    assert resolve_database_url(tmp_path) == url
    with pytest.raises(ValueError, match=DATABASE_URL_ENV):
        resolve_database_url()
    monkeypatch.setenv(DATABASE_URL_ENV, "postgresql://db.internal/carpool")
    assert resolve_database_url(tmp_path) == "postgresql+psycopg://db.internal/carpool"


def test_migrations_dir_is_found_and_overridable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MIGRATIONS_DIR_ENV, raising=False)
    assert (migrations_dir() / "versions").is_dir()
    monkeypatch.setenv(MIGRATIONS_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=MIGRATIONS_DIR_ENV):
        migrations_dir()
